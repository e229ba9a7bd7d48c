"""The rollout side: declare a batch, push each trajectory the moment it finishes.

Each trajectory goes to the partition of its GRPO group (``Keys.partition_of``),
so a group's samples share a stream and land together. The batch meta and the
open-batch index sit under partition 0's tag (one slot: one pipelined round
trip); a push of several partitions is one pipeline, which redis-py's cluster
client splits by node and sends to the nodes concurrently.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

from stream_reward.config import BatchPolicy, ProducerConfig
from stream_reward.errors import BackpressureError, BrokerError, ConfigError
from stream_reward.trainer.loop_thread import LoopThread
from stream_reward.wire.codec import encode_result, encode_trajectory
from stream_reward.wire.connection import REDIS_ERRORS, connect, mask_url, redis_errors
from stream_reward.wire.entries import XADD_MANY_CHUNK, XADD_MANY_SCRIPT, ensure_group, entry_header, xadd_many_args
from stream_reward.wire.keys import Keys
from stream_reward.wire.ledger import LedgerItem, LedgerWriter
from stream_reward.wire.trajectory import ScoreResult, Trajectory, default_uid

__all__ = ["RolloutProducer", "SyncRolloutProducer"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_RECENT_BATCHES = 64


class RolloutProducer:
    """Async producer. ``async with RolloutProducer(url) as p: await p.push(traj)``.

    A push returns once Redis has the entry (XADD acknowledged), or raises
    BrokerError: it never drops a trajectory silently. Pushing the same uid twice
    is harmless downstream (results are write-once per uid), but within one batch
    this producer refuses it, since it is almost always an indexing bug.
    """

    def __init__(self, redis_url: str, config: ProducerConfig | None = None, *, client: Any = None) -> None:
        self.config = config or ProducerConfig()
        self.keys = Keys(self.config.namespace, self.config.partitions)
        self._url = redis_url
        self._client = client
        self._owns_client = client is None
        self._groups_ready = False
        # uids pushed per batch, for the duplicate check; only the most recent
        # batches are kept, so a producer living for a whole run stays bounded.
        self._seen: OrderedDict[str, set[str]] = OrderedDict()
        self._backlog_checked_at = 0.0
        self._backlog = 0
        self._xadd_many: Any = None  # registered on first push; called with the current client

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = connect(self._url)
        return self._client

    async def __aenter__(self) -> RolloutProducer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._client is not None and self._owns_client:
            await self._client.aclose()
        self._client = None

    async def _ensure_groups(self) -> None:
        if not self._groups_ready:
            for stream in self.keys.streams():
                await ensure_group(self.client, stream, self.config.group)
            self._groups_ready = True

    async def open_batch(
        self,
        batch_id: str,
        size: int,
        response_len: int,
        *,
        policy: BatchPolicy | None = None,
    ) -> None:
        """Declare a batch: its size, rm_scores width, and failure policy / deadline."""
        if size < 0:
            raise ConfigError("size", f"must be >= 0, got {size}")
        if response_len < 1:
            raise ConfigError("response_len", f"must be >= 1, got {response_len}")
        policy = policy or BatchPolicy()
        now = time.time()
        meta = {
            "size": size,
            "response_len": response_len,
            "on_failure": policy.on_failure,
            "fallback_score": policy.fallback_score,
            "created": now,
            "deadline": now + policy.deadline_s if policy.deadline_s else 0,
            "partitions": self.keys.partitions,
        }
        with redis_errors(f"open_batch {batch_id!r} on {mask_url(self._url)}"):
            await self._ensure_groups()
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.hset(self.keys.batch_meta(batch_id), mapping=meta)
                pipe.zadd(self.keys.batches(), {batch_id: now})
                # A batch that is never collected must not stay forever; collect
                # shortens these TTLs. The lengths hash is created here so that the
                # HSETs of later pushes inherit its TTL.
                pipe.hset(self.keys.lengths(batch_id), "-", 0)
                for key in (self.keys.batch_meta(batch_id), self.keys.lengths(batch_id)):
                    pipe.expire(key, self.config.result_ttl_s)
                await pipe.execute()
        self._uids(batch_id).clear()

    async def push(self, traj: Trajectory) -> None:
        await self.push_many((traj,))

    async def push_many(self, trajs: Iterable[Trajectory]) -> int:
        """Push trajectories in one pipelined round trip; returns how many."""
        entries = []
        # The uid sets are held here, not looked up again after the awaits below: with
        # more than _RECENT_BATCHES batches pushing concurrently, another push may
        # evict this batch's set in between (a KeyError before).
        seen_sets = []
        for traj in trajs:
            seen = self._uids(traj.batch_id)
            if traj.uid in seen:
                raise ConfigError("uid", f"uid {traj.uid!r} pushed twice in batch {traj.batch_id!r}")
            payload = encode_trajectory(traj, self.config.max_message_bytes)
            part = self.keys.partition_of(traj.uid, traj.group)
            entries.append((traj, part, payload))
            seen_sets.append(seen)
        if not entries:
            return 0
        try:
            await self._wait_for_room(len(entries))
            await self._ensure_groups()
            await self._xadd(entries)
        except REDIS_ERRORS as exc:
            # Some entries of the pipeline may have landed; they will be scored and
            # counted once, and the caller may push the whole call again safely
            # because results are write-once per uid.
            for (traj, _, _), seen in zip(entries, seen_sets):
                seen.discard(traj.uid)
            raise BrokerError(
                f"push of {len(entries)} trajectories failed: {type(exc).__name__}: Redis unreachable or refused"
            ) from exc
        for (traj, _, _), seen in zip(entries, seen_sets):
            seen.add(traj.uid)
        self._backlog += len(entries)
        return len(entries)

    def _uids(self, batch_id: str) -> set[str]:
        seen = self._seen.get(batch_id)
        if seen is None:
            seen = self._seen[batch_id] = set()
            while len(self._seen) > _RECENT_BATCHES:
                self._seen.popitem(last=False)
        else:
            self._seen.move_to_end(batch_id)
        return seen

    async def _xadd(self, entries: list[tuple[Trajectory, int, bytes]]) -> None:
        """XADD every entry (one script call per partition and chunk, see
        XADD_MANY_SCRIPT) and record the batches' response lengths."""
        if self._xadd_many is None:
            self._xadd_many = self.client.register_script(XADD_MANY_SCRIPT)
        by_part: dict[int, list[tuple[bytes, bytes]]] = {}
        lengths: dict[str, dict[int, int]] = {}
        for traj, part, payload in entries:
            by_part.setdefault(part, []).append((payload, entry_header(traj.batch_id, traj.index, traj.uid)))
            if traj.response_length is not None:
                lengths.setdefault(traj.batch_id, {})[traj.index] = traj.response_length
        step = XADD_MANY_CHUNK
        calls = [
            (self.keys.stream(part), xadd_many_args(rows[lo : lo + step]))
            for part, rows in by_part.items()
            for lo in range(0, len(rows), step)
        ]

        async def xadds() -> None:
            # Direct calls, not a pipeline: a redis-py pipeline holding a script
            # first asks SCRIPT EXISTS, a second round trip on every push. In
            # order, so that a large push lands in the order it was given.
            for stream, args in calls:
                await self._xadd_many(keys=[stream], args=args, client=self.client)

        if not lengths:
            await xadds()
            return
        # The lengths go at the same time on a second connection: one round trip of latency.
        await asyncio.gather(xadds(), *(self.client.hset(self.keys.lengths(b), mapping=m) for b, m in lengths.items()))

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
        with redis_errors(f"recording failed sample {uid!r}"):
            await ledger.write(
                self.keys.partition_of(uid, group), [LedgerItem("", batch_id, uid, encode_result(result))]
            )

    async def backlog(self) -> int:
        """Entries in the streams not yet delivered to the consumer group (the group's lag)."""
        async with self.client.pipeline(transaction=False) as pipe:
            for stream in self.keys.streams():
                pipe.xinfo_groups(stream)
            replies = await pipe.execute()
        total = 0
        for groups in replies:
            for group in groups:
                if group.get(b"name", group.get("name")) in (self.config.group.encode(), self.config.group):
                    lag = group.get(b"lag", group.get("lag"))
                    total += int(lag) if lag is not None else 0
        return total

    async def _wait_for_room(self, incoming: int) -> None:
        limit = self.config.max_backlog
        if not limit:
            return
        loop = asyncio.get_running_loop()
        # Ask Redis at most every poll interval: the check is a round trip, and a
        # local estimate (last reading + what we pushed since) is good enough between.
        while True:
            now = loop.time()
            if now - self._backlog_checked_at >= self.config.backlog_poll_s:
                await self._ensure_groups()
                self._backlog = await self.backlog()
                self._backlog_checked_at = now
            if self._backlog + incoming <= limit or self._backlog == 0:
                return
            if self.config.on_backlog == "raise":
                raise BackpressureError(f"backlog {self._backlog} + {incoming} exceeds max_backlog {limit}")
            await asyncio.sleep(self.config.backlog_poll_s)


class SyncRolloutProducer:
    """Blocking wrapper for trainers that are not async: one private loop in a thread."""

    def __init__(self, redis_url: str, config: ProducerConfig | None = None) -> None:
        self._thread = LoopThread("stream-reward-producer")
        self._producer = RolloutProducer(redis_url, config)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._thread.run(coro)

    def open_batch(self, batch_id: str, size: int, response_len: int, *, policy: BatchPolicy | None = None) -> None:
        self._run(self._producer.open_batch(batch_id, size, response_len, policy=policy))

    def push(self, traj: Trajectory) -> None:
        self._run(self._producer.push(traj))

    def push_many(self, trajs: Iterable[Trajectory]) -> int:
        return self._run(self._producer.push_many(list(trajs)))

    def close(self) -> None:
        if self._thread.running:
            self._run(self._producer.aclose())
            self._thread.stop()

    def __enter__(self) -> SyncRolloutProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
