"""The consumer stage: worker processes that read the trajectory streams, score and write results.

``consumer`` holds the ``Worker``; ``main`` is the worker program (``stream-reward worker``,
``python -m stream_reward.worker``); ``supervisor`` runs a pool of them; ``metrics`` and
``watchdog`` watch one.
"""
