"""The graceful stop: drain, hand back, release.

On a stop a worker finishes what is in flight within drain_timeout_s and cancels the rest;
entries that handed samples back hand back the rest and are acked; the quarantine note of
a suspect being hunted is dropped (a stop is not a crash); and every entry still pending
under this consumer goes back to the group marked idle for ever, so that a live peer takes
it at once without the delivery a claim would cost (``_release``). A slow or absent Redis
bounds each step; what cannot be released waits out reclaim_idle_ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from stream_reward.wire.connection import REDIS_ERRORS
from stream_reward.worker.housekeeping import Housekeeping
from stream_reward.worker.opening import EntryOpening

__all__ = ["Stopping"]

log = logging.getLogger(__name__)


# An entry released on shutdown is marked idle this long, so that any live
# worker's next reclaim sweep takes it at once instead of after reclaim_idle_ms.
_RELEASED_IDLE_MS = 10 * 365 * 24 * 3600 * 1000


class Stopping(EntryOpening, Housekeeping):
    """Drain, finish the handed-back entries, release, say farewell."""

    async def _drain(self) -> None:
        """Finish in-flight samples within drain_timeout_s, cancel the rest, and get ready for
        the release (run() releases what is left pending once the writer has stopped). What
        Redis work follows the deadline shares 2 s more: a slow Redis must not stretch a stop."""
        loop = asyncio.get_running_loop()
        if self._drain_deadline is None:
            self._drain_deadline = loop.time() + self.config.drain_timeout_s
        deadline = self._drain_deadline
        cleanup_by = deadline + 2.0

        def left() -> float:
            return max(0.01, cleanup_by - loop.time())

        # A reclaim sweep under way ends at the stop (a hunt between samples). Wait for it:
        # what it claims as the stop comes must be among what is finished or released, and
        # its hunt's note must be settled before the suspect is released.
        swept = False
        try:
            await asyncio.wait_for(self._sweeping.acquire(), timeout=left())
            swept = True
        except asyncio.TimeoutError:
            log.warning("a reclaim sweep did not end at the stop; going on without it")
        try:
            while self.stats.in_flight > 0 and loop.time() < deadline:
                self._writer_idle.clear()
                try:
                    await asyncio.wait_for(self._writer_idle.wait(), timeout=max(0.01, deadline - loop.time()))
                except asyncio.TimeoutError:  # TimeoutError from 3.11 on; not yet on 3.10
                    break
            unfinished = list(self._task_entries.items())
            for task, _ in unfinished:
                task.cancel()
            if unfinished:
                await asyncio.wait([t for t, _ in unfinished], timeout=1.0)
            # Entries that handed samples back hand back the rest and are acked, not released.
            open_entries = {entry for _, entry in unfinished} | set(self._open)
            await self._finish_handed(open_entries & self._handed.keys(), left)
            with contextlib.suppress(asyncio.TimeoutError, *REDIS_ERRORS):
                if self._hunting is not None:  # a suspect still scored alone (it is not a crash)
                    await asyncio.wait_for(self._client.hdel(*self._hunting), timeout=left())
                # A suspect let go after a Redis error may have left its note: drop it, or the
                # peer that takes the suspect finds it and dead-letters an innocent sample.
                await asyncio.wait_for(self._drop_stale_notes(), timeout=left())
            # Renewed no more; and wait out a renewal under way, which would undo the release.
            self._renewals_over = True
            try:
                await asyncio.wait_for(self._renewing.acquire(), timeout=left())
                self._renewing.release()
            except asyncio.TimeoutError:  # a renewal stuck on a Redis that is away: so is the release
                pass
            self.stats.in_flight -= len(unfinished)
        finally:
            if swept:
                self._sweeping.release()

    async def _release(self) -> None:
        """At a stop, give every entry still pending under this consumer back to the group
        (RELEASE_SCRIPT): marked idle for ever so that the next sweep of any live worker
        takes them at once, without the delivery their claim cost (rolling restarts over a
        slow sample would otherwise quarantine it, and at max_deliveries dead-letter it).
        Pending under this consumer, not only those it knows of: a claim that landed after
        the stop (a slow sweep) is released too."""
        # A suspect whose note could not be dropped (Redis away) is kept: a peer would find
        # the note and dead-letter it; it waits out reclaim_idle_ms instead.
        noted = sorted({note.rpartition(b"/")[0] for _, note in self._stale_notes})
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 2.0  # for all of it: a slow Redis must not stretch a stop
        released = 0
        try:
            for stream in self.keys.streams():
                args = [self.config.group, self.config.consumer, _RELEASED_IDLE_MS, *noted]
                released += await asyncio.wait_for(
                    self._release_script(keys=[stream], args=args), max(0.0, deadline - loop.time())
                )
            if released:
                log.info("released %d unfinished entries to other workers", released)
        except (asyncio.TimeoutError, *REDIS_ERRORS) as exc:
            # They stay pending under this consumer: reclaimed after reclaim_idle_ms.
            log.warning("could not release the unfinished entries (%s)", type(exc).__name__)

    async def _finish_handed(self, entries: set[tuple[int, bytes]], left: Callable[[], float]) -> None:
        """On a stop, entries that handed samples back: hand back the samples started here
        that are not settled too, and ack the entry, rather than release it whole. Those it
        cannot finish (Redis failing, or ``left()`` seconds of the stop's budget spent) are
        released whole; the next worker leaves their handed samples to the copies.

        Settled: a result queued since the hand-back (``_queue`` drops it from the list), or
        one in the ledger (settled before it). The ack goes through the writer, after every
        result still queued for the entry: if the writer cannot write them, the entry stays
        pending and is redelivered, never acked without them."""
        for entry in entries:
            partition, entry_id = entry
            started = self._handed[entry]
            try:
                have = await asyncio.wait_for(self._with_results(partition, started), timeout=left())
                rest = [m for m in started if id(m) not in have]
                if rest:
                    await asyncio.wait_for(self._hand_back(partition, entry_id, rest), timeout=left())
            except (asyncio.TimeoutError, *REDIS_ERRORS) as exc:
                log.warning("could not hand back the rest of entry %s (%s); released whole", entry_id, exc)
                continue
            self._ack_alone(partition, entry_id)

    async def _farewell(self) -> None:
        try:
            await asyncio.wait_for(self._client.hdel(self.keys.workers(), self.config.consumer), timeout=1.0)
        except (asyncio.TimeoutError, *REDIS_ERRORS):
            pass
