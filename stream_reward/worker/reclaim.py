"""Reclaiming entries a dead consumer left pending, and the quarantine of suspects.

The reclaimer XAUTOCLAIMs entries idle past reclaim_idle_ms. An entry that keeps coming
back is a *suspect*: it may be the poison that killed its consumers, or an innocent that
was in flight beside it. Suspects are scored alone (no other sample in flight), after a
durable note that the solo attempt started; a suspect that comes back *with* such a note
crashed or stalled a worker on its own, and is dead-lettered. Innocents are never blamed
for a neighbour's crash: a stop or a Redis error drops the note.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import anyio

from stream_reward.wire.connection import (
    REDIS_ERRORS,
    LogLimiter,
)
from stream_reward.worker.members import Member
from stream_reward.worker.opening import EntryOpening
from stream_reward.worker.state import sleep_unless

__all__ = ["UNCOUNT_SCRIPT", "Reclaiming"]

log = logging.getLogger(__name__)

# An XAUTOCLAIM counts a delivery of every entry it returns, those this worker holds already
# too (any of its entries idle past min_idle_ms: with reclaim_idle_ms=0, every one). Those are
# no new delivery: this takes the count back, atomically per stream, of entries still this
# consumer's, so that an entry of a worker that later dies does not reach the next one as a
# suspect, or past max_deliveries, for sweeps that only found it in its own worker's hands.
UNCOUNT_SCRIPT = """
-- KEYS[1]: the stream. ARGV[1]: the group; ARGV[2]: the consumer; ARGV[3...]: entry ids.
for i = 3, #ARGV do
  local row = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])[1]
  -- row: id, consumer, idle ms, times delivered
  if row and row[4] > 1 then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'RETRYCOUNT', row[4] - 1, 'JUSTID')
  end
end
return 0
"""


class Reclaiming(EntryOpening):
    """Sweep idle entries; hunt suspects alone."""

    async def _reclaimer(self, stop: asyncio.Event) -> None:
        # Sweep at least twice per idle period, so a dead consumer's entries wait
        # at most ~1.5x reclaim_idle_ms before someone takes them.
        interval = max(0.05, min(self.config.reclaim_interval_s, self.config.reclaim_idle_ms / 2000))
        limiter = LogLimiter(log)
        while not stop.is_set():
            await sleep_unless(stop, interval)
            if stop.is_set():
                return
            try:
                await self._reclaim_once(self.config.reclaim_idle_ms, stop)
                limiter.recovered()
            except REDIS_ERRORS as exc:
                limiter.warning("reclaim sweep failed: %s", type(exc).__name__)

    async def _reclaim_once(self, min_idle_ms: int, stop: asyncio.Event | None = None) -> int:
        """Claim entries idle past ``min_idle_ms`` from any consumer; returns how many.
        Claims nothing once ``stop`` is set."""
        async with self._sweeping:
            return await self._reclaim_sweep(min_idle_ms, stop)

    async def _reclaim_sweep(self, min_idle_ms: int, stop: asyncio.Event | None) -> int:
        total = 0
        for partition, stream in enumerate(self.keys.streams()):
            start = "0-0"
            while True:
                if stop is not None and stop.is_set():
                    return total
                room = self.config.concurrency - self.stats.in_flight
                if room <= 0:
                    return total
                reply = await self._client.xautoclaim(
                    stream,
                    self.config.group,
                    self.config.consumer,
                    min_idle_time=min_idle_ms,
                    start_id=start,
                    count=max(1, min(room, self.config.read_count) // self._per_entry),
                )
                start, claimed = reply[0], reply[1]
                deleted = reply[2] if len(reply) > 2 else []
                if deleted:  # pending entries whose data was trimmed: nothing left to score
                    await self._client.xack(stream, self.config.group, *deleted)
                again = [eid for eid, _ in claimed if (partition, eid) in self._held]
                if again:  # its own entries, scored or written right now: no delivery (UNCOUNT_SCRIPT)
                    await self._uncount(keys=[stream], args=[self.config.group, self.config.consumer, *again])
                claimed = [(eid, fields) for eid, fields in claimed if fields and (partition, eid) not in self._held]
                if claimed:
                    deliveries = await self._deliveries(stream, [eid for eid, _ in claimed])
                    self.stats.reclaimed += len(claimed)
                    total += len(claimed)
                    log.info("reclaimed %d idle entries from %s", len(claimed), stream)
                    limit = self.config.quarantine_after_deliveries
                    fresh = [e for e in claimed if deliveries[e[0]] <= limit]
                    suspects = [e for e in claimed if deliveries[e[0]] > limit]
                    await self._process(partition, fresh, deliveries)
                    if suspects:
                        await self._quarantine(partition, suspects, deliveries)
                if start in (b"0-0", "0-0"):
                    break
        return total

    async def _quarantine(
        self, partition: int, suspects: list[tuple[bytes, dict[bytes, bytes]]], deliveries: dict[bytes, int]
    ) -> None:
        """Score suspects one at a time with nothing else in flight, so that a crash
        can be pinned on the one sample that caused it."""
        key = self.keys.quarantine(partition)
        self._reading.clear()  # the reader stops taking new entries meanwhile
        # Every suspect is held from now on, not only in its turn: hunting an entry takes
        # its samples' time one by one, and a peer that claimed the ones waiting would hunt
        # them too, under the same notes, and find an innocent sample's note already there.
        opened = [(entry_id, fields, self._open_entry(partition, entry_id, fields)) for entry_id, fields in suspects]
        try:
            await self._wait_idle(self._stopped)  # a stop ends the hunt before its first sample
            settled = await self._settled_before(partition, opened)
            for entry_id, fields, members in opened:
                await self._hunt(partition, entry_id, fields, members, settled, deliveries[entry_id], key)
        except REDIS_ERRORS:
            # A note's HINCRBY or HDEL failed; nothing of a suspect is in flight (each sample
            # is waited for before the next note). Let the unfinished ones go rather than hold
            # them for ever: no longer renewed, any worker reclaims them after
            # reclaim_idle_ms, and the samples settled here are not scored again. (A stop
            # releases them, if still this worker's, for any worker to take at once.)
            for entry_id, _, _ in opened:
                self._open.pop((partition, entry_id), None)
                self._held.discard((partition, entry_id))
            raise
        finally:
            self._reading.set()

    async def _hunt(
        self,
        partition: int,
        entry_id: bytes,
        fields: dict[bytes, bytes],
        members: list[Member],
        settled: set[int],
        delivered: int,
        key: str,
    ) -> None:
        """Score a suspect entry's samples alone, one by one, each under a note. A stop ends
        the hunt between samples: the rest are released with the entry (see _drain)."""
        for at, member in enumerate(members):
            if id(member) in settled:
                continue  # it has its result already (a poison one: its dead letter)
            if self._stopping:
                return
            # One note per sample: an entry of several is hunted sample by sample.
            note = b"%s/%d" % (entry_id, at)
            self._hunting = (key, note)
            try:
                if (key, note) in self._stale_notes:
                    await self._client.hdel(key, note)
                    self._stale_notes.discard((key, note))
                # Durable before the attempt: if this process dies now, the next
                # worker to reclaim the entry finds the note and knows it is guilty.
                attempts = await self._client.hincrby(key, note, 1)
                if attempts > 1:
                    self.stats.in_flight += 1
                    self._dead_letter(
                        partition,
                        entry_id,
                        member.fields(fields, len(members), self.config.group),
                        "poison",
                        f"crashed or stalled a worker while scored alone (delivered {delivered} times)",
                        delivered,
                    )
                elif self._stopping:
                    # The stop came while the note was on its way: the drain may have dropped
                    # it already, or be about to release the entry. Not started, not guilty.
                    await self._client.hdel(key, note)
                    self._hunting = None
                    return
                else:
                    await self._start(partition, entry_id, fields, member, len(members), {entry_id: delivered})
                await self._wait_idle(self._stopped)
                if self._stopping:
                    # The sample may still be scoring: the drain cancels it at its deadline
                    # and drops this note (self._hunting) before it releases the entry.
                    return
                await self._client.hdel(key, note)
                self._hunting = None
            except anyio.get_cancelled_exc_class():
                # A stop, not a crash: the note would make the next worker dead-letter an
                # innocent sample as poison. The cancel may land on the HINCRBY after Redis
                # ran it, or on the HDEL before, so both are inside. (A sample that stalls
                # every worker it meets still ends at max_deliveries.)
                with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
                    await self._client.hdel(key, note)
                self._hunting = None
                raise
            except REDIS_ERRORS:
                # Not a crash either: Redis may have run the HINCRBY and lost its reply. One
                # try to drop the note now; if Redis stays away, it is dropped once Redis is back.
                self._stale_notes.add((key, note))
                with contextlib.suppress(*REDIS_ERRORS), anyio.move_on_after(2.0):
                    await self._client.hdel(key, note)
                    self._stale_notes.discard((key, note))
                self._hunting = None
                raise

    async def _wait_idle(self, stop: asyncio.Event | None = None) -> None:
        """Until nothing is in flight (or ``stop`` is set)."""
        while self.stats.in_flight > 0:
            self._writer_idle.clear()
            if stop is None:
                await self._writer_idle.wait()
                continue
            if stop.is_set():
                return
            idle, stopped = asyncio.ensure_future(self._writer_idle.wait()), asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait((idle, stopped), return_when=asyncio.FIRST_COMPLETED)
            finally:
                idle.cancel()
                stopped.cancel()

    async def _deliveries(self, stream: str, ids: list[bytes]) -> dict[bytes, int]:
        async with self._client.pipeline(transaction=False) as pipe:
            for eid in ids:
                pipe.xpending_range(stream, self.config.group, min=eid, max=eid, count=1)
            replies = await pipe.execute()
        counts = {}
        for eid, rows in zip(ids, replies):
            counts[eid] = int(rows[0]["times_delivered"]) if rows else 1
        return counts
