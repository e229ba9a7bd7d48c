"""The wire: the records that travel through Redis, their codecs, every key name, and the connection."""
