"""One worker process's consumer loop: read, decode, score, write once, ack.

Four tasks share one client:

* the reader XREADGROUPs new entries while there is room under ``concurrency``
  (against a cluster, one reader per partition: see ``_reader``);
* the writer settles finished samples: everything that finished since its last
  round trip goes out in one Lua call per partition (result + ack together), so
  results are batched under load and still land within a round trip when idle;
* the reclaimer XAUTOCLAIMs entries a dead consumer left pending. An entry
  that keeps coming back is a *suspect*: it may be the poison that killed its
  consumers, or an innocent that was in flight beside it. Suspects are scored
  alone (no other sample in flight), after a durable note that the solo attempt
  started; a suspect that comes back *with* such a note crashed or stalled a
  worker on its own, and is dead-lettered. Innocents are never blamed for a
  neighbour's crash;
* the housekeeper heartbeats and trims entries every group has acked.

Scorers that never suspend (``inline = True``, the rule scorers) are awaited in
the reader's own task: a task per sample would cost more than the scoring.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import random
import socket
import sys
import time
from collections import defaultdict, deque
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, cast

import anyio
from redis.exceptions import ResponseError

from stream_reward.config import SAMPLES_PER_ENTRY, ConsumerConfig
from stream_reward.errors import BrokerError, CodecError, ConfigError, ScoringError
from stream_reward.scoring.scorer import Scorer
from stream_reward.wire.codec import PROTOCOL_VERSION, decode_trajectory, encode_result
from stream_reward.wire.connection import (
    CLUSTER_ERRORS,
    REDIS_ERRORS,
    TRANSIENT_ERRORS,
    LogLimiter,
    connect,
    is_cluster,
    is_permanent,
    is_transient,
    permanent_error,
    with_reconnect,
)
from stream_reward.wire.deadletter import encode_dead_letter
from stream_reward.wire.entries import (
    FIELD_FOR_GROUP,
    FIELD_PAYLOAD,
    RELEASE_SCRIPT,
    ensure_group,
    member_fields,
    members_from_payloads,
    read_group,
    read_header,
    read_members,
)
from stream_reward.wire.heartbeat import decode_heartbeat, encode_heartbeat
from stream_reward.wire.keys import Keys
from stream_reward.wire.lane import Lane
from stream_reward.wire.ledger import LedgerItem, LedgerWriter
from stream_reward.wire.namespace import join_namespace
from stream_reward.wire.push import REQUEUE_SCRIPT, requeue_args
from stream_reward.wire.trajectory import ScoreResult, Trajectory
from stream_reward.worker.watchdog import scoring

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

__all__ = ["Worker", "WorkerStats"]

log = logging.getLogger(__name__)

# An entry released on shutdown is marked idle this long, so that any live
# worker's next reclaim sweep takes it at once instead of after reclaim_idle_ms.
_RELEASED_IDLE_MS = 10 * 365 * 24 * 3600 * 1000


class WorkerStats:
    """Counters a worker keeps; heartbeats and metrics read them."""

    __slots__ = ("scored", "failed", "duplicates", "dead_letters", "reclaimed", "spilled", "in_flight")

    def __init__(self) -> None:
        self.scored = self.failed = self.duplicates = self.dead_letters = self.reclaimed = self.in_flight = 0
        self.spilled = 0  # samples handed back to the stream (Worker._hand_back: no room here, or at a stop)

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


class Worker:
    """A consumer in the namespace's group. ``await Worker(url, scorer).run(stop)``.

    ``burst=True`` returns once the streams hold nothing for this worker (tests,
    one-shot scoring); otherwise it runs until ``stop`` is set.
    """

    def __init__(
        self,
        redis_url: str,
        scorer: Scorer,
        config: ConsumerConfig | None = None,
        *,
        client: Any = None,
        hooks: Any = None,
    ) -> None:
        self.config = config or ConsumerConfig()
        self.keys = Keys(self.config.namespace, self.config.partitions)
        self.scorer = scorer
        self.stats = WorkerStats()
        self.hooks = hooks  # optional observer (metrics); see stream_reward.worker.metrics
        self._url = redis_url
        self._client = client
        self._inline = bool(getattr(scorer, "inline", False))
        self._scorer_name = str(getattr(scorer, "name", None) or type(scorer).__name__)
        self._pending: dict[int, list[LedgerItem]] = defaultdict(list)
        self._reserved = 0  # room taken by reads in flight (several when partitions are read apart)
        self._have_pending = asyncio.Event()
        self._room = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        # Entries this worker is scoring or writing: never reclaimed from itself. An entry
        # held longer than reclaim_idle_ms (a slow scorer) would otherwise come back to its
        # own worker, be scored twice, and its delivery count would make it a suspect.
        # The housekeeper also renews them (XCLAIM JUSTID: idle reset, delivery count kept),
        # so that no other worker takes a slow sample from a live one.
        # (partition, entry id): two partitions' streams (on two nodes) can make the same id.
        self._held: set[tuple[int, bytes]] = set()
        # Held by a renewal. A stop's release ends renewals and waits for this first: a
        # renewal already under way would land after the release and make the released
        # entries fresh again (a peer would then wait out reclaim_idle_ms for them).
        self._renewing = asyncio.Lock()
        self._renewals_over = False
        # One reclaim sweep at a time: two (the background one and a burst's last pass)
        # could claim the same entry between XAUTOCLAIM and _process, both count it a
        # delivery, both quarantine it, and the second quarantine would find the first's
        # note and dead-letter an innocent sample as poison.
        self._sweeping = asyncio.Lock()
        self._task_entries: dict[asyncio.Task[None], tuple[int, bytes]] = {}
        # Entries with samples not yet settled, and how many. The sample of an entry that
        # settles last carries the entry's ack, so an entry is acked only once every one
        # of its samples has its result (flushes go out in order).
        # By (partition, entry id): two partitions' streams (on two nodes) can make the same id.
        self._open: dict[tuple[int, bytes], int] = {}
        # Open entries that handed samples back: the samples started here (see _finish_handed).
        self._handed: dict[tuple[int, bytes], list[_Member]] = {}
        # The quarantine note of the sample being hunted: a stop drops it before it releases
        # the entry, or a peer could claim the entry and find it there (see _drain).
        self._hunting: tuple[str, bytes] | None = None
        # Notes this worker may have left after a Redis error (a lost reply, then a failed
        # HDEL): an innocent sample's, since nothing crashed. Dropped as soon as Redis
        # answers (the housekeeper, or this worker's next hunt of that sample), before a
        # hunt would find one and dead-letter its sample as poison.
        self._stale_notes: set[tuple[str, bytes]] = set()
        # Entries a flush failed to settle (past the drain deadline): no later flush acks
        # them, since some of their samples have no result.
        self._unsettled: set[tuple[int, bytes]] = set()
        # Samples an entry held in the last read: a read asks for as many entries as
        # leave room for that many samples each.
        self._per_entry = SAMPLES_PER_ENTRY
        self._group_name = self.config.group.encode()
        self._stopping = False
        self._fatal: BaseException | None = None  # what ends run() as a crash would (see _die)
        self._fatal_set = asyncio.Event()
        self._reader_active = False  # while the reader reads new entries: what _spill adds gets read
        self._writer_idle = asyncio.Event()
        self._reading = asyncio.Event()  # cleared while suspects are scored alone
        self._stopped = asyncio.Event()  # set with _stopping, for waits that end on a stop
        self._reading.set()
        self._started = time.time()
        self._drain_deadline: float | None = None  # loop time; set when the stop is noticed
        self._give_up = asyncio.Event()  # set past the drain deadline: unwritten results stay pending
        self._beats: deque[tuple[float, int]] = deque()
        self._epoch: str | None = None  # the namespace epoch this worker joined
        self._host = socket.gethostname()

    # ------------------------------------------------------------------ running
    async def run(self, stop: asyncio.Event | None = None, *, burst: bool = False) -> None:
        stop = stop or asyncio.Event()
        self._begin_run()
        if self._client is None:
            self._client = connect(self._url)
        # The result flushes and the reads go on connections of their own (wire/lane.py),
        # where one serves: through redis-py's pool each round trip cost several times the
        # CPU, and at a paced 5,000 samples a second each worker makes hundreds of each a
        # second, of about five samples apiece (2026-12-02).
        lane = Lane.for_client(self._client)
        try:
            await self._run(stop, burst, lane)
        finally:
            if lane is not None:
                lane.close()

    async def _run(self, stop: asyncio.Event, burst: bool, lane: Lane | None) -> None:
        client = self._client
        self._ledger = LedgerWriter(
            client, self.keys, self.config.group, result_ttl_s=self.config.result_ttl_s, lane=lane
        )
        self._requeue = client.register_script(REQUEUE_SCRIPT)
        self._release_script = client.register_script(RELEASE_SCRIPT)
        for stream in self.keys.streams():
            await with_reconnect(
                functools.partial(ensure_group, client, stream, self.config.group),
                what="create group",
                give_up_after_s=None,
                stop=stop,
            )
        # Refuse (ProtocolMismatchError: exit 2) a namespace of another protocol version rather than poison it.
        self._epoch = await with_reconnect(
            lambda: join_namespace(client, self.keys), what="join namespace", give_up_after_s=None, stop=stop
        )
        if not await self._name_is_free(stop):
            return  # stopped before it began: nothing read, nothing held
        log.info(
            "worker %s joined group %r of namespace %r (%d partitions, concurrency %d)",
            self.config.consumer,
            self.config.group,
            self.config.namespace,
            self.config.partitions,
            self.config.concurrency,
        )
        writer_stop = asyncio.Event()
        # Background loops end on this event as well as by cancel: a cancel that lands
        # inside a redis-py command can be swallowed on Python 3.11, and the task group
        # would then wait for them forever.
        closing = asyncio.Event()
        # Set once this worker takes no new entries, including reclaimed ones (it may
        # be releasing its own to others): at once on stop, or when a burst is done.
        reading_done = asyncio.Event()
        # The writer is not in the task group: with Redis away it may retry for ever, and
        # shutdown must not wait on it past the drain deadline (see _stop_writer).
        writer = asyncio.create_task(self._writer(writer_stop))
        writer.add_done_callback(self._task_done)  # a writer that dies of an error fails run()
        drained = False
        # The housekeeper, the reclaimer and the stop and failure watchers, cancelled together.
        background = anyio.CancelScope()
        try:
            with _sole_error():
                async with anyio.create_task_group() as tg:
                    tg.start_soon(
                        _within,
                        background,
                        self._housekeeper(closing),
                        self._reclaimer(reading_done),
                        self._watch_stop(stop, reading_done),
                        self._watch_fatal(),
                    )
                    try:
                        self._reader_active = True
                        await self._reader(stop, burst)
                        self._reader_active = False
                        reading_done.set()
                        if burst:
                            # Pending entries of dead consumers are ours to finish too. Each pass
                            # starts with room, and with the background sweep out of the way: a
                            # pass that found no room (the writer had not yet settled the last
                            # pass's entries, or the sweep had just taken them) claimed nothing
                            # and would end the burst with entries left behind.
                            # A stop ends them: shutdown then goes by the drain deadline, as in a
                            # worker that is not a burst.
                            while not stop.is_set():
                                async with self._sweeping:
                                    await self._wait_idle(stop)
                                    if stop.is_set():
                                        break
                                    if not await self._reclaim_sweep(self.config.reclaim_idle_ms, stop):
                                        break
                        await self._drain()
                        drained = True
                    finally:
                        self._reader_active = False
                        reading_done.set()
                        closing.set()
                        background.cancel()
        finally:
            for task in list(self._tasks):  # left running only if run() failed before its drain
                task.cancel()
            await self._stop_writer(writer, writer_stop)
            # After a graceful stop, whatever is still pending under this consumer goes back
            # to the group: samples cancelled or never started, results the writer could not
            # write by the drain deadline, suspects let go after a Redis error, a claim that
            # landed late (if Redis is away, they are reclaimed after reclaim_idle_ms). Not
            # after a failure: the entries stay pending and their deliveries count, as after
            # a crash (a sample that takes the worker down must reach quarantine).
            if drained:
                await self._release()
            await self._farewell()
        log.info("worker %s stopped: %s", self.config.consumer, self.stats.as_dict())

    async def _name_is_free(self, stop: asyncio.Event) -> bool:
        """Refuse (ConfigError) a consumer name that a live worker heartbeats under: two
        workers under one name share one pending list, and the stop of either would release
        the other's entries to peers while it scores them. A heartbeat left by a worker that
        died stops changing: wait about two of its intervals to tell the two apart (a value
        that is not a heartbeat is no worker). False if ``stop`` is set meanwhile."""
        key, name = self.keys.workers(), self.config.consumer
        me = (self._host, os.getpid(), self._started)
        loop = asyncio.get_running_loop()
        first_seen: float | None = None
        give_up = 0.0
        while not stop.is_set():
            try:
                raw = await asyncio.wait_for(self._client.hget(key, name), timeout=2.0)
                beat = decode_heartbeat(raw) if raw else None
            except (asyncio.TimeoutError, *REDIS_ERRORS):
                beat = None  # the check is a guard against misconfiguration, not a lock
            seen = beat.get("seen") if beat is not None else None
            if not (isinstance(seen, (int, float)) and math.isfinite(seen)) or beat is None:
                return True
            if (beat.get("host"), beat.get("pid"), beat.get("started")) == me:
                return True
            if first_seen is None:
                first_seen = seen
                # Its interval, not ours: a twin that beats less often than this worker
                # would look dead after two of our intervals.
                theirs = beat.get("interval_s")
                theirs = theirs if isinstance(theirs, (int, float)) and 0 < theirs <= 60 else 0.0
                give_up = loop.time() + 2 * max(self.config.heartbeat_interval_s, theirs) + 0.5
            elif seen != first_seen:
                raise ConfigError(
                    "consumer",
                    f"{name!r} is in use by a live worker (host {beat.get('host')}, pid {beat.get('pid')}); "
                    "give each worker its own name (the default, host-pid, is)",
                )
            if loop.time() >= give_up:
                return True  # it stopped beating: a worker that died, whose entries are reclaimed
            await _sleep_unless(stop, min(0.5, self.config.heartbeat_interval_s / 2))
        return False

    def _begin_run(self) -> None:
        """Reset what a run's stop leaves behind, so that a Worker may run again: the last
        run finished or released every entry it held (its stats and stale notes carry on)."""
        self._fatal = None
        self._fatal_set = asyncio.Event()
        self._stopping = False
        self._stopped = asyncio.Event()
        self._renewals_over = False
        self._drain_deadline = None
        self._give_up = asyncio.Event()
        self._reading.set()
        self._hunting = None
        for state in (self._held, self._open, self._handed, self._unsettled, self._task_entries):
            state.clear()
        self._tasks = set()
        self._pending = defaultdict(list)
        self.stats.in_flight = 0

    async def _rejoin(self) -> None:
        """After the streams vanished: say so when the namespace lost its state, and give it
        a new epoch, so that producers and aggregators waiting on the old one raise StateLostError."""
        epoch = await join_namespace(self._client, self.keys)
        if epoch != self._epoch:
            log.error(
                "namespace %r lost its state (epoch %s replaced by %s): Redis restarted without persistence, "
                "was flushed or failed over to an empty replica; the batches in flight must be rerun",
                self.config.namespace,
                self._epoch,
                epoch,
            )
            self._epoch = epoch

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _watch_stop(self, stop: asyncio.Event, reading_done: asyncio.Event) -> None:
        """On stop, take nothing more at once: the reclaimer stops, and a reader waiting
        for room (a saturated worker) or for a quarantine wakes up and sees the stop."""
        await stop.wait()
        self._stopping = True
        self._stopped.set()
        self._drain_deadline = asyncio.get_running_loop().time() + self.config.drain_timeout_s
        reading_done.set()
        self._room.set()
        self._reading.set()

    # ------------------------------------------------------------------ reading
    async def _reader(self, stop: asyncio.Event, burst: bool) -> None:
        streams = self.keys.streams()
        if len(streams) > 1 and is_cluster(self._client):
            # No command may span two hash slots: one reader per partition, each
            # blocking on its own stream, on the node that owns it.
            units = [[s] for s in streams]
        else:
            units = [streams]  # one XREADGROUP over every partition: one round trip
        if len(units) == 1:
            await self._read_loop(units[0], stop, burst, share=self.config.concurrency)
            return
        share = -(-self.config.concurrency // len(units))
        with _sole_error():
            async with anyio.create_task_group() as tg:
                for unit in units:
                    tg.start_soon(functools.partial(self._read_loop, unit, stop, burst, share=share))

    async def _read_loop(self, names: list[str], stop: asyncio.Event, burst: bool, *, share: int) -> None:
        lane = Lane.for_client(self._client)
        try:
            await self._read_loop_on(lane, names, stop, burst, share=share)
        finally:
            if lane is not None:
                lane.close()

    async def _read_loop_on(
        self, lane: Lane | None, names: list[str], stop: asyncio.Event, burst: bool, *, share: int
    ) -> None:
        """Read ``names`` while there is room. Several loops share ``concurrency``:
        each reserves what it asks for before it blocks, so that together they never
        take more, and takes at most ``share`` per read. A loop whose last read was
        empty asks for one entry only, so that a quiet partition does not sit on a
        share of the room for a whole BLOCK while another partition is busy."""
        streams = {s: ">" for s in names}
        part_of = {s.encode(): self.keys.streams().index(s) for s in names}
        shared = share < self.config.concurrency
        idle = False
        empty_reads = 0
        backoff_s = 0.05
        lost_since: float | None = None  # when the first of the failed reads since the last recovery was sent
        limiter = LogLimiter(log)
        while not stop.is_set():
            if not self._reading.is_set():
                await self._reading.wait()
                continue
            room = self.config.concurrency - self.stats.in_flight - self._reserved
            if room <= 0:
                self._room.clear()
                await self._room.wait()
                continue
            want = 1 if shared and idle else min(room, self.config.read_count, share)  # samples
            count = max(1, want // self._per_entry)  # entries
            self._reserved += want
            try:
                try:
                    if lost_since is not None:
                        await self._recover_delivered(names, part_of, lost_since)
                        lost_since = None
                    sent_at = time.monotonic()
                    reply = await read_group(
                        self._client,
                        self.config.group,
                        self.config.consumer,
                        streams,
                        count=count,
                        block=self.config.block_ms,
                        lane=lane,
                    )
                except (*TRANSIENT_ERRORS, *CLUSTER_ERRORS) as exc:
                    if is_permanent(exc):
                        raise permanent_error(exc, self._url) from None
                    if not is_transient(exc):
                        raise
                    if lost_since is None:
                        lost_since = sent_at
                    # Capped exponential backoff with jitter; one warning, then a summary now and then.
                    limiter.warning("read failed (%s); reconnecting", type(exc).__name__)
                    await _sleep_unless(stop, backoff_s * (0.5 + random.random()))
                    backoff_s = min(backoff_s * 2, 2.0)
                    continue
                except ResponseError as exc:
                    if "NOGROUP" in str(exc):  # the stream was deleted under us (or Redis restarted without AOF)
                        for s in streams:
                            await ensure_group(self._client, s, self.config.group)
                        await self._rejoin()
                        continue
                    raise
                if backoff_s > 0.05:
                    limiter.recovered("reading again")
                    backoff_s = 0.05
                idle = not reply
                if not reply:
                    if burst:
                        empty_reads += 1
                        if empty_reads >= 2 and self.stats.in_flight == 0:
                            return
                    continue
                empty_reads = 0
                for stream, entries in _iter_reply(reply):
                    await self._process(part_of[stream], entries, deliveries=None)
            finally:
                self._reserved -= want
                if shared:
                    self._room.set()  # what this read did not use is free for the others

    async def _recover_delivered(self, names: list[str], part_of: dict[bytes, int], since: float) -> None:
        """After a failed read: the server may have run it and delivered entries whose reply
        never came. They are pending under this consumer, and nothing but the reclaimer would
        find them (after reclaim_idle_ms). Take back those delivered once since ``since``
        (when the first failed read was sent, less a margin for the two clocks) and not held:
        what failed reads can have delivered. Older pending entries under this name (a crashed
        worker's, restarted under it) are left to the reclaimer, which quarantines repeat
        offenders; like it, this scores again nothing that has a result. Under its lock: an
        entry it claims is pending here before it is held."""
        async with self._sweeping:
            for name in names:
                partition = part_of[name.encode()]
                young = await self._delivered_since(name, partition, since)
                if not young:
                    continue
                # Their fields by XRANGE, which leaves the pending list as it is (reading this
                # consumer's history with XREADGROUP would count a delivery of each).
                async with self._client.pipeline(transaction=False) as pipe:
                    for eid in young:
                        pipe.xrange(name, min=eid, max=eid)
                    pages = await pipe.execute()
                # In id order: XPENDING lists them so, and the pipeline keeps it.
                found = [page[0] for page in pages if page and page[0][1]]
                if found:
                    log.info("took back %d entries delivered by a read whose reply was lost", len(found))
                    # As the reclaimer takes entries: what of them has a result already is not
                    # scored again (an entry of a crashed worker, restarted under this name
                    # within the margin, may be partly settled).
                    await self._process(partition, found, deliveries=young)

    async def _delivered_since(self, name: str, partition: int, since: float) -> dict[bytes, int]:
        """Ids pending under this consumer, delivered once, less than the time since ``since``
        ago, and not held; each with its delivery count (1)."""
        # The server's clock and this one's, both local, were seen 2 ms apart: a margin. An
        # older entry under this name (a crashed worker's) is mostly seconds older, since its
        # heartbeat had to go stale before the name could be used again; one inside the
        # margin is taken, and checked for results like a reclaimed one.
        window_ms = (time.monotonic() - since) * 1000 + _RECOVER_MARGIN_MS
        young: dict[bytes, int] = {}
        start = "-"
        while True:
            page = await self._client.xpending_range(
                name, self.config.group, min=start, max="+", count=1000, consumername=self.config.consumer
            )
            for p in page:
                eid = p["message_id"]
                eid = eid if isinstance(eid, bytes) else str(eid).encode()
                if (
                    p["times_delivered"] == 1
                    and p["time_since_delivered"] < window_ms
                    and (partition, eid) not in self._held
                ):
                    young[eid] = 1
            if len(page) < 1000:
                return young
            last = page[-1]["message_id"]
            start = "(" + (last.decode() if isinstance(last, bytes) else str(last))

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
        samples = 0
        for entry_id, fields, everyone in opened:
            members = everyone if deliveries is None else [m for m in everyone if id(m) not in settled]
            samples += len(everyone)
            for at, member in enumerate(members):
                full = self.stats.in_flight >= self.config.concurrency
                spill = full and at > 0 and not self._inline and self._reader_active and not self._stopping
                if spill and await self._spill(partition, entry_id, members[:at], members[at:]):
                    break
                # (The common case, room now, without a coroutine per sample.)
                busy = self.stats.in_flight >= self.config.concurrency or not self._reading.is_set()
                if busy and not await self._room_for_one():
                    return  # stopping: the entries go back to the group unsettled (see _drain)
                await self._start(partition, entry_id, fields, member, len(everyone), deliveries)
        if entries:
            self._per_entry = max(1, round(samples / len(entries)))

    def _open_entry(self, partition: int, entry_id: bytes, fields: dict[bytes, bytes]) -> list[_Member]:
        """The entry's samples this worker's group scores; the entry is held until every
        one of them is settled (at once, when it has none)."""
        group = fields.get(FIELD_FOR_GROUP)
        members = _split(fields) if group is None or group == self._group_name else []
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

    async def _settled_before(self, partition: int, opened: list[tuple[bytes, Any, list[_Member]]]) -> set[int]:
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

    async def _handed_back(self, partition: int, opened: list[tuple[bytes, Any, list[_Member]]]) -> set[int]:
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
                out |= {id(m) for m in members if m.head is not None and _sample_name(m.head) in names}
        return out

    async def _with_results(self, partition: int, members: list[_Member]) -> set[int]:
        """The samples (by ``id``) this group's ledger holds a result for: one round trip."""
        by_batch: dict[str, list[_Member]] = {}
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

    async def _spill(self, partition: int, entry_id: bytes, started: list[_Member], rest: list[_Member]) -> bool:
        """Hand the samples of an entry this worker has no room for back to the stream, an
        entry each, for any worker to take; False if Redis refused (they wait for room here).

        Only for scorers that take their time (not ``inline``): those are where a batch
        of samples in one entry, held by one worker, would be scored at that worker's
        concurrency while others stand idle. The entry is acked once the samples started
        here settle; a stop hands back those of them without a result (_finish_handed).
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

    async def _hand_back(self, partition: int, entry_id: bytes, members: list[_Member]) -> None:
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
        names = [_sample_name(m.head) for m in members if m.head is not None]
        await self._requeue(keys=keys, args=requeue_args(copies, handed=names, handed_ttl_s=self.config.result_ttl_s))
        self.stats.spilled += len(members)

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
        member: _Member,
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

    # ------------------------------------------------------------------ scoring
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
                reason, error, attempts = exc.reason, str(exc), exc.attempts or 1
            else:
                reason, error, attempts = "scorer_error", f"{type(exc).__name__}: {exc}", 1
            result = ScoreResult.failed(
                traj.uid,
                traj.batch_id,
                traj.index,
                reason=reason,
                error=error,
                attempts=attempts,
                traj=traj,
                scored_at=time.time(),
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
        batch, index, uid = read_header(fields)
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

    # ------------------------------------------------------------------ writing
    def _queue(self, partition: int, item: LedgerItem) -> None:
        entry = (partition, cast(bytes, item.entry_id))  # a worker's items name stream entries
        if self._handed and item.uid is not None:
            started = self._handed.get(entry)
            if started is not None:  # this one is settled: a stop need not hand it back
                sample = (item.batch_id, item.uid)
                self._handed[entry] = [m for m in started if (m.head[0], m.head[2]) != sample]
        left = self._open.get(entry)
        if left is not None:
            if left > 1:
                self._open[entry] = left - 1
                item.ack = False
            else:
                del self._open[entry]
                self._handed.pop(entry, None)
                item.ack = entry not in self._unsettled
        self._pending[partition].append(item)
        self._have_pending.set()

    async def _writer(self, stop: asyncio.Event) -> None:
        while True:
            await self._have_pending.wait()
            self._have_pending.clear()
            batch, self._pending = self._pending, defaultdict(list)
            if batch:
                settled = sum(len(items) for items in batch.values())
                try:
                    await with_reconnect(
                        functools.partial(self._flush, batch),
                        what="write results",
                        give_up_after_s=None,
                        stop=self._give_up,
                    )
                except BrokerError as exc:
                    # Past the drain deadline with Redis away: these entries stay pending
                    # (never acked without a result) and another worker reclaims them.
                    log.warning("%d results not written before the drain deadline (%s); left pending", settled, exc)
                    for partition, items in batch.items():
                        for item in items:
                            self._unsettled.add((partition, item.entry_id))  # type: ignore[arg-type]
                            item.ack = True  # no longer held, below
                for partition, items in batch.items():
                    for item in items:
                        if item.ack:
                            self._held.discard((partition, item.entry_id))  # type: ignore[arg-type]
                self.stats.in_flight -= settled
                self._room.set()
                self._writer_idle.set()
            elif stop.is_set():
                return

    async def _stop_writer(self, writer: asyncio.Task[None], writer_stop: asyncio.Event) -> None:
        """Let the writer settle what finished, until the drain deadline at the latest."""
        writer_stop.set()
        self._have_pending.set()
        loop = asyncio.get_running_loop()
        deadline = self._drain_deadline if self._drain_deadline is not None else loop.time()
        done, _ = await asyncio.wait({writer}, timeout=max(0.5, deadline - loop.time()))
        if not done:
            self._give_up.set()
            done, _ = await asyncio.wait({writer}, timeout=1.0)
        if not done:
            writer.cancel()
            await asyncio.wait({writer}, timeout=1.0)
        elif writer.exception() is not None:
            log.error("result writer failed: %r", writer.exception())

    async def _flush(self, batch: dict[int, list[LedgerItem]]) -> None:
        # In a cluster a retry gets only the partitions not yet written (see write_partitions).
        expected = sum(1 for items in batch.values() for item in items if item.result is not None)
        written = await self._ledger.write_partitions(batch)
        if written < expected:
            # Someone wrote these uids first (a redelivery after a slow or dead
            # worker): the ledger kept the first result and ignored ours.
            self.stats.duplicates += expected - written

    # ------------------------------------------------------------------ reclaiming
    async def _reclaimer(self, stop: asyncio.Event) -> None:
        # Sweep at least twice per idle period, so a dead consumer's entries wait
        # at most ~1.5x reclaim_idle_ms before someone takes them.
        interval = max(0.05, min(self.config.reclaim_interval_s, self.config.reclaim_idle_ms / 2000))
        limiter = LogLimiter(log)
        while not stop.is_set():
            await _sleep_unless(stop, interval)
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
        members: list[_Member],
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

    # ------------------------------------------------------------------ shutdown
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

    # ------------------------------------------------------------------ housekeeping
    async def _housekeeper(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        beat_s = self.config.heartbeat_interval_s
        # Held entries are renewed well within reclaim_idle_ms, whatever the heartbeat: one
        # left idle past it is claimed by a peer's sweep (scored twice, quota spent twice)
        # and its delivery count bumped (bumps enough quarantine an innocent sample).
        tick_s = max(0.05, min(beat_s, self.config.reclaim_idle_ms / 3000)) if self.config.reclaim_idle_ms else beat_s
        next_beat = next_trim = 0.0
        while not stop.is_set():
            try:
                await self._renew_held()
                await self._drop_stale_notes()
                if loop.time() >= next_beat:
                    await self._heartbeat()
                    next_beat = loop.time() + beat_s
                if loop.time() >= next_trim:
                    await self._trim()
                    next_trim = loop.time() + self.config.trim_interval_s
            except REDIS_ERRORS as exc:
                log.debug("housekeeping skipped: %s", type(exc).__name__)
            except Exception:  # housekeeping must never take the worker down
                log.exception("housekeeping failed")
            await _sleep_unless(stop, tick_s)

    async def _renew_held(self) -> None:
        """Keep the entries this worker is scoring idle-fresh, so peers leave them alone."""
        async with self._renewing:
            if self._renewals_over:
                return
            by_partition: dict[int, list[bytes]] = {}
            for partition, entry_id in list(self._held):
                by_partition.setdefault(partition, []).append(entry_id)
            streams = self.keys.streams()
            for partition, ids in by_partition.items():
                await self._client.xclaim(
                    streams[partition], self.config.group, self.config.consumer, 0, ids, justid=True
                )

    async def _drop_stale_notes(self) -> None:
        for key, note in list(self._stale_notes):
            await self._client.hdel(key, note)
            self._stale_notes.discard((key, note))

    async def _heartbeat(self) -> None:
        now = time.time()
        settled = self.stats.scored + self.stats.failed
        # Samples settled per second over the last minute, from the heartbeats' own history.
        self._beats.append((now, settled))
        while now - self._beats[0][0] > 60:
            self._beats.popleft()
        first_at, first_settled = self._beats[0]
        beat = {
            "v": PROTOCOL_VERSION,
            "host": self._host,
            "pid": os.getpid(),
            "started": self._started,
            "seen": now,
            "interval_s": self.config.heartbeat_interval_s,
            "group": self.config.group,
            "partitions": self.keys.partitions,
            "scorer": getattr(self.scorer, "name", type(self.scorer).__name__),
            "settled_per_s_1m": (settled - first_settled) / (now - first_at) if now > first_at else 0.0,
            **self.stats.as_dict(),
        }
        await self._client.hset(self.keys.workers(), self.config.consumer, encode_heartbeat(beat))

    async def _trim(self) -> None:
        """Drop entries that every group has acknowledged: bounded memory for the stream."""
        for stream in self.keys.streams():
            groups = await self._client.xinfo_groups(stream)
            floor = None
            for group in groups:
                name = group["name"]
                summary = await self._client.xpending(stream, name) if group["pending"] else None
                if summary and summary.get("min"):
                    candidate = _parse_id(summary["min"])
                else:  # nothing pending (or acked since XINFO): all up to last-delivered is done
                    ms, seq = _parse_id(group["last-delivered-id"])
                    candidate = (ms, seq + 1)
                floor = candidate if floor is None else min(floor, candidate)
            if floor is not None and floor > (0, 1):
                await self._client.xtrim(stream, minid=f"{floor[0]}-{floor[1]}", approximate=False)


class _Member:
    """One sample of an entry: its payload (a view into the entry's) and its header."""

    __slots__ = ("payload", "head")

    def __init__(self, payload: Any, head: Any) -> None:
        self.payload, self.head = payload, head

    def fields(self, entry: dict[bytes, bytes], of: int, group: str) -> dict[bytes, bytes]:
        """What a dead letter of consumer group ``group`` keeps: the entry itself when it
        holds this sample only, else an entry of this sample's own (a redrive queues it
        alone); either names the group, so a redrive queues it for that group only."""
        if of == 1:
            return {**entry, FIELD_FOR_GROUP: group.encode()}
        return member_fields(bytes(self.payload), self.head, group=group)


def _sample_name(head: Any) -> str:
    """A sample's name in a hand-back record: its batch and uid (a uid is unique only
    within its batch, and an entry may hold samples of several batches)."""
    batch, _, uid, _ = head
    return f"{len(batch)}:{batch}{uid}"


def _split(fields: dict[bytes, bytes]) -> list[_Member]:
    """An entry's samples. Headers that cannot be read: the samples are split by their
    payloads (one that names no sample is dead-lettered alone); failing that, the entry
    is one sample: its payload may still decode, and if not it is dead-lettered whole."""
    data = fields.get(FIELD_PAYLOAD, b"")
    members = read_members(fields)
    sized = [(head[3], head) for head in members] if members is not None else members_from_payloads(data)
    if sized is None:
        return [_Member(data, None)]
    view = memoryview(data)
    out = []
    at = 0
    for size, head in sized:
        out.append(_Member(view[at : at + size], head))
        at += size
    return out


_RECOVER_MARGIN_MS = 1000


def _iter_reply(reply: Any) -> Any:
    # RESP2 gives [[stream, entries], ...]; RESP3 a dict.
    if isinstance(reply, dict):
        return [
            (k, v[0] if v and isinstance(v[0], list) and len(v) == 1 and isinstance(v[0][0], list) else v)
            for k, v in reply.items()
        ]
    return [(stream, entries) for stream, entries in reply]


async def _within(scope: anyio.CancelScope, *loops: Coroutine[Any, Any, None]) -> None:
    """Run ``loops`` side by side under ``scope``, so that one ``cancel`` ends them all."""
    with scope:
        async with anyio.create_task_group() as tg:
            for loop in loops:
                tg.start_soon(_awaited, loop)


async def _awaited(work: Coroutine[Any, Any, None]) -> None:
    await work


@contextlib.contextmanager
def _sole_error() -> Iterator[None]:
    """Raise a task group's only error as itself, as asyncio.TaskGroup did for an error of its
    body, so that callers keep catching BrokerError & co; through nested groups too (the
    background loops run in a group of their own). Several errors stay a group."""
    try:
        yield
    except BaseExceptionGroup as group:
        sole: BaseException = group
        while isinstance(sole, BaseExceptionGroup) and len(sole.exceptions) == 1:
            sole = sole.exceptions[0]
        if sole is group:
            raise
        raise sole from None


async def _sleep_unless(event: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds``, or less if ``event`` is set meanwhile."""
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except asyncio.TimeoutError:  # TimeoutError from 3.11 on; not yet on 3.10
        pass


def _parse_id(value: bytes | str) -> tuple[int, int]:
    text = value.decode() if isinstance(value, bytes) else value
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)
