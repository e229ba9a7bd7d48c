"""The rollout side: declare a batch, push each trajectory the moment it finishes.

Each trajectory goes to the partition of its GRPO group (``Keys.partition_of``),
so a group's samples share a stream and land together. The batch meta and the
open-batch index sit under partition 0's tag (one slot: one pipelined round
trip); a push of several partitions is one pipeline, which redis-py's cluster
client splits by node and sends to the nodes concurrently.

``RolloutProducer`` is this module's public calls (push, push_many, score, fail,
aclose) on top of its layers, one module each: ``batches.py`` (state, open_batch),
``backlog.py`` (the max_backlog estimate and wait), ``flush.py`` (sending a coalesced
group); ``samples.py`` holds the per-sample objects, ``sync_producer.py`` the
blocking wrapper.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import cast

from stream_reward.errors import ConfigError, PushConflictError
from stream_reward.trainer.coalescer import Coalescer, Verdict
from stream_reward.trainer.flush import _FlushLayer
from stream_reward.trainer.listener import acquire_listener, release_listener
from stream_reward.trainer.samples import _default_index, _Entry, _ScoreCall, _Sent
from stream_reward.wire.codec import encode_result, encode_trajectory
from stream_reward.wire.connection import wait_out_refusals
from stream_reward.wire.entries import entry_header
from stream_reward.wire.ledger import LedgerItem, LedgerWriter
from stream_reward.wire.push import CONFLICT_REASONS, DUPLICATE, FRESH, digest
from stream_reward.wire.trajectory import ScoreResult, Trajectory, default_uid

__all__ = ["RolloutProducer"]


class RolloutProducer(_FlushLayer):
    """Async producer. ``async with RolloutProducer(url) as p: await p.push(traj)``.

    A push returns once Redis has the entry (XADD acknowledged), or raises
    BrokerError: it never drops a trajectory silently. Pushing the same uid twice
    is harmless downstream (results are write-once per uid), but within one batch
    this producer refuses it, since it is almost always an indexing bug.
    """

    async def __aenter__(self) -> RolloutProducer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._closes += 1
        if self._coalescer is not None:
            await self._coalescer.aclose()
        reading, self._backlog_reading = self._backlog_reading, None
        if reading is not None and not reading.done():
            self._reading_closed = reading
            # A reading a push started and left running would reach for the client after
            # the close below (a new one, or redis-py's retry reconnecting this one): a
            # connection nobody closes. A push still waiting on it is closed under anyway.
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
        if self._lane is not None:
            self._lane.close()
            self._lane = None
        if self._listener is not None:
            listener, self._listener = self._listener, None
            await release_listener(listener)
        if self._client is not None and self._owns_client:
            await self._client.aclose()
        self._client = None

    async def score(self, traj: Trajectory, *, timeout_s: float | None = None) -> ScoreResult:
        """Push ``traj`` and await its result (``ok`` or ``failed``, as a worker decided it).

        For agent loops that act on each sample's reward: many concurrent calls cost
        about what one ``push_many`` + ``collect`` of the same samples costs, since
        the results come from the process's one listener (see trainer/listener.py).
        Raises ResultTimeoutError past ``timeout_s``, counted from when the sample is
        queued; it stays queued and its result still lands in the batch. A refused push
        raises PushConflictError, a failed one BrokerError, whatever the timeout.
        """
        listener = self._listener
        if listener is None:
            listener = self._listener = acquire_listener(self._url, self._client, self.config.namespace)
        part = self.keys.partition_of(traj.uid, traj.group)
        entry, seen = self._entry(traj, part)  # checked, reserved and encoded; nothing to undo if it raised
        # Registered before the push, so that a result landing meanwhile cannot slip by.
        done = self._done_names.get((traj.batch_id, part))
        if done is None:
            done = self._done_name(traj.batch_id, part)
        fut, followed = listener.watch(traj.uid, part, self.keys, done)
        call: _ScoreCall | None = None
        try:
            if not self._has_room(1):
                await self._make_room(1)
            self._count(1)
            # One wait per sample, not two: the push's verdict reaches the result future from
            # the call object at once (a refusal or a broker error fails it), and the timeout
            # starts only once the sample is queued, so ResultTimeoutError always means
            # "queued, not yet scored".
            call = _ScoreCall(self, entry, seen, listener, fut, followed, timeout_s)
            self._coalesce([entry], call)
            result = await fut
            # A result can come before the verdict: one the listener already held for this uid
            # (an earlier push of it, maybe with other content). It counts only if the push
            # did not contradict that sample.
            if not call.done():
                await call.wait()
            if call.apply() is not None:
                raise cast(BaseException, call.error)
            return result
        except BaseException:
            if call is None:  # never handed to the coalescer: only the reservation to undo
                seen.discard(entry.uid)
            raise
        finally:
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled():
                # Failed while nothing awaited it (a listener closed under a push that then
                # raised): the caller got that error or another; asyncio must not report it.
                fut.exception()
            tick = -1
            if call is not None:
                call.cancel()  # not yet in a flush: skipped (and its uid released); else a no-op
                call.fut = None
                tick = call.tick
            listener.unwatch(fut, followed, entry.uid, tick)
            # An error raised from here holds this frame in its traceback: drop what holds the
            # error (the result future, the call), or each refused or timed-out sample is a
            # reference cycle left to the garbage collector.
            del fut, call

    async def push(self, traj: Trajectory) -> None:
        """Queue one trajectory; returns once Redis holds it. Concurrent calls share a round trip."""
        await self.push_many((traj,))

    async def push_many(self, trajs: Iterable[Trajectory]) -> int:
        """Queue trajectories; returns how many were given (all queued, or already queued identically).

        Concurrent calls in this process are sent together (see trainer/coalescer.py).
        A sample that contradicts one already in its batch (its index under another
        uid, its uid at another index or with other content; pushed by any producer)
        is refused with PushConflictError and nothing of it is queued; the other
        samples of the call are. Pushing a sample again unchanged is a no-op in Redis,
        so a call that failed with BrokerError may be retried as a whole.
        """
        sent = await self._submit(trajs)
        if sent is None:
            return 0
        try:
            verdicts = await cast("asyncio.Future[list[int]]", sent.verdicts)
        except BaseException:
            self._unreserve(sent)
            raise
        self._settle(sent, verdicts)
        return len(sent.entries)

    async def _submit(self, trajs: Iterable[Trajectory]) -> _Sent | None:
        """Check and encode ``trajs`` and hand them to the coalescer; returns before the
        flush, with the future of their verdicts (None for no trajectories)."""
        entries: list[_Entry] = []
        reserved: list[tuple[set[str], str]] = []
        counted = 0  # entries counted into the backlog estimate
        try:
            for traj in trajs:
                entry, seen = self._entry(traj, self.keys.partition_of(traj.uid, traj.group))
                reserved.append((seen, traj.uid))
                entries.append(entry)
            if not entries:
                return None
            if not self._has_room(len(entries)):
                await self._make_room(len(entries))
            counted = self._count(len(entries))
            sent = _Sent(entries, reserved)
            sent.verdicts = cast("asyncio.Future[list[int]]", self._coalesce(entries, None))
            return sent
        except BaseException:
            self._release(reserved, counted)
            raise

    def _entry(self, traj: Trajectory, partition: int) -> tuple[_Entry, set[str]]:
        """Check ``traj``, reserve its uid in its batch and encode it; returns its entry and
        the batch's uid set that holds the reservation. Raises before reserving anything."""
        # Most samples carry their default uid: one comparison, not a parse.
        implied = traj.uid == default_uid(traj.batch_id, traj.index)
        named = None if implied else _default_index(traj.batch_id, traj.uid)
        if named is not None and named != traj.index:
            # The push script records no uid for a sample under its default uid (the uid
            # names the index); a custom uid naming another index would slip past it.
            raise PushConflictError(traj.batch_id, traj.index, traj.uid, f"its uid is the default uid of index {named}")
        seen = self._uids(traj.batch_id)  # the set itself: an eviction meanwhile cannot lose it
        if traj.uid in seen:
            raise ConfigError("uid", f"uid {traj.uid!r} pushed twice in batch {traj.batch_id!r}")
        payload = encode_trajectory(traj, self.config.max_message_bytes)
        length = traj.response_length
        entry = _Entry(
            partition,
            traj.batch_id,
            traj.index,
            traj.uid,
            digest(payload),
            -1 if length is None else length,
            payload,
            entry_header(traj.batch_id, traj.index, traj.uid, len(payload)),
            1 if implied else 0,
        )
        # Reserved last, once nothing here can raise (response ids given as a one-shot
        # iterator pack, then have no length), so a concurrent push of the uid is refused too.
        seen.add(traj.uid)
        return entry, seen

    def _coalesce(
        self, entries: list[_Entry], verdict: Verdict[list[int]] | None
    ) -> asyncio.Future[list[int]] | Verdict[list[int]]:
        if self._coalescer is None:
            self._coalescer = Coalescer(
                self._flush,
                max_entries=self.config.coalesce_max_entries,
                max_delay_s=self.config.coalesce_delay_s,
                max_in_flight=self.config.coalesce_in_flight,
            )
        return self._coalescer.submit_nowait(entries, verdict)

    def _unreserve(self, sent: _Sent) -> None:
        """The push failed or was given up: its uids may be pushed again. Its count stays until
        the next reading: its entries may have been queued (a flush whose reply was lost, or
        one already on its way), and an estimate too high is corrected by the next reading,
        one too low would let pushes past max_backlog."""
        self._release(sent.reserved, 0)

    def _settle(self, sent: _Sent, verdicts: list[int]) -> None:
        """Apply the push script's verdicts; raises PushConflictError for the first refused sample."""
        conflict = None
        for entry, verdict, (seen, _) in zip(sent.entries, verdicts, sent.reserved):
            refused = self._apply_verdict(entry, verdict, seen)
            conflict = conflict or refused
        if conflict is not None:
            raise conflict

    def _apply_verdict(self, entry: _Entry, verdict: int, seen: set[str]) -> PushConflictError | None:
        """Apply one entry's verdict (push_many and score() alike): a refused sample's uid is
        released (its flush took it out of the backlog count); returns the refusal, not raised."""
        if verdict == FRESH or verdict == DUPLICATE:
            return None
        seen.discard(entry.uid)
        return PushConflictError(entry.batch, entry.index, entry.uid, CONFLICT_REASONS[verdict])

    async def fail(
        self, batch_id: str, index: int, *, reason: str, error: str, uid: str | None = None, group: str | None = None
    ) -> None:
        """Resolve a sample as `failed` without pushing it (a rollout that could not be
        turned into a trajectory), so that its batch still completes. Give the sample's
        GRPO ``group`` if it has one: the result then lands in the partition its
        trajectory would have gone to, where a late push of it would find it."""
        uid = uid or default_uid(batch_id, index)
        result = ScoreResult.failed(
            uid, batch_id, index, reason=reason, error=error, group=group, scored_at=time.time()
        )
        ledger = LedgerWriter(self.client, self.keys, self.config.group, result_ttl_s=self.config.result_ttl_s)
        # Write-once: a refusal for now is waited out, as a push's is.
        await wait_out_refusals(
            lambda: ledger.write(
                self.keys.partition_of(uid, group), [LedgerItem("", batch_id, uid, encode_result(result))]
            ),
            what=f"recording failed sample {uid!r}",
        )
