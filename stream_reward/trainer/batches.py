"""The producer's base layer: its connection, its place in the namespace, and its batches.

``_BatchLayer`` holds every piece of state the producer's layers share (``backlog.py``
counts against ``max_backlog``, ``flush.py`` sends the coalesced pushes, ``producer.py``
is the public class on top), and owns ``open_batch``: the atomic open script, refusing a
batch id that exists or resuming one, and noticing a namespace that lost its state. The
layers are one object with plain attributes, not parts that call each other: a push's hot
path reads this state once per sample, and each indirection there is paid per sample.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from typing import Any

from stream_reward.config import BatchPolicy, ProducerConfig
from stream_reward.errors import BatchExistsError, ConfigError, StateLostError
from stream_reward.trainer.coalescer import Coalescer
from stream_reward.trainer.listener import ResultListener
from stream_reward.trainer.samples import _Entry
from stream_reward.wire.batch_meta import BatchMeta
from stream_reward.wire.connection import connect, mask_url, wait_out_refusals
from stream_reward.wire.entries import ensure_group
from stream_reward.wire.eviction import check_eviction
from stream_reward.wire.keys import Keys
from stream_reward.wire.lane import Lane
from stream_reward.wire.namespace import join_namespace

_RECENT_BATCHES = 64
_HISTORY_KEEP_S = 7 * 86400  # how long a batch id is remembered, to tell "expired" from "never opened"

# Create a batch unless its id exists, atomically (two producers racing on an id
# cannot both win); returns the existing meta, or an empty list when created.
# ``created`` and ``deadline`` are the server's time (TIME), never the producer's: the
# aggregator that enforces the deadline compares it with the server's time too, so no
# client clock moves a deadline (a producer an hour behind would never reach its own).
_OPEN_SCRIPT = """
local existing = redis.call('HGETALL', KEYS[1])
if #existing > 0 then
  return existing
end
local ttl, deadline_s, keep, batch = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local deadline = 0
if deadline_s > 0 then
  deadline = now + deadline_s
end
redis.call('HSET', KEYS[1], 'created', string.format('%.6f', now), 'deadline', string.format('%.6f', deadline))
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


class _BatchLayer:
    """The state of a RolloutProducer and its batches (see the module docstring)."""

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
        # batch id -> the token of this producer's open of it, kept until the open is known to
        # have landed: a retry of an open whose reply was lost finds its own token and succeeds.
        self._opening: OrderedDict[str, str] = OrderedDict()
        self._push_sha: str | None = None  # PUSH_SCRIPT, loaded on the first push
        self._coalescer: Coalescer[_Entry, int] | None = None
        self._backlog_reading: asyncio.Future[None] | None = None
        # Push flushes on their way: id -> [samples not placed yet, each stream's pushed count
        # as read by a backlog reading that ended meanwhile]; and what replies came while a
        # reading was on its way (see backlog.py: _place).
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
        restarted producer picking up its own batch). An open whose reply was lost and
        that is sent again (by redis-py's retry, or by calling this again on the same
        producer after it raised) finds the batch it created and succeeds. Raises StateLostError when
        the namespace lost its state since this producer last saw it, naming the
        batches it had opened; the next call starts afresh.
        """
        if size < 0:
            raise ConfigError("size", f"must be >= 0, got {size}")
        if response_len < 1:
            raise ConfigError("response_len", f"must be >= 1, got {response_len}")
        policy = policy or BatchPolicy()
        meta = BatchMeta(
            size=size,
            response_len=response_len,
            policy=policy,
            created=0.0,  # stamped by the script, in the server's time
            deadline=0.0,
            partitions=self.keys.partitions,
            group=self.config.group,
        ).fields()
        del meta["created"], meta["deadline"]
        # redis-py resends a command whose reply was lost (as does a caller retrying a call that
        # raised): the resend carries the same token, and finding it means the open was ours.
        meta["opener"] = self._opening.setdefault(batch_id, uuid.uuid4().hex)
        while len(self._opening) > _RECENT_BATCHES:
            self._opening.popitem(last=False)
        what = f"open_batch {batch_id!r} on {mask_url(self._url)}"

        async def open_once() -> Any:
            await self._join()
            await self._ensure_groups()
            if self._open_script is None:
                self._open_script = self.client.register_script(_OPEN_SCRIPT)
            meta["epoch"] = self._epoch or ""
            args: list[Any] = [self.config.result_ttl_s, policy.deadline_s or 0, _HISTORY_KEEP_S, batch_id]
            for key, value in meta.items():
                args += [key, value]
            keys = self.keys
            return await self._open_script(
                keys=[keys.batch_meta(batch_id), keys.batches(), keys.lengths(batch_id), keys.history()], args=args
            )

        # Every step is idempotent, the open by its token: a refusal for now is waited out.
        existing = await wait_out_refusals(open_once, what=what)
        if existing:
            found = {existing[i].decode(): existing[i + 1].decode() for i in range(0, len(existing), 2)}
            ours = found.get("opener") == meta["opener"]
            self._refuse_or_resume(batch_id, found, meta, resume or ours)  # ours: refused only if it differs
            self._opening.pop(batch_id, None)
            if not ours:
                return
        self._opening.pop(batch_id, None)
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
        await check_eviction(self.client, f"producer on {mask_url(self._url)}", allow=self.config.allow_eviction)
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
