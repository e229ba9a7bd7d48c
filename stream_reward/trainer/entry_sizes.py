"""Samples in the newest entries a producer queued: its backlog in samples.

Redis counts a stream's backlog (the group's lag) in entries, and an entry holds
up to ``samples_per_entry`` samples, so ``max_backlog``, a bound on samples,
needs the lag turned into samples. The lag is the newest entries of the stream;
the producer remembers how many samples each entry it queued held (a ring of
running totals), and counts the newest ones. Exact for one producer; entries
beyond what it remembers (another producer's, or a lag longer than the ring)
count as the mean entry of every producer so far (the push script keeps the
counts: ``Keys.pushed``). Counting them as full ones would be safe and far too
high: producers that push one sample at a time queue entries of a few.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["EntrySizes"]


class EntrySizes:
    def __init__(self, keep: int = 1 << 16) -> None:
        self._size = keep + 1
        self._totals = [0] * self._size  # running total after entry n at n % size
        self._n = 0  # entries recorded

    def add(self, sizes: Iterable[int]) -> None:
        """Record the sizes of entries just queued, in order."""
        total = self._totals[self._n % self._size]
        for size in sizes:
            total += size
            self._n += 1
            self._totals[self._n % self._size] = total

    def samples_in_last(self, entries: int, mean: float) -> int:
        """Samples in the newest ``entries`` entries; those this producer did not queue
        (or no longer remembers) count as ``mean`` samples each."""
        if entries <= 0:
            return 0
        known = min(self._n, self._size - 1, entries)
        last = self._totals[self._n % self._size]
        return last - self._totals[(self._n - known) % self._size] + round((entries - known) * mean)
