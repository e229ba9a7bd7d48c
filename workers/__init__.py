"""The runnable consumer side of stream-reward: worker processes and their supervisor.

``python -m workers --redis URL`` (or ``stream-reward worker``) runs a pool.
"""
