"""Built-in scorers: rules (math answers), remote verifiers over HTTP, code sandboxes.

Each module holds one kind of scorer; ``stream_reward.managers.registry.build_scorer``
turns a ``--scorer`` spec into one of them.
"""
