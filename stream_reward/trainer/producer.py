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
from stream_reward.errors import BackpressureError, BatchExistsError, BrokerError, ConfigError, StateLostError
from stream_reward.trainer.loop_thread import LoopThread
from stream_reward.wire.codec import PROTOCOL_VERSION, encode_result, encode_trajectory
from stream_reward.wire.connection import REDIS_ERRORS, connect, mask_url, redis_errors
from stream_reward.wire.entries import XADD_MANY_CHUNK, XADD_MANY_SCRIPT, ensure_group, entry_header, xadd_many_args
from stream_reward.wire.keys import Keys
from stream_reward.wire.ledger import LedgerItem, LedgerWriter
from stream_reward.wire.namespace import join_namespace
from stream_reward.wire.trajectory import ScoreResult, Trajectory, default_uid

__all__ = ["RolloutProducer", "SyncRolloutProducer"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_RECENT_BATCHES = 64
_HISTORY_KEEP_S = 7 * 86400  # how long a batch id is remembered, to tell "expired" from "never opened"

# Create a batch unless its id exists, atomically (two producers racing on an id
# cannot both win); returns the existing meta, or an empty list when created.
_OPEN_SCRIPT = """
local existing = redis.call('HGETALL', KEYS[1])
if #existing > 0 then
  return existing
end
local ttl, now, keep, batch = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
redis.call('ZADD', KEYS[2], now, batch)
-- A batch that is never collected must not stay forever; collect shortens these
-- TTLs. The lengths hash is created here so that the HSETs of later pushes inherit its TTL.
redis.call('HSET', KEYS[3], '-', 0)
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[3], ttl)
redis.call('ZADD', KEYS[4], now, batch)
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now - keep)
return {}
"""


def _same(stored: str, value: Any) -> bool:
    """A stored meta field equals ``value`` (numbers compared as numbers)."""
    if isinstance(value, (int, float)):
        try:
            return float(stored) == float(value)
        except ValueError:
            return False
    return stored == str(value)


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
        self._open_script: Any = None
        self._epoch: str | None = None  # the namespace epoch at this producer's last open_batch
        self._opened: OrderedDict[str, None] = OrderedDict()  # batches this producer opened, newest last

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
        resume: bool = False,
    ) -> None:
        """Declare a batch: its size, rm_scores width, and failure policy / deadline.

        A batch id is unique in its namespace while the batch's keys live (until
        ``collected_ttl_s`` after collect, ``result_ttl_s`` if never collected):
        reopening one raises BatchExistsError, since its stored results would be
        returned for the new samples. ``resume=True`` continues a batch that is
        open and not yet collected, with the same size, width and policy (a
        restarted producer picking up its own batch). Raises StateLostError when
        the namespace lost its state since this producer last saw it, naming the
        batches it had opened; the next call starts afresh.
        """
        if size < 0:
            raise ConfigError("size", f"must be >= 0, got {size}")
        if response_len < 1:
            raise ConfigError("response_len", f"must be >= 1, got {response_len}")
        policy = policy or BatchPolicy()
        now = time.time()
        meta = {
            "v": PROTOCOL_VERSION,
            "size": size,
            "response_len": response_len,
            "on_failure": policy.on_failure,
            "fallback_score": policy.fallback_score,
            "deadline_s": policy.deadline_s or 0,
            "created": now,
            "deadline": now + policy.deadline_s if policy.deadline_s else 0,
            "partitions": self.keys.partitions,
            "group": self.config.group,
        }
        with redis_errors(f"open_batch {batch_id!r} on {mask_url(self._url)}"):
            await self._join()
            await self._ensure_groups()
            if self._open_script is None:
                self._open_script = self.client.register_script(_OPEN_SCRIPT)
            meta["epoch"] = self._epoch or ""
            args: list[Any] = [self.config.result_ttl_s, now, _HISTORY_KEEP_S, batch_id]
            for key, value in meta.items():
                args += [key, value]
            keys = self.keys
            existing = await self._open_script(
                keys=[keys.batch_meta(batch_id), keys.batches(), keys.lengths(batch_id), keys.history()], args=args
            )
        if existing:
            found = {existing[i].decode(): existing[i + 1].decode() for i in range(0, len(existing), 2)}
            self._refuse_or_resume(batch_id, found, meta, resume)
            return
        self._opened[batch_id] = None
        while len(self._opened) > _RECENT_BATCHES:
            self._opened.popitem(last=False)
        self._uids(batch_id).clear()

    def _refuse_or_resume(self, batch_id: str, found: dict[str, str], meta: dict[str, Any], resume: bool) -> None:
        """Resume a batch that exists (same size, width and policy, not collected), or raise BatchExistsError."""
        when = f"opened {time.ctime(float(found.get('created', 0)))}"
        if float(found.get("collected", 0) or 0):
            when += f", collected {time.ctime(float(found['collected']))}"
        differs = [
            f"{key} {found.get(key)} != {meta[key]}"
            for key in ("size", "response_len", "on_failure", "fallback_score", "deadline_s", "partitions", "group")
            if key in found and _same(found[key], meta[key]) is False
        ]
        if resume and not differs and "collected" not in found:
            return
        if resume:
            why = "it was already collected" if "collected" in found else "it differs: " + ", ".join(differs)
            detail = f"cannot resume it, {why}"
        else:
            detail = "its stored results would be returned for the new samples"
        raise BatchExistsError(
            batch_id,
            f"batch {batch_id!r} already exists in namespace {self.keys.namespace!r} ({when}); {detail}. "
            "Use a unique batch id per batch (for example run id + step); a producer restarted mid-batch "
            "continues its own batch with open_batch(..., resume=True) and the same size, width and policy",
        )

    async def _join(self) -> None:
        """Join the namespace (protocol check, epoch); notice a lost state at once."""
        epoch = await join_namespace(self.client, self.keys)
        seen, self._epoch = self._epoch, epoch
        if seen is not None and epoch != seen:
            lost = list(self._opened)
            self._opened.clear()
            self._seen.clear()
            self._groups_ready = False  # the streams and groups went with the state: create them again
            raise StateLostError(
                f"namespace {self.keys.namespace!r} lost its state (epoch {seen} replaced by {epoch}): Redis "
                "restarted without persistence, was flushed or failed over to an empty replica. Queued "
                f"trajectories and results of the batches this producer opened are gone: {lost}. Open them again "
                "under new ids and push them again",
                lost,
            )

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

    def open_batch(
        self, batch_id: str, size: int, response_len: int, *, policy: BatchPolicy | None = None, resume: bool = False
    ) -> None:
        self._run(self._producer.open_batch(batch_id, size, response_len, policy=policy, resume=resume))

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
