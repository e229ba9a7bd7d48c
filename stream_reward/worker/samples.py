"""Starting and scoring one sample, and dead-lettering one that cannot be scored.

A sample is dead-lettered at once (too many deliveries, a payload that does not decode) or
scored: awaited in the reader's own task for ``inline`` scorers (the rule scorers: a task
per sample would cost more than the scoring), in a task of its own otherwise. A scorer's
error fails its sample, never the worker; a BaseException past it ends ``run()`` as a
crash would (``_die``). Every outcome goes to the writer (``_queue``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import cast

from stream_reward.errors import CodecError, ScoringError
from stream_reward.wire.codec import decode_trajectory, encode_result
from stream_reward.wire.deadletter import encode_dead_letter
from stream_reward.wire.entries import read_place, refused_uid
from stream_reward.wire.ledger import LedgerItem
from stream_reward.wire.trajectory import ScoreResult, Trajectory
from stream_reward.worker.members import Member
from stream_reward.worker.watchdog import scoring
from stream_reward.worker.writer import ResultWriting

__all__ = ["SampleStarting"]

log = logging.getLogger(__name__)


class SampleStarting(ResultWriting):
    """Room, start, score or dead-letter one sample."""

    async def _room_for_one(self) -> bool:
        """Until one more sample fits under ``concurrency`` and no suspect is being scored
        alone; False once stopping. A read asks for what it has room for, but an entry
        may hold more samples than the read guessed."""
        while self.stats.in_flight >= self.config.concurrency or not self._reading.is_set():
            if self._stopping:
                return False
            if self.stats.in_flight >= self.config.concurrency:
                self._room.clear()
                await self._room.wait()
            else:
                await self._reading.wait()
        return True

    async def _start(
        self,
        partition: int,
        entry_id: bytes,
        fields: dict[bytes, bytes],
        member: Member,
        of: int,
        deliveries: dict[bytes, int] | None,
    ) -> None:
        """One sample of an entry of ``of``: dead-letter it, or score it here or in a task."""
        self.stats.in_flight += 1
        delivered = deliveries.get(entry_id, 0) if deliveries is not None else 0
        if delivered > self.config.max_deliveries:
            self._dead_letter(
                partition,
                entry_id,
                member.fields(fields, of, self.config.group),
                "max_deliveries",
                f"delivered {delivered} times (max_deliveries={self.config.max_deliveries})",
                delivered,
            )
            return
        try:
            traj = decode_trajectory(member.payload, self.config.max_message_bytes)
        except CodecError as exc:
            self._dead_letter(
                partition, entry_id, member.fields(fields, of, self.config.group), exc.reason, str(exc), 1
            )
            return
        if self._inline:
            await self._score(partition, entry_id, traj)
        else:
            task = asyncio.create_task(self._score(partition, entry_id, traj))
            self._tasks.add(task)
            self._task_entries[task] = (partition, entry_id)
            task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._task_entries.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            # _score turns every Exception into a failed result: this is a BaseException (or
            # a bug past it), and its sample will never settle here. (Or the writer died.)
            self._die(cast(BaseException, task.exception()))

    def _die(self, exc: BaseException) -> None:
        """A scoring task or the writer ended by an error nothing here can settle: run()
        raises it (see _watch_fatal), as a crash would end the process. Its entries stay
        pending and their deliveries count, rather than be renewed for ever by a worker
        that will never settle them."""
        if self._fatal is None:
            self._fatal = exc
            self._fatal_set.set()

    async def _watch_fatal(self) -> None:
        await self._fatal_set.wait()
        raise cast(BaseException, self._fatal)

    async def _score(self, partition: int, entry_id: bytes, traj: Trajectory) -> None:
        started = time.perf_counter()
        # What the loop watchdog names if this scorer blocks the loop (see stream_reward.worker.watchdog).
        token = scoring.set((self._scorer_name, traj))
        try:
            scored = await self.scorer.score(traj)
            # Positional (keywords cost a 13-field dataclass about 0.5 us more, per sample).
            result = ScoreResult(
                traj.uid,
                traj.batch_id,
                traj.index,
                scored.score,
                "ok",
                scored.extra,
                None,  # reason
                None,  # error
                scored.attempts,
                traj.response_length,
                traj.data_source,
                traj.group,
                time.time(),  # scored_at
            )
            self.stats.scored += 1
        except Exception as exc:  # a scorer bug fails its sample, never the pool
            if isinstance(exc, ScoringError):
                reason, error, attempts, extra = exc.reason, str(exc), exc.attempts or 1, exc.extra
            else:
                reason, error, attempts, extra = "scorer_error", f"{type(exc).__name__}: {exc}", 1, {}
            result = ScoreResult.failed(
                traj.uid,
                traj.batch_id,
                traj.index,
                reason=reason,
                error=error,
                attempts=attempts,
                traj=traj,
                scored_at=time.time(),
                extra=extra,  # what the scorer knew all the same: the failed sample keeps its columns
            )
            self.stats.failed += 1
        finally:
            scoring.reset(token)
        if self.hooks is not None:
            self.hooks.on_scored(result, time.perf_counter() - started)
        self._queue(partition, LedgerItem(entry_id, traj.batch_id, traj.uid, encode_result(result)))

    def _dead_letter(
        self, partition: int, entry_id: bytes, fields: dict[bytes, bytes], reason: str, error: str, deliveries: int
    ) -> None:
        """Resolve an entry that cannot be scored: dead-letter it and, when its
        batch is known from the entry's plain fields, record a `failed` result so
        the batch still completes."""
        batch, index, uid = read_place(fields)
        if batch is not None and uid is None:
            # Its batch and index are known, its uid is not: the result goes by a uid made of
            # its index and entry (the same for a redelivery, so it is written once), so the
            # batch completes rather than wait for its deadline. The aggregator counts by index.
            uid = refused_uid(index, entry_id)
            error = f"{error} (the entry names no usable uid)"
        dead = encode_dead_letter(
            reason=reason,
            error=error,
            entry_id=entry_id,
            partition=partition,
            consumer=self.config.consumer,
            deliveries=deliveries,
            at=time.time(),
            fields=fields,
        )
        result = None
        if batch is not None and uid is not None and index >= 0:
            result = encode_result(
                ScoreResult.failed(
                    uid, batch, index, reason=reason, error=error, attempts=deliveries, scored_at=time.time()
                )
            )
        self.stats.dead_letters += 1
        self.stats.failed += 1
        if self.hooks is not None:
            self.hooks.on_dead_letter(reason)
        log.warning("dead-lettered entry %s of batch %r: %s", entry_id.decode(), batch, reason)
        self._queue(partition, LedgerItem(entry_id, batch, uid, result, dead))
