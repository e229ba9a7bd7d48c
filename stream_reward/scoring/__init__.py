"""Scoring: everything between a trajectory and its score.

``scorer`` is the protocol and the verl-style function loader; ``registry`` turns a
``--scorer`` spec and a manager name (verl's ``naive``, ``dapo``, ``batch``, ``prime``,
``remote``, ``rate_limited``) into a Scorer, stacking the ``layers`` (precomputed scores,
overlong shaping, micro-batching, the quota); ``procpool`` runs sync scorers in killable
processes; ``quota`` is the global limiter held in Redis; ``retry`` the backoff for
infrastructure faults. Each family of scorers has its folder: ``rules``, ``http``, ``sandbox``.
"""
