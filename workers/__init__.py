"""The deployable worker, from a checkout: ``python -m workers --redis URL`` runs a pool.

The worker itself is the library's ``stream_reward.worker`` (an installed host runs
``stream-reward worker``); this folder holds the entry point and the deployment files.
"""
