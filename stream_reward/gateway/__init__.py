"""The HTTP gateway: other frameworks' wire formats in front of stream-reward."""
