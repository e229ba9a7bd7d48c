"""One result listener per process: per-sample results without an XREAD per result.

``score(traj)`` and ``result(batch_id, uid)`` register a future here and the
listener resolves it. A single reader task follows every done stream someone is
waiting on with one XREAD ... COUNT over all of them (in a cluster, one reader
per partition, since one XREAD's streams must share a slot), so a page of
results from hundreds of batches costs one round trip, however many samples
are waited on.

A blocking XREAD cannot take new streams while it waits. When a waiter needs a
stream the reader does not follow yet, the listener XADDs a tick to the
reader's private wake stream, which is part of every read: the block ends at
once and the next read includes the new stream. That costs one XADD per new
batch, not per sample.

A done stream holds each uid's first result once, so a result read before
anyone asked for it (``result()`` called after it landed) is kept, as its
unpacked record, while its stream is followed; a stream nobody has waited on for
``linger_s`` is dropped with what was kept, and read again from the start if
asked for later.

Listeners are shared per (event loop, Redis URL, namespace) and counted:
``acquire_listener`` / ``release_listener``; the last release closes it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

from stream_reward.config import DEFAULT_GROUP
from stream_reward.errors import BrokerError, ResultTimeoutError
from stream_reward.wire.codec import row_header, stored_result
from stream_reward.wire.connection import REDIS_ERRORS, connect, is_cluster, with_reconnect
from stream_reward.wire.entries import read_streams
from stream_reward.wire.keys import Keys
from stream_reward.wire.lane import Lane
from stream_reward.wire.ledger import done_rows
from stream_reward.wire.trajectory import ScoreResult

__all__ = ["ResultListener", "acquire_listener", "release_listener"]

log = logging.getLogger(__name__)

PAGE_COUNT = 1000  # entries per stream per XREAD; an entry is one worker flush (many results)
TIMEOUT_TICK_S = 0.05  # result timeouts fire on ticks of this length
WAKE_TTL_S = 3600


@dataclass(eq=False)
class _Followed:
    """A done stream being read: where the reader is, what landed, who waits."""

    cursor: bytes | str = "0-0"
    # uid -> result record, kept only once someone asked for a result that may have
    # landed already (result()); score() registers before its push and needs none.
    keep: bool = False
    epoch: int = 0
    landed: dict[str, Any] = field(default_factory=dict)
    waiters: dict[str, list[asyncio.Future[ScoreResult]]] = field(default_factory=dict)
    idle_since: float = 0.0


class _Reader:
    """One XREAD loop over the followed done streams of one slot group."""

    def __init__(self, listener: ResultListener, wake_key: str) -> None:
        self.listener = listener
        self.wake_key = wake_key
        self.wake_cursor: bytes | str = "0-0"
        self.streams: dict[str, _Followed] = {}
        self.task: asyncio.Task[None] | None = None
        self.reading: set[str] = set()  # streams in the XREAD in flight
        self.woken = False
        # Its reads on a connection of its own where one serves (wire/lane.py): a round trip
        # per page of results, and redis-py's cost a round trip was most of a page's.
        self.lane = Lane.for_client(listener.client)

    def follow(self, name: str) -> _Followed:
        followed = self.streams.get(name)
        if followed is None:
            followed = self.streams[name] = _Followed(idle_since=asyncio.get_running_loop().time())
            if self.task is None or self.task.done():
                self.task = asyncio.ensure_future(self._run())
            else:
                self._wake_if_reading()
        return followed

    def reread(self, followed: _Followed) -> None:
        """Keep what lands from now on, and read the stream again from its start:
        results read before were not kept."""
        followed.keep = True
        followed.cursor = "0-0"
        followed.epoch += 1  # a read in flight must not move the cursor back past the results
        self._wake_if_reading()

    def _wake_if_reading(self) -> None:
        if self.reading and not self.woken:
            self.woken = True
            self.listener._spawn(self._wake())

    async def _wake(self) -> None:
        client = self.listener.client
        try:
            async with client.pipeline(transaction=False) as pipe:
                pipe.xadd(self.wake_key, {"w": 1}, maxlen=1, approximate=False)
                pipe.expire(self.wake_key, WAKE_TTL_S)
                await pipe.execute()
        except REDIS_ERRORS as exc:
            # The read ends on its own within block_ms; only latency is lost.
            log.debug("waking the result reader failed: %s", type(exc).__name__)

    async def _run(self) -> None:
        listener = self.listener
        loop = asyncio.get_running_loop()
        try:
            while not listener.closed:
                self._drop_idle(loop.time())
                if not self.streams:
                    return
                cursors: dict[str, Any] = {name: f.cursor for name, f in self.streams.items()}
                epochs = {name: f.epoch for name, f in self.streams.items()}
                cursors[self.wake_key] = self.wake_cursor
                self.reading = set(cursors)
                self.woken = False
                try:
                    reply = await with_reconnect(
                        functools.partial(
                            read_streams,
                            listener.client,
                            cursors,
                            count=PAGE_COUNT,
                            block=listener.block_ms,
                            lane=self.lane,
                        ),
                        what="read results",
                    )
                finally:
                    self.reading = set()
                for stream, entries in reply or []:
                    name = stream.decode() if isinstance(stream, bytes) else stream
                    if name == self.wake_key:
                        self.wake_cursor = entries[-1][0]
                        continue
                    followed = self.streams.get(name)
                    if followed is None or followed.epoch != epochs.get(name):
                        continue  # dropped, or to be read again from the start
                    followed.cursor = entries[-1][0]
                    self._land(name, followed, entries)
                if reply and listener.read_interval_s > 0:
                    # Let a few worker flushes gather before the next read: at thousands of
                    # results a second this turns many one-flush pages into a few fuller ones,
                    # for a bounded delay (the next read returns at once if anything landed).
                    await asyncio.sleep(listener.read_interval_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # Redis gone for good or refusing: every waiter hears it
            self.fail_waiters(
                exc if isinstance(exc, BrokerError) else BrokerError(f"reading results: {type(exc).__name__}")
            )
            self.streams.clear()

    def fail_waiters(self, error: BaseException) -> None:
        for followed in self.streams.values():
            for futures in followed.waiters.values():
                for fut in futures:
                    if not fut.done():
                        fut.set_exception(error)

    @staticmethod
    def _land(name: str, followed: _Followed, entries: list[Any]) -> None:
        waiters = followed.waiters
        landed = followed.landed
        keep = followed.keep
        for entry_id, fields in entries:  # one entry per worker flush: its result records
            if not keep and not waiters:
                continue
            rows, broken = done_rows(fields)
            if broken is not None:
                log.warning("%s entry %r: bytes that are not result records (%s)", name, entry_id, broken)
            for row in rows:
                header = row_header(row)
                if header is None:
                    continue
                uid = header[0]
                if keep:
                    landed[uid] = row
                futures = waiters.pop(uid, None)
                if futures:
                    result = stored_result(row)
                    for fut in futures:
                        if not fut.done():
                            fut.set_result(result)  # type: ignore[arg-type]  # a record with a header has one

    def _drop_idle(self, now: float) -> None:
        linger = self.listener.linger_s
        for name in [n for n, f in self.streams.items() if not f.waiters and now - f.idle_since >= linger]:
            del self.streams[name]


class ResultListener:
    """Resolves per-sample result futures from the done streams (see module doc)."""

    def __init__(
        self,
        client: Any,
        namespace: str,
        *,
        block_ms: int = 1000,
        linger_s: float = 30.0,
        read_interval_s: float = 0.001,
        owns_client: bool = False,
    ) -> None:
        self.client = client
        self.read_interval_s = read_interval_s
        self.namespace = namespace
        self.block_ms = block_ms
        self.closed = False
        self.linger_s = linger_s
        self._owns_client = owns_client
        self._cluster = is_cluster(client)
        self._id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._readers: dict[int, _Reader] = {}
        self._due: dict[int, dict[asyncio.Future[ScoreResult], tuple[str, str, float]]] = {}  # tick -> timeouts
        self._tasks: set[asyncio.Task[Any]] = set()
        self.refs = 0
        # The loop its futures belong to, looked up once: watch() and arm() run per sample,
        # and get_running_loop() was a tenth of their cost.
        self._loop: asyncio.AbstractEventLoop | None = None

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _reader(self, partition: int, keys: Keys) -> _Reader:
        group = partition if self._cluster else 0
        reader = self._readers.get(group)
        if reader is None:
            # Under the partition's tag: in a cluster it shares the slot of the done streams it is read with.
            reader = self._readers[group] = _Reader(self, f"{keys.tag(group)}:wake:{self._id}")
        return reader

    async def wait(
        self,
        batch_id: str,
        uid: str,
        partitions: list[int],
        keys: Keys,
        *,
        group: str = DEFAULT_GROUP,
        timeout_s: float | None = None,
    ) -> ScoreResult:
        """The result of ``uid`` in ``batch_id``, from consumer ``group``'s done streams of ``partitions``."""
        fut = self.expect(batch_id, uid, partitions, keys, group=group)
        tick = -1
        try:
            # A timeout on the future itself, not wait_for(shield(...)): that costs a task and
            # two more futures per sample, which at thousands of samples a second shows.
            if timeout_s is not None and not fut.done():
                tick = self.arm(fut, batch_id, uid, timeout_s)
            return await fut
        finally:
            if not fut.done():
                fut.cancel()
            self.forget(fut, tick)

    def arm(self, fut: asyncio.Future[ScoreResult], batch_id: str, uid: str, timeout_s: float) -> int:
        """Time ``fut`` out after ``timeout_s`` (up to TIMEOUT_TICK_S later, never sooner);
        returns the tick it is due in (-1: never), which ``unwatch`` takes. One timer per
        tick for every sample due in it: a timer per sample (call_later, then cancel) was a
        tenth of the per-sample path's cost in this process."""
        loop = self._loop or self._bind()
        # A timeout below 0 (-inf too) is due at once; an infinite (or NaN) one never comes.
        at = (loop.time() + max(timeout_s, 0.0)) / TIMEOUT_TICK_S
        if not math.isfinite(at):
            return -1
        tick = math.ceil(at)
        due = self._due.get(tick)
        if due is None:
            due = self._due[tick] = {}
            loop.call_at(tick * TIMEOUT_TICK_S, self._time_out, tick)
        due[fut] = (batch_id, uid, timeout_s)
        return tick

    def _bind(self) -> asyncio.AbstractEventLoop:
        loop = self._loop = asyncio.get_running_loop()
        return loop

    def _time_out(self, tick: int) -> None:
        for fut, (batch_id, uid, timeout_s) in self._due.pop(tick, {}).items():
            if not fut.done():
                fut.set_exception(ResultTimeoutError(batch_id, uid, timeout_s))

    def expect(
        self,
        batch_id: str,
        uid: str,
        partitions: list[int],
        keys: Keys,
        *,
        group: str = DEFAULT_GROUP,
        landed: bool = True,
    ) -> asyncio.Future[ScoreResult]:
        """Register interest in a result. ``landed=False`` when the sample is not pushed
        yet (its result cannot have been read), which spares keeping what lands."""
        fut: asyncio.Future[ScoreResult] = asyncio.get_running_loop().create_future()
        where: list[tuple[_Followed, str]] = []  # (followed, uid) pairs to clean up
        fut._sr_where = where  # type: ignore[attr-defined]
        for p in partitions:
            reader = self._reader(p, keys)
            followed = reader.follow(keys.done(batch_id, p, group))
            if landed and not followed.keep:
                reader.reread(followed)
            if followed.landed:
                row = followed.landed.get(uid)
                if row is not None:
                    fut.set_result(stored_result(row))  # type: ignore[arg-type]  # kept only with a header
                    return fut
            _add_waiter(followed, uid, fut)
            where.append((followed, uid))
        return fut

    def watch(self, uid: str, partition: int, keys: Keys, done: str) -> tuple[asyncio.Future[ScoreResult], _Followed]:
        """``expect(..., landed=False)`` for score(): one partition, whose done stream is
        ``done`` (the caller keeps the name per batch). Returns the future and the stream
        followed, which ``unwatch`` takes: no cleanup list set on the future (an attribute
        costs the future a dict, once per sample)."""
        fut: asyncio.Future[ScoreResult] = (self._loop or self._bind()).create_future()
        followed = self._reader(partition, keys).follow(done)
        if followed.landed:  # kept for someone else (the sample may have been pushed before)
            row = followed.landed.get(uid)
            if row is not None:
                fut.set_result(stored_result(row))  # type: ignore[arg-type]  # kept only with a header
                return fut, followed
        _add_waiter(followed, uid, fut)
        return fut, followed

    def unwatch(self, fut: asyncio.Future[ScoreResult], followed: _Followed, uid: str, tick: int) -> None:
        """Drop a future ``watch`` registered (resolved, cancelled or timed out)."""
        _drop_waiter(followed, uid, fut)
        if tick >= 0:
            due = self._due.get(tick)
            if due is not None:
                due.pop(fut, None)  # resolved: its timeout no longer holds it

    def reread(self, batch_id: str, partitions: list[int], keys: Keys, *, group: str = DEFAULT_GROUP) -> None:
        """Read ``batch_id``'s done streams of ``partitions`` again from their start, keeping
        what lands: a waiter registered with ``landed=False`` whose result may have been read
        past already (its sample was pushed before) is resolved from it."""
        for p in partitions:
            reader = self._reader(p, keys)
            followed = reader.follow(keys.done(batch_id, p, group))
            if not followed.keep:
                reader.reread(followed)

    def forget(self, fut: asyncio.Future[ScoreResult], tick: int = -1) -> None:
        """Drop a future ``expect`` registered (resolved, cancelled or timed out); ``tick``
        is what ``arm`` returned for it."""
        where = getattr(fut, "_sr_where", None)
        if where:
            for followed, uid in where:
                _drop_waiter(followed, uid, fut)
            fut._sr_where = []  # type: ignore[attr-defined]
        due = self._due.get(tick)
        if due is not None:
            due.pop(fut, None)  # resolved: its timeout no longer holds it

    async def aclose(self) -> None:
        # A cancel that lands inside redis-py's blocking read can be lost (Python 3.11):
        # the readers also stop on this flag, and a wake ends their read at once.
        self.closed = True
        await asyncio.gather(*(r._wake() for r in self._readers.values() if r.reading), return_exceptions=True)
        readers = [r.task for r in self._readers.values() if r.task is not None]
        for task in [*readers, *self._tasks]:
            task.cancel()
        await asyncio.gather(*readers, *self._tasks, return_exceptions=True)
        # Whoever still waits would wait for ever: nothing reads their results any more.
        error = BrokerError("the result listener was closed (its producer or aggregator closed) before the result came")
        for reader in self._readers.values():
            reader.fail_waiters(error)
            if reader.lane is not None:
                reader.lane.close()
        self._readers.clear()
        if self._owns_client:
            await self.client.aclose()


def _add_waiter(followed: _Followed, uid: str, fut: asyncio.Future[ScoreResult]) -> None:
    waiting = followed.waiters.get(uid)
    if waiting is None:
        followed.waiters[uid] = [fut]
    else:
        waiting.append(fut)


def _drop_waiter(followed: _Followed, uid: str, fut: asyncio.Future[ScoreResult]) -> None:
    waiters = followed.waiters
    futures = waiters.get(uid)
    if futures is not None:
        if len(futures) == 1:
            if futures[0] is fut:
                del waiters[uid]
        else:
            try:
                futures.remove(fut)
            except ValueError:
                pass
            if not futures:
                del waiters[uid]
    if not waiters:  # idle from now (only a stream nobody waits on is ever dropped)
        followed.idle_since = asyncio.get_running_loop().time()


# Per event loop (a listener's futures and tasks belong to one loop), then per (server, namespace).
_LISTENERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str], ResultListener]] = (
    weakref.WeakKeyDictionary()
)


def acquire_listener(url: str | None, client: Any, namespace: str) -> ResultListener:
    """The process's listener for this loop, server and namespace (a new one on first use).

    With a URL the listener opens its own client (its blocking read holds a
    connection, and it outlives any one producer); with only a client (tests,
    a cluster client made by the caller) it shares that one.
    """
    mine = _LISTENERS.setdefault(asyncio.get_running_loop(), {})
    key = (url if url is not None else f"client:{id(client)}", namespace)
    listener = mine.get(key)
    if listener is None:
        own = url is not None
        listener = mine[key] = ResultListener(connect(url) if url is not None else client, namespace, owns_client=own)
        listener._release_key = key  # type: ignore[attr-defined]
    listener.refs += 1
    return listener


async def release_listener(listener: ResultListener) -> None:
    listener.refs -= 1
    if listener.refs > 0:
        return
    mine = _LISTENERS.get(asyncio.get_running_loop(), {})
    if mine.get(listener._release_key) is listener:  # type: ignore[attr-defined]
        del mine[listener._release_key]  # type: ignore[attr-defined]
    await listener.aclose()
