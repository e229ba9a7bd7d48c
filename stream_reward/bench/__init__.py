"""Benchmarks: each module is a bench with ``main(argv) -> int``; ``stream-reward bench NAME`` runs it.

``verifier_server`` is the reference verifier the benches and the tests run against.
"""
