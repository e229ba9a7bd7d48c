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
import math
import time
from collections import OrderedDict
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

from stream_reward.config import BatchPolicy, ProducerConfig
from stream_reward.errors import (
    BackpressureError,
    BatchExistsError,
    BrokerError,
    ConfigError,
    PushConflictError,
    StateLostError,
)
from stream_reward.trainer.coalescer import _CANCELLED, _DONE, _PENDING, Coalescer, Verdict
from stream_reward.trainer.listener import ResultListener, acquire_listener, release_listener
from stream_reward.trainer.loop_thread import LoopThread
from stream_reward.wire.batch_meta import BatchMeta
from stream_reward.wire.codec import encode_result, encode_trajectory
from stream_reward.wire.connection import connect, is_cluster, is_permanent, mask_url, redis_errors
from stream_reward.wire.entries import XADD_MANY_CHUNK, ensure_group, entry_header, group_state
from stream_reward.wire.keys import Keys
from stream_reward.wire.lane import Lane
from stream_reward.wire.ledger import LedgerItem, LedgerWriter
from stream_reward.wire.namespace import join_namespace
from stream_reward.wire.packed import can_send_packed, pack_command, send_packed
from stream_reward.wire.push import CONFLICT_REASONS, DUPLICATE, FIELD_STAMP, FRESH, PUSH_SCRIPT, digest, push_args
from stream_reward.wire.trajectory import ScoreResult, Trajectory, default_uid

__all__ = ["RolloutProducer", "SyncRolloutProducer"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_RECENT_BATCHES = 64
# A push whose lane connection is lost is sent again on a new one: up to 3 tries, 50 then 100 ms apart.
_LANE_ATTEMPTS = 3
_LANE_BACKOFF_S = 0.05
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


def _default_index(batch_id: str, uid: str) -> int | None:
    """The index whose default uid ``uid`` is, in this batch; None if it is no default uid."""
    prefix = f"{batch_id}/"
    if uid.startswith(prefix):
        rest = uid[len(prefix) :]
        # ASCII digits only: str.isdigit() also takes "²" and "٣", which int() reads or refuses.
        if rest.isascii() and rest.isdigit() and (rest == "0" or not rest.startswith("0")):
            return int(rest)
    return None


@dataclass(slots=True)
class _Entry:
    """One trajectory on its way to the push script."""

    partition: int
    batch: str
    index: int
    uid: str
    digest: str
    length: int  # valid response tokens, -1 unknown
    payload: bytes
    header: bytes
    implied: int  # 1: the uid is the default uid of its index (no uid claim needed)

    def row(self) -> tuple[str, int, str, str, int, bytes, bytes, int]:
        return (self.batch, self.index, self.uid, self.digest, self.length, self.payload, self.header, self.implied)


@dataclass(slots=True)
class _Sent:
    """A push_many handed to the coalescer: its entries, the uids it reserved, and the
    future of its verdicts."""

    entries: list[_Entry]
    reserved: list[tuple[set[str], str]]
    verdicts: asyncio.Future[list[int]] | None = None


class _ScoreCall(Verdict[list[int]]):
    """One score() call's sample from its push to its result: the verdict slot the
    coalescer sets, and what that verdict decides, applied the moment it is set
    (release the uid or keep it, correct the backlog count, fail the result wait or
    arm its timeout).

    One object per sample where there were four (a Verdict, its callback's argument, a
    push record and a tuple of what the callback needed): on the per-sample path the
    trainer's cost is mostly such per-sample objects and the calls between them.
    """

    __slots__ = (
        "producer",
        "entry",
        "seen",
        "listener",
        "fut",
        "followed",
        "timeout_s",
        "tick",
        "applied",
        "error",
    )

    def __init__(
        self,
        producer: RolloutProducer,
        entry: _Entry,
        seen: set[str],
        listener: ResultListener,
        fut: asyncio.Future[ScoreResult],
        followed: Any,
        timeout_s: float | None,
    ) -> None:
        # Verdict's own state, set here rather than by a second __init__ call per sample;
        # _settled below replaces its then/arg callback.
        self._state = _PENDING
        self._value = None
        self._waiter = None
        self.producer = producer
        self.entry = entry
        self.seen = seen
        self.listener = listener
        self.fut: asyncio.Future[ScoreResult] | None = fut
        self.followed = followed
        self.timeout_s = timeout_s
        self.tick = -1
        self.applied = False
        self.error: BaseException | None = None

    def apply(self) -> BaseException | None:
        """Apply the verdict (it is set), once; what the push raised or was refused with."""
        if self.applied:
            return self.error
        self.applied = True
        state = self._state
        if state == _DONE:
            # Made, not raised, here: a refusal carries no traceback, which from this callback
            # would reach the flush (every payload of it) for as long as a caller keeps it.
            self.error = self.producer._apply_verdict(self.entry, self._value[0], self.seen)
        else:
            # Given up (by score(), or a closing loop) or failed: as push_many's _unreserve.
            given_up = state == _CANCELLED
            self.producer._release([(self.seen, self.entry.uid)], 0)
            self.error = asyncio.CancelledError() if given_up else self._value
        return self.error

    def _settled(self) -> None:
        """The push's verdict is in (from the flush, a closing runner, or score() giving up)."""
        error = self.apply()
        fut = self.fut
        if fut is None or fut.done():
            return
        if self._state == _CANCELLED:
            # Not by score() (it ends its own wait first): the coalescer's runner or flush was
            # cancelled (its loop closing). The sample may never have been queued, and no
            # result or timeout would end the wait.
            fut.cancel()
            return
        if error is not None:
            fut.set_exception(error)
            return
        entry = self.entry
        producer = self.producer
        if self._value[0] == DUPLICATE:
            # Queued before, unchanged: its result may have been read past already. Read the
            # done stream again from its start, keeping what lands.
            self.listener.reread(entry.batch, [entry.partition], producer.keys, group=producer.config.group)
        if self.timeout_s is not None:
            self.tick = self.listener.arm(fut, entry.batch, entry.uid, self.timeout_s)


def _cancel_requested() -> bool:
    """Whether the running task was asked to cancel (Python 3.11+; on 3.10, which cannot
    tell, False: a cancel landing together with aclose() then ends as its error)."""
    cancelling = getattr(asyncio.current_task(), "cancelling", None)
    return bool(cancelling and cancelling())


def _retrieve(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()


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
        self._done_names: dict[tuple[str, int], str] = {}  # (batch, partition) -> its done stream
        self._backlog_checked_at = 0.0
        self._backlog = 0
        self._open_script: Any = None
        self._epoch: str | None = None  # the namespace epoch at this producer's last open_batch
        self._opened: OrderedDict[str, None] = OrderedDict()  # batches this producer opened, newest last
        self._push_sha: str | None = None  # PUSH_SCRIPT, loaded on the first push
        self._coalescer: Coalescer[_Entry, int] | None = None
        self._backlog_reading: asyncio.Future[None] | None = None
        # Push flushes on their way: id -> [samples not placed yet, each stream's pushed count
        # as read by a backlog reading that ended meanwhile]; and what replies came while a
        # reading was on its way (see _place).
        self._flying: dict[int, list[Any]] = {}
        self._replies_while_reading: list[tuple[int, int | None, int]] = []
        self._reading_closed: asyncio.Future[None] | None = None  # the reading aclose() ended, if any
        self._closes = 0  # aclose() calls: a push waiting for room across one ends with an error
        self._listener: ResultListener | None = None  # the process's result listener, on first score()
        self._lane: Lane | None = None  # the pushes' own connection (wire/lane.py), where one serves
        self._lane_client: Any = None  # the client the lane was made for

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

    async def _ensure_groups(self) -> None:
        if not self._groups_ready:
            for p, stream in enumerate(self.keys.streams()):
                await ensure_group(self.client, stream, self.config.group)
                if (await self.client.xinfo_stream(stream)).get("last-generated-id") in (b"0-0", "0-0"):
                    # A stream never pushed to: its count starts at 0 here, so the first push's
                    # reply can be placed against a reading (one that finds the count missing
                    # says it started it again, see wire/push.py, and is never placed).
                    await self.client.hsetnx(self.keys.pushed(p), "samples", 0)
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
        meta = BatchMeta(
            size=size,
            response_len=response_len,
            policy=policy,
            created=now,
            deadline=now + policy.deadline_s if policy.deadline_s else 0,
            partitions=self.keys.partitions,
            group=self.config.group,
        ).fields()
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

    def _release(self, reserved: list[tuple[set[str], str]], counted: int) -> None:
        for seen, uid in reserved:
            seen.discard(uid)
        self._backlog = max(0, self._backlog - counted)

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

    def _done_name(self, batch_id: str, partition: int) -> str:
        # Kept per batch: formatting the name was a sixth of the listener's cost per score().
        if len(self._done_names) >= 4 * _RECENT_BATCHES:
            self._done_names.clear()  # names are derived, never state: dropping them is safe
        name = self._done_names[batch_id, partition] = self.keys.done(batch_id, partition, self.config.group)
        return name

    def _uids(self, batch_id: str) -> set[str]:
        seen = self._seen.get(batch_id)
        if seen is None:
            seen = self._seen[batch_id] = set()
            while len(self._seen) > _RECENT_BATCHES:
                self._seen.popitem(last=False)
        else:
            self._seen.move_to_end(batch_id)
        return seen

    async def _flush(self, entries: list[_Entry]) -> list[int]:
        """Send one coalesced group: one PUSH_SCRIPT call per (partition, chunk), all in one
        round trip on a single node; returns each entry's verdict, in order."""
        cluster = is_cluster(self.client)
        by_part: dict[int, list[int]] = {}
        for at, entry in enumerate(entries):
            by_part.setdefault(entry.partition, []).append(at)
        calls: list[tuple[list[int], list[str], list[Any]]] = []
        step = XADD_MANY_CHUNK
        for part, ats in by_part.items():
            claims_part = part if cluster else 0
            for lo in range(0, len(ats), step):
                chunk = ats[lo : lo + step]
                keys, args = push_args(
                    self.keys.stream(part),
                    self.keys.pushed(part),
                    [entries[a].row() for a in chunk],
                    lambda b, cp=claims_part: self.keys.claims(b, cp),
                    # In a cluster the lengths hash (partition 0's slot) is written after, for fresh entries only.
                    self.keys.lengths if not cluster else (lambda b, cp=claims_part: self.keys.claims(b, cp)),
                    ttl_s=self.config.result_ttl_s,
                    write_lengths=not cluster,
                    per_entry=self.config.samples_per_entry,
                )
                calls.append((chunk, keys, args))
        verdicts = [0] * len(entries)
        counting = bool(self.config.max_backlog)
        key = id(entries)
        flight: list[Any] | None = None
        if counting:
            flight = self._flying[key] = [len(entries), None]
        try:
            # Some calls may land before a failure; a retry of the same pushes finds them as duplicates.
            with redis_errors(f"push of {len(entries)} trajectories failed"):
                replies = await self._call_push(calls, cluster)
            for (chunk, _, _), reply in zip(calls, replies):
                if isinstance(reply, int):  # the script's fast path: every sample fresh, in prepared entries
                    after: int | None = reply
                else:
                    for at, verdict in zip(chunk, reply):
                        verdicts[at] = int(verdict)
                    after = int(reply[len(chunk)]) if len(reply) > len(chunk) else None
                if flight is not None:
                    self._place(flight, entries[chunk[0]].partition, after, chunk, verdicts)
        finally:
            # Off the flights. A failed flush's unplaced samples stay counted: whether they were
            # queued is unknown (a reply lost after the script ran); the next reading knows.
            if counting:
                del self._flying[key]
        if cluster:
            lengths: dict[str, dict[int, int]] = {}
            for entry, verdict in zip(entries, verdicts):
                if verdict == FRESH and entry.length >= 0:
                    lengths.setdefault(entry.batch, {})[entry.index] = entry.length
            with redis_errors("recording response lengths"):
                await asyncio.gather(*(self.client.hset(self.keys.lengths(b), mapping=m) for b, m in lengths.items()))
        return verdicts

    async def _call_push(self, calls: list[tuple[list[int], list[str], list[Any]]], cluster: bool) -> list[Any]:
        if self._push_sha is None:
            self._push_sha = await self.client.script_load(PUSH_SCRIPT)
        if cluster:  # no scripts in cluster pipelines: one call each, concurrently (the client routes by key)
            return list(
                await asyncio.gather(
                    *(self.client.evalsha(self._push_sha, len(keys), *keys, *args) for _, keys, args in calls)
                )
            )
        for attempt in (1, 2):
            try:
                if can_send_packed(self.client):
                    # The calls carry every payload as an argument: packed here in one join.
                    packed = [
                        pack_command("EVALSHA", self._push_sha, len(keys), *keys, *args) for _, keys, args in calls
                    ]
                    replies = await self._send_packed(packed)
                    for reply in replies:
                        if isinstance(reply, Exception):
                            raise reply
                    return replies
                # EVALSHA in a plain pipeline: redis-py's Script objects would first ask
                # SCRIPT EXISTS, a second round trip on every flush.
                async with self.client.pipeline(transaction=False) as pipe:
                    for _, keys, args in calls:
                        pipe.evalsha(self._push_sha, len(keys), *keys, *args)
                    return list(await pipe.execute())
            except NoScriptError:
                # The server lost its script cache (a restart): load it again. Calls that
                # ran before the error are found as duplicates by the retry.
                if attempt == 2:
                    raise
                self._push_sha = await self.client.script_load(PUSH_SCRIPT)
                self._groups_ready = False  # a restarted server may have lost them too
                await self._ensure_groups()
        raise AssertionError("unreachable")

    async def _send_packed(self, packed: list[bytes]) -> list[Any]:
        """The push calls on the producer's lane (where one serves, see wire/lane.py). A lost
        connection is tried again on a new one, a few times: a push sent twice is found as a
        duplicate, and a connection reset (a server restart, a proxy's idle cut) is not worth
        failing the pushes of a whole flush for."""
        client = self.client
        if self._lane_client is not client:  # the first push, or a client swapped since
            if self._lane is not None:
                self._lane.close()
            self._lane_client = client
            self._lane = Lane.for_client(client)
        lane = self._lane
        if lane is None:
            return await send_packed(client, packed)
        for attempt in range(_LANE_ATTEMPTS):
            try:
                replies = await lane.call(packed)
                for reply in replies:
                    if isinstance(reply, RedisConnectionError):  # -LOADING: a restarted server replaying its AOF
                        raise reply
                return replies
            except RedisConnectionError as exc:
                if attempt == _LANE_ATTEMPTS - 1 or is_permanent(exc):
                    raise
                await asyncio.sleep(_LANE_BACKOFF_S * 2**attempt)
        raise AssertionError("unreachable")

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
        past the group's last delivered one. Two round trips.

        An entry without a stamp (one XADDed by hand) falls back to the group's lag in
        entries at the mean samples an entry; where Redis knows no lag (after an AOF
        reload, or entries deleted mid-stream), the stream's length less the group's
        pending entries, which errs on the side of waiting.
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
            if not first:  # every entry was delivered
                if samples is not None:
                    counts[p] = int(samples)
                continue
            pushed = int(samples or 0)
            stamp = first[0][1].get(FIELD_STAMP)
            if stamp is not None and samples is not None and int(stamp) <= pushed:
                total += pushed - int(stamp)  # 0: every entry queued before the count was delivered
                counts[p] = pushed
                continue
            # No stamp, or counts that cannot be right (the pushed hash was deleted or
            # evicted while the stream stayed): the lag in entries, at the mean entry.
            lag = group["lag"]
            if lag is None:
                lag = max(0, int(length) - group["pending"])
            mean = pushed / int(entries) if entries and int(entries) else self.config.samples_per_entry
            total += math.ceil(lag * mean)
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

    def score(self, traj: Trajectory, *, timeout_s: float | None = None) -> ScoreResult:
        """Push and wait for the sample's result; safe to call from many threads at once."""
        return self._run(self._producer.score(traj, timeout_s=timeout_s))

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
