"""The producer's bound on the backlog: an estimate of the samples not yet delivered
to its consumer group, and a push's wait for room under ``max_backlog``.

A reading asks Redis (``backlog()``: two round trips, exact from the stamp each pushed
entry carries); between readings the estimate adds this producer's own pushes, each once,
and takes out what a flush's reply says was refused or was already in a reading (``_place``).
Kept apart from the push path because the counting argument is subtle and is read on its
own: a push only asks ``_has_room`` and ``_count``, and a flush only calls ``_place``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from redis.exceptions import ResponseError

from stream_reward.errors import BackpressureError, BrokerError
from stream_reward.trainer.batches import _BatchLayer
from stream_reward.wire.connection import redis_errors
from stream_reward.wire.entries import group_state
from stream_reward.wire.lag import samples_behind
from stream_reward.wire.push import DUPLICATE, FRESH

log = logging.getLogger(__name__)


def _cancel_requested() -> bool:
    """Whether the running task was asked to cancel (Python 3.11+; on 3.10, which cannot
    tell, False: a cancel landing together with aclose() then ends as its error)."""
    cancelling = getattr(asyncio.current_task(), "cancelling", None)
    return bool(cancelling and cancelling())


def _retrieve(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()


class _BacklogLayer(_BatchLayer):
    """Counts a RolloutProducer's pushes against ``max_backlog`` (see the module docstring)."""

    def _has_room(self, n: int) -> bool:
        """``n`` entries may be queued without asking Redis first (the common case)."""
        return self._groups_ready and (not self.config.max_backlog or self._room_known(n))

    async def _make_room(self, n: int) -> None:
        """Before queueing ``n`` entries, when _has_room says no: the groups' setup (the
        first push) and a place under ``max_backlog``."""
        # Only a push that must ask Redis first pays for the error context (one push per sample).
        with redis_errors(f"push of {n} trajectories failed"):
            if not self._groups_ready:
                # In a task of its own: redis-py can lose a cancel that lands inside a
                # command (it completes and returns as if nothing happened), and the push
                # would go on to queue a sample its caller gave up on. Awaited through a
                # shield, the cancel is raised here; the (idempotent) setup finishes alone.
                await asyncio.shield(self._ensure_groups())
            if self.config.max_backlog and not self._room_known(n):
                await self._wait_for_room(n)

    def _count(self, n: int) -> int:
        """Count ``n`` entries into the backlog estimate; returns how many it counted.
        Called with no await since the room check: the pushes of one loop turn see each
        other, so together they never pass max_backlog. They leave it when their flush's
        reply says they were refused (see _place), or at the next reading."""
        if not self.config.max_backlog:
            return 0
        self._backlog += n
        return n

    def _release(self, reserved: list[tuple[set[str], str]], counted: int) -> None:
        for seen, uid in reserved:
            seen.discard(uid)
        self._backlog = max(0, self._backlog - counted)

    def _place(self, flight: list[Any], part: int, after: int | None, chunk: list[int], verdicts: list[int]) -> None:
        """One push call's reply: its samples leave the flight, refused ones the estimate too.
        ``after`` is the stream's pushed count once the call's samples were in (None: unknown).

        A backlog reading that ended while the call was on its way counted the call's samples
        as still to come; if the call ran before the reading read that count (``after`` at most
        the reading's), the reading had them already: counted twice, one copy leaves. A reply
        that comes while a reading is on its way is kept for the reading to place when it ends.
        A call that cannot be placed (its count started again, see wire/push.py) stays counted."""
        fresh = dup = 0
        for a in chunk:
            verdict = verdicts[a]
            if verdict == FRESH:
                fresh += 1
            elif verdict == DUPLICATE:
                dup += 1
        flight[0] -= len(chunk)
        leaving = len(chunk) - fresh - dup  # refused: not queued by this call
        if after is not None and after < 0:  # the call started the stream's count again
            after = None
        read = flight[1]
        if read is not None and after is not None:
            at = read.get(part)
            if at is not None and after <= at:
                # A duplicate too: the first push of it ran before this one, so before the reading.
                leaving += fresh + dup
        if leaving:
            self._backlog = max(0, self._backlog - leaving)
        reading = self._backlog_reading
        if reading is not None and not reading.done():
            self._replies_while_reading.append((part, after, fresh + dup))

    async def backlog(self) -> int:
        """Samples in the streams not yet delivered to the consumer group: what
        ``max_backlog`` bounds. Redis counts a group's lag in entries, which hold up to
        ``samples_per_entry`` samples each; every entry a script queues is stamped with
        the samples queued on its stream before it (``wire.push.FIELD_STAMP``), so the
        count is exact: the stream's pushed samples less the stamp of the first entry
        past the group's last delivered one. Two round trips. Where it cannot be exact,
        wire.lag.samples_behind's estimate errs on the side of waiting.
        """
        return (await self._read_counts())[0]

    async def _read_counts(self) -> tuple[int, dict[int, int]]:
        """backlog(), and each stream's pushed count as it read it (where it could)."""
        async with self.client.pipeline(transaction=False) as pipe:
            for stream in self.keys.streams():
                pipe.xinfo_groups(stream)
            replies = await pipe.execute(raise_on_error=False)
        mine: list[tuple[int, dict[str, Any]]] = []
        for p, groups in enumerate(replies):
            if isinstance(groups, ResponseError) and "no such key" in str(groups):
                groups = []
            if isinstance(groups, Exception):
                raise groups
            found = [g for g in map(group_state, groups) if g["name"] == self.config.group]
            if not found:
                # The stream or its group is gone (Redis restarted without persistence,
                # or someone deleted them): recreated by the next _ensure_groups.
                self._groups_ready = False
                continue
            mine.append((p, found[0]))
        if not mine:
            return 0, {}
        async with self.client.pipeline(transaction=False) as pipe:
            for p, group in mine:
                last = group["last_delivered_id"] or "0-0"
                # The count first: a push landing between the two is in neither (its entry's
                # stamp is the count read), so the reading is exact at the count, and a push's
                # reply places it before or after the reading (see _place).
                pipe.hmget(self.keys.pushed(p), "samples", "entries")
                pipe.xrange(self.keys.stream(p), min="-" if last == "0-0" else f"({last}", count=1)
                pipe.xlen(self.keys.stream(p))
            replies = await pipe.execute()
        total = 0
        counts: dict[int, int] = {}  # each exactly read stream's pushed count
        for (p, group), (samples, entries), first, length in zip(mine, replies[::3], replies[1::3], replies[2::3]):
            behind, exact = samples_behind(
                pushed_samples=samples,
                pushed_entries=entries,
                first_undelivered=first[0][1] if first else None,
                lag_entries=group["lag"],
                length=int(length),
                pending_entries=group["pending"],
                samples_per_entry=self.config.samples_per_entry,
            )
            total += behind
            if exact and samples is not None:
                counts[p] = int(samples)
        return total, counts

    def _room_known(self, incoming: int) -> bool:
        """The local estimate says there is room: no need to wait for Redis (the common case).

        The estimate is the last reading plus what this producer queued since, so
        consumers only ever lower the truth below it; other producers' pushes are
        what it misses, and those a reading catches up with every ``backlog_poll_s``.
        A stale estimate with room lets the push go on and refreshes in the
        background: waiting for the reading cost every push of a poll interval a
        round trip (a third of all per-sample pushes under load)."""
        if self._backlog + incoming > self.config.max_backlog:
            return False
        if time.monotonic() - self._backlog_checked_at >= self.config.backlog_poll_s:
            self._start_backlog_reading()
        return True

    def _start_backlog_reading(self) -> asyncio.Future[None]:
        """The backlog reading in flight, started if there is none: one for every push waiting on it."""
        if self._backlog_reading is None or self._backlog_reading.done():
            self._backlog_reading = asyncio.ensure_future(self._read_backlog())
            # Its error (Redis away) is the waiting push's to raise, not a stray log line.
            self._backlog_reading.add_done_callback(_retrieve)
        return self._backlog_reading

    async def _wait_for_room(self, incoming: int) -> None:
        limit = self.config.max_backlog
        if not limit:
            return
        # Ask Redis at most every poll interval, and once for all concurrent pushes: the
        # check is a round trip, and a local estimate (last reading + what we pushed
        # since) is good enough between.
        closes = self._closes
        while True:
            if self._closes != closes:
                # Closed while this push slept between readings: reading on would make a
                # new client after the close and wait for room for ever.
                raise BrokerError("the producer was closed while this push waited for room")
            if time.monotonic() - self._backlog_checked_at >= self.config.backlog_poll_s:
                reading = self._start_backlog_reading()
                try:
                    await asyncio.shield(reading)
                except asyncio.CancelledError:
                    if reading is self._reading_closed and not _cancel_requested():
                        # aclose() ended the reading, not this push's caller: an error it can
                        # handle, not a cancel nobody asked for. (A loop cancelling every task,
                        # as asyncio.run does on the way out, cancels the reading too: that is
                        # this push's cancel, and stays one, on 3.10 as well.)
                        raise BrokerError("the producer was closed while this push waited for room") from None
                    raise
            if self._backlog + incoming <= limit or self._backlog == 0:
                return
            if self.config.on_backlog == "raise":
                raise BackpressureError(f"backlog {self._backlog} + {incoming} exceeds max_backlog {limit}")
            await asyncio.sleep(self.config.backlog_poll_s)

    async def _read_backlog(self) -> None:
        try:
            await self._ensure_groups()
            total, pushed = await self._read_counts()
        finally:
            replies, self._replies_while_reading = self._replies_while_reading, []
        # The reading, plus what of this producer's is still to land or landed after it: the
        # samples queued and not yet sent, those on their way (whose replies then take out
        # what the reading had already: _place), and those whose replies came meanwhile and
        # ran after it read the stream's count (or where that cannot be told).
        coming = self._coalescer.unsent() if self._coalescer is not None else 0
        for flight in self._flying.values():
            coming += flight[0]
            flight[1] = pushed
        for part, after, n in replies:
            at = pushed.get(part)
            if after is None or at is None or after > at:
                coming += n
        self._backlog = total + coming
        if not self._groups_ready:
            log.warning("stream or consumer group %r missing (Redis lost its state?): recreating", self.config.group)
            await self._ensure_groups()
        # The monotonic clock, not the loop's: read on every push, and the loop first
        # has to be looked up (about a fifth of the room check).
        self._backlog_checked_at = time.monotonic()
