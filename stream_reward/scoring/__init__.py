"""Scoring machinery: the scorer protocol, killable scorer processes, retries, the global quota."""
