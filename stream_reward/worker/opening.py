"""Opening a read's entries into samples, and handing back what this worker has no room for.

An entry may hold several samples. Each entry is held (renewed, released by a stop) from
the moment it is read until every sample of it is settled. Of a redelivered entry, the
samples with a result already, or handed back by the worker before, count as settled and
are not scored again (``_settled_before``): a verifier's quota is not spent twice and a
poison sample does not crash a second worker. A worker at ``concurrency`` hands an entry's
samples it has no room for back to the stream, an entry each, for any worker to take
(``_spill``); their record makes the worker that takes a redelivered entry leave them to
their copies.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from stream_reward.wire.connection import (
    REDIS_ERRORS,
)
from stream_reward.wire.entries import FIELD_FOR_GROUP, member_fields
from stream_reward.wire.ledger import LedgerItem
from stream_reward.wire.push import requeue_args
from stream_reward.worker.members import Member, sample_name, split
from stream_reward.worker.samples import SampleStarting

__all__ = ["EntryOpening"]

log = logging.getLogger(__name__)


class EntryOpening(SampleStarting):
    """Open entries, skip what is settled, spill and hand back."""

    async def _process(
        self,
        partition: int,
        entries: list[tuple[bytes, dict[bytes, bytes]]],
        deliveries: dict[bytes, int] | None,
    ) -> None:
        # Every entry of the read is held from here on (renewed, and released by a stop), not
        # only once the loop reaches it: a later one may wait for room while earlier ones score.
        opened = [(entry_id, fields, self._open_entry(partition, entry_id, fields)) for entry_id, fields in entries]
        if deliveries is not None:
            settled = await self._settled_before(partition, opened)
        # A hand-back is only safe if this worker's reader reads it: the reader's own reads hand
        # back before its next read. A burst's reader ends on its own, after reads that found
        # nothing, and a reclaim sweep's hand-back may land after its last one; the burst's
        # passes then claim pending entries only, never new ones, and the copies would wait
        # for a worker that may never come. So a burst worker's sweeps keep what they claim.
        may_spill = not self._inline and (deliveries is None or not self._burst)
        samples = 0
        for entry_id, fields, everyone in opened:
            members = everyone if deliveries is None else [m for m in everyone if id(m) not in settled]
            samples += len(everyone)
            for at, member in enumerate(members):
                full = self.stats.in_flight >= self.config.concurrency
                spill = full and at > 0 and may_spill and self._reader_active and not self._stopping
                if spill and await self._spill(partition, entry_id, members[:at], members[at:]):
                    break
                # (The common case, room now, without a coroutine per sample.)
                busy = self.stats.in_flight >= self.config.concurrency or not self._reading.is_set()
                if busy and not await self._room_for_one():
                    return  # stopping: the entries go back to the group unsettled (see _drain)
                await self._start(partition, entry_id, fields, member, len(everyone), deliveries)
        if entries:
            self._per_entry = max(1, round(samples / len(entries)))

    def _open_entry(self, partition: int, entry_id: bytes, fields: dict[bytes, bytes]) -> list[Member]:
        """The entry's samples this worker's group scores; the entry is held until every
        one of them is settled (at once, when it has none)."""
        group = fields.get(FIELD_FOR_GROUP)
        members = split(fields) if group is None or group == self._group_name else []
        self._held.add((partition, entry_id))
        self._open[partition, entry_id] = len(members)
        if not members:  # another group's hand-back: ours has the sample in the entry it came from
            self._ack_alone(partition, entry_id)
        return members

    def _ack_alone(self, partition: int, entry_id: bytes) -> None:
        """Ack an entry none of whose samples is left to settle here."""
        self._open[partition, entry_id] = 1
        self.stats.in_flight += 1
        self._queue(partition, LedgerItem(entry_id, None, None, None))

    async def _settled_before(self, partition: int, opened: list[tuple[bytes, Any, list[Member]]]) -> set[int]:
        """Of redelivered entries, the samples (by ``id``) this group's ledger holds a result
        for already (a worker stopped or died after writing them, or dead-lettered a poison
        one), or that a worker handed back before it died (their copies are queued). They
        count as settled. Scoring them again would spend a verifier's quota for nothing, and
        a poison one would crash its worker again. If Redis fails the lookup, every sample
        is scored (the ledger keeps first results)."""
        try:
            have, handed = await asyncio.gather(
                self._with_results(partition, [m for _, _, members in opened for m in members]),
                self._handed_back(partition, opened),
            )
            settled = have | handed
        except REDIS_ERRORS as exc:
            log.warning("could not look up which redelivered samples have results (%s); scoring all", exc)
            return set()
        if settled:
            for entry_id, _, members in opened:
                left = sum(1 for m in members if id(m) not in settled)
                if left < len(members):
                    self._open[partition, entry_id] = left
                    if not left:
                        self._ack_alone(partition, entry_id)
        return settled

    async def _handed_back(self, partition: int, opened: list[tuple[bytes, Any, list[Member]]]) -> set[int]:
        """The samples (by ``id``) of these entries that a worker of this group handed back
        (see _hand_back): one round trip, for entries of several samples only."""
        several = [(entry_id, members) for entry_id, _, members in opened if len(members) > 1]
        if not several:
            return set()
        async with self._client.pipeline(transaction=False) as pipe:
            for entry_id, _ in several:
                pipe.smembers(self.keys.handed(entry_id.decode(), partition, self.config.group))
            replies = await pipe.execute()
        out = set()
        for (_, members), recorded in zip(several, replies):
            if recorded:
                names = {n.decode() if isinstance(n, bytes) else n for n in recorded}
                out |= {id(m) for m in members if m.head is not None and sample_name(m.head) in names}
        return out

    async def _with_results(self, partition: int, members: list[Member]) -> set[int]:
        """The samples (by ``id``) this group's ledger holds a result for: one round trip."""
        by_batch: dict[str, list[Member]] = {}
        for member in members:
            if member.head is not None:
                by_batch.setdefault(member.head[0], []).append(member)
        if not by_batch:
            return set()
        async with self._client.pipeline(transaction=False) as pipe:
            for batch, those in by_batch.items():
                pipe.hmget(self.keys.results(batch, partition, self.config.group), [m.head[2] for m in those])
            replies = await pipe.execute()
        return {id(m) for those, marks in zip(by_batch.values(), replies) for m, mark in zip(those, marks) if mark}

    async def _spill(self, partition: int, entry_id: bytes, started: list[Member], rest: list[Member]) -> bool:
        """Hand the samples of an entry this worker has no room for back to the stream, an
        entry each, for any worker to take; False if Redis refused (they wait for room here).

        Only for scorers that take their time (not ``inline``): those are where a batch
        of samples in one entry, held by one worker, would be scored at that worker's
        concurrency while others stand idle. (Not a burst worker's sweeps: see _process.)
        The entry is acked once the samples started here settle; a stop hands back those
        of them without a result (_finish_handed).
        A crash before that ack redelivers the entry; the worker that takes it leaves the
        samples handed back to their copies (_settled_before).
        """
        try:
            await self._hand_back(partition, entry_id, rest)
        except REDIS_ERRORS as exc:
            log.warning("could not hand %d samples back to the stream (%s); scoring them here", len(rest), exc)
            return False
        left = self._open[partition, entry_id] - len(rest)
        if left > 0:
            self._open[partition, entry_id] = left
            self._handed[partition, entry_id] = started
        else:  # the samples started here were all settled meanwhile
            self._ack_alone(partition, entry_id)
        return True

    async def _hand_back(self, partition: int, entry_id: bytes, members: list[Member]) -> None:
        """Queue ``members`` of an entry again, an entry each, for this group only. Stamped
        and counted as pushed samples: a producer's backlog sees them."""
        copies = [
            member_fields(bytes(m.payload), m.head, handed_back_from=entry_id, group=self.config.group) for m in members
        ]
        # Recorded with the copies, in the same script: if this worker dies before the entry
        # is acked, the worker that reclaims it leaves these samples to their copies rather
        # than score them a second time (a verifier's quota spent twice).
        keys = [
            self.keys.stream(partition),
            self.keys.pushed(partition),
            self.keys.dead_letters(partition),
            self.keys.handed(entry_id.decode(), partition, self.config.group),
        ]
        names = [sample_name(m.head) for m in members if m.head is not None]
        await self._requeue(keys=keys, args=requeue_args(copies, handed=names, handed_ttl_s=self.config.result_ttl_s))
        self.stats.spilled += len(members)
