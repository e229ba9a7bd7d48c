"""Group commit for pushes: concurrent ``push()`` calls share one round trip.

An agent loop pushes one trajectory at a time from many tasks. Each call hands
its entries to the coalescer and awaits its own verdict; one runner task takes
everything submitted during the current event-loop turn (and, with
``max_delay_s`` > 0, a little longer, up to ``max_entries``) and sends it in
one flush. While a flush is in flight new calls gather for the next one, so
under load the batches grow by themselves and at low load a lone push waits
one loop turn, not a timer. A caller's await returns only after its flush came
back from Redis: the sample is durably queued (or refused) by then.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

__all__ = ["Coalescer"]

E = TypeVar("E")
R = TypeVar("R")


class Coalescer(Generic[E, R]):
    """``await coalescer.submit(entries) -> verdicts``; ``flush(all entries) -> verdicts`` in order."""

    def __init__(
        self,
        flush: Callable[[list[E]], Awaitable[list[R]]],
        *,
        max_entries: int = 1024,
        max_delay_s: float = 0.0,
        max_in_flight: int = 1,
    ) -> None:
        self._flush = flush
        self.max_in_flight = max_in_flight
        self.max_entries = max_entries
        self.max_delay_s = max_delay_s
        self._pending: deque[tuple[list[E], asyncio.Future[list[R]]]] = deque()
        self._count = 0
        self._runner: asyncio.Task[None] | None = None
        self._full: asyncio.Event | None = None
        self._flushes: set[asyncio.Task[None]] = set()

    async def submit(self, entries: list[E]) -> list[R]:
        # Not shielded: a cancelled caller whose entries are already in a flush still
        # has them sent (the flush is the runner's); one not yet taken is skipped.
        return await self.submit_nowait(entries)

    def submit_nowait(self, entries: list[E]) -> asyncio.Future[list[R]]:
        """Queue ``entries`` for the next flush; the future gets their verdicts. Cancelling
        it skips entries not yet taken into a flush."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[R]] = loop.create_future()
        self._pending.append((entries, fut))
        self._count += len(entries)
        if self._runner is None or self._runner.done():
            self._full = asyncio.Event()
            self._runner = asyncio.ensure_future(self._run())
        if self._count >= self.max_entries and self._full is not None:
            self._full.set()
        return fut

    async def _run(self) -> None:
        flushes = self._flushes  # the runner ends when nothing is pending; flushes finish on their own
        try:
            while self._pending:
                if self.max_delay_s > 0 and self._count < self.max_entries:
                    assert self._full is not None
                    try:
                        await asyncio.wait_for(self._full.wait(), self.max_delay_s)
                    except asyncio.TimeoutError:
                        pass
                else:
                    await asyncio.sleep(0)  # let the callers of this loop turn join
                while self._pending:
                    if len(flushes) >= self.max_in_flight:
                        await asyncio.wait(flushes, return_when=asyncio.FIRST_COMPLETED)
                        continue
                    taken = self._take()
                    if taken:
                        task = asyncio.ensure_future(self._send(taken))
                        flushes.add(task)
                        task.add_done_callback(flushes.discard)
        except asyncio.CancelledError:  # the producer is closing under its callers
            for task in flushes:
                task.cancel()
            for _, fut in self._pending:
                fut.cancel()
            self._pending.clear()
            raise

    def _take(self) -> list[tuple[list[E], asyncio.Future[list[R]]]]:
        taken: list[tuple[list[E], asyncio.Future[list[R]]]] = []
        size = 0
        while self._pending and (not taken or size + len(self._pending[0][0]) <= self.max_entries):
            entries, fut = self._pending.popleft()
            self._count -= len(entries)
            if fut.cancelled():
                continue
            taken.append((entries, fut))
            size += len(entries)
        if self._full is not None and self._count < self.max_entries:
            self._full.clear()
        return taken

    async def _send(self, taken: list[tuple[list[E], asyncio.Future[list[R]]]]) -> None:
        batch = [e for entries, _ in taken for e in entries]
        try:
            verdicts = await self._flush(batch)
        except asyncio.CancelledError:
            for _, fut in taken:
                fut.cancel()
            raise
        except Exception as exc:  # each caller hears its flush's error; the runner goes on
            for _, fut in taken:
                if not fut.done():
                    fut.set_exception(exc)
            return
        at = 0
        for entries, fut in taken:
            if not fut.done():
                fut.set_result(verdicts[at : at + len(entries)])
            at += len(entries)

    async def aclose(self) -> None:
        """Wait for what was submitted to be flushed."""
        if self._runner is not None:
            await asyncio.gather(self._runner, return_exceptions=True)
        if self._flushes:
            await asyncio.gather(*self._flushes, return_exceptions=True)
