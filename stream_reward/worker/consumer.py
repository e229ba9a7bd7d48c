"""One worker process's consumer: read, decode, score, write once, ack.

``Worker`` is put together from one class per concern, each in a module of its own, over
the state they share (``state``):

* ``reading``: the reader XREADGROUPs new entries while there is room under
  ``concurrency`` (against a cluster, one read loop per partition);
* ``opening``: a read's entries are opened into samples; what has a result already is not
  scored again, and what this worker has no room for is handed back to the stream;
* ``samples``: each sample is dead-lettered or scored, in the reader's task for scorers
  that never suspend (``inline``), else in a task of its own;
* ``writer``: the writer settles finished samples, everything since its last round trip in
  one Lua call per partition (result + ack together);
* ``reclaim``: the reclaimer XAUTOCLAIMs entries a dead consumer left pending, and scores
  suspects (entries that keep coming back) alone, to pin a crash on the one that caused it;
* ``housekeeping``: the housekeeper renews held entries, heartbeats and trims;
* ``stop``: a graceful stop drains, hands back and releases what is left to the group.

This module holds what ties them together: ``run``, the tasks it starts and how they end.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
from collections import defaultdict
from collections.abc import Coroutine
from typing import Any

import anyio

from stream_reward.errors import ConfigError
from stream_reward.wire.connection import REDIS_ERRORS, connect, mask_url, with_reconnect
from stream_reward.wire.entries import RELEASE_SCRIPT, ensure_group
from stream_reward.wire.eviction import check_eviction
from stream_reward.wire.heartbeat import decode_heartbeat
from stream_reward.wire.lane import Lane
from stream_reward.wire.ledger import LedgerWriter
from stream_reward.wire.namespace import join_namespace
from stream_reward.wire.push import REQUEUE_SCRIPT
from stream_reward.worker.reading import Reading
from stream_reward.worker.reclaim import UNCOUNT_SCRIPT, Reclaiming
from stream_reward.worker.state import WorkerStats, sleep_unless, sole_error
from stream_reward.worker.stop import Stopping

__all__ = ["Worker", "WorkerStats"]

log = logging.getLogger(__name__)


class Worker(Reading, Reclaiming, Stopping):
    """A consumer in the namespace's group. ``await Worker(url, scorer).run(stop)``.

    ``burst=True`` returns once the streams hold nothing for this worker (tests,
    one-shot scoring); otherwise it runs until ``stop`` is set.

    ``Worker(redis_url, scorer, config=None, *, client=None, hooks=None)``: see
    ``stream_reward.worker.state.WorkerState`` for what each of its fields is for.
    """

    async def run(self, stop: asyncio.Event | None = None, *, burst: bool = False) -> None:
        stop = stop or asyncio.Event()
        self._begin_run()
        self._burst = burst
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
        self._uncount = client.register_script(UNCOUNT_SCRIPT)
        for stream in self.keys.streams():
            await with_reconnect(
                functools.partial(ensure_group, client, stream, self.config.group),
                what="create group",
                give_up_after_s=None,
                stop=stop,
            )
        # Refuse (ProtocolMismatchError: exit 2) a namespace of another protocol version rather than
        # poison it, and (EvictionPolicyError) a server that may evict what it writes.
        await with_reconnect(
            lambda: check_eviction(client, f"worker on {mask_url(self._url)}", allow=self.config.allow_eviction),
            what="read maxmemory-policy",
            give_up_after_s=None,
            stop=stop,
        )
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
            with sole_error():
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
            if beat.get("group", self.config.group) != self.config.group:
                return True  # names are per group: another group's worker holds none of our entries
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
            await sleep_unless(stop, min(0.5, self.config.heartbeat_interval_s / 2))
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


async def _within(scope: anyio.CancelScope, *loops: Coroutine[Any, Any, None]) -> None:
    """Run ``loops`` side by side under ``scope``, so that one ``cancel`` ends them all."""
    with scope:
        async with anyio.create_task_group() as tg:
            for loop in loops:
                tg.start_soon(_awaited, loop)


async def _awaited(work: Coroutine[Any, Any, None]) -> None:
    await work
