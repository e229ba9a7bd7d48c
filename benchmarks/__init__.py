"""Benchmarks: each module is a bench with ``main(argv) -> int``; ``stream-reward bench NAME`` runs it."""
