"""The trainer side: gather a batch's results and build verl's ``rm_scores``.

The aggregator blocks on the batch's ``done`` streams (XREAD BLOCK), which hold
each sample's first result in landing order; it never sleep-polls. A batch has
one done stream per partition: on a single node one XREAD follows them all; in
a cluster (where they live in different slots) one reader per partition does.

A batch's rewards are its own: the aggregator reads the ledger of the consumer
group the batch names (batch meta ``group``), never another group's. It counts
by index: the first result of each index is the sample's, a second uid pushed
at the same index is a conflict that is logged and never resolves another
sample, and the batch is complete when every index has a result. The batch
deadline resolves only what is missing: results already stored are returned
whenever ``collect`` is called. A result of another protocol version fails its
own sample. When the namespace's epoch vanishes mid-wait (Redis lost its state)
``StateLostError`` is raised at once.
How the results become ``rm_scores``: ``trainer/rewards.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from functools import partial
from typing import Any

from stream_reward.config import DEFAULT_NAMESPACE
from stream_reward.errors import CollectTimeoutError, ConfigError, StateLostError
from stream_reward.trainer.listener import ResultListener, acquire_listener, release_listener
from stream_reward.trainer.rewards import BatchRewards, rewards_of_records
from stream_reward.trainer.tensors import import_torch
from stream_reward.trainer.watch import BatchWatch, ServerClock, Watches, check_written, lost_key, server_time
from stream_reward.wire.batch_meta import BatchMeta
from stream_reward.wire.codec import stored_record
from stream_reward.wire.connection import (
    connect,
    is_cluster,
    mask_url,
    wait_out_refusals,
    with_reconnect,
)
from stream_reward.wire.entries import read_streams
from stream_reward.wire.eviction import check_eviction, eviction_note
from stream_reward.wire.keys import Keys
from stream_reward.wire.ledger import done_rows
from stream_reward.wire.namespace import check_protocol
from stream_reward.wire.trajectory import ResultRecord, ScoreResult

__all__ = ["RewardAggregator"]

log = logging.getLogger(__name__)


class RewardAggregator:
    """``async with RewardAggregator(url) as agg: rewards = await agg.collect(batch_id)``."""

    def __init__(
        self,
        redis_url: str,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        partitions: int | None = None,
        collected_ttl_s: int = 3600,
        client: Any = None,
        block_ms: int = 1000,
        allow_eviction: bool = False,
    ) -> None:
        # torch is imported here, not at module level (workers import this package
        # and must start fast), and not at the first collect (its ~1 s import would
        # land in the reward tail of the first batch).
        import_torch("the reward aggregator")

        self._url = redis_url
        self._namespace = namespace
        self._partitions = partitions
        self._client = client
        self._owns_client = client is None
        self.collected_ttl_s = collected_ttl_s
        self.block_ms = block_ms
        self.allow_eviction = allow_eviction  # see wire/eviction.py
        self._epoch: str | None = None  # the namespace epoch this aggregator last saw
        self._clock: ServerClock | None = None  # the server's time, read with the last batch meta
        self._watches = Watches()  # what this aggregator read of its recent batches (see watch.py)
        self._listener: ResultListener | None = None  # the process's result listener, on first result()

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = connect(self._url)
        return self._client

    async def __aenter__(self) -> RewardAggregator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._listener is not None:
            listener, self._listener = self._listener, None
            await release_listener(listener)
        if self._client is not None and self._owns_client:
            await self._client.aclose()
        self._client = None

    async def meta(self, batch_id: str) -> BatchMeta:
        """The batch's meta record. Raises ConfigError for a batch never opened, expired
        or forgotten, StateLostError when the namespace lost its state."""
        meta = await self._meta(batch_id)
        if meta.forgotten:
            raise ConfigError(
                "batch_id",
                f"batch {batch_id!r} was collected and forgotten {time.ctime(meta.forgotten)}: its results were "
                "dropped then (RewardAggregator.forget); keep the BatchRewards of its collect",
            )
        return meta

    async def _meta(self, batch_id: str) -> BatchMeta:
        try:
            return await self._read_meta(batch_id)
        except StateLostError as exc:
            raise await self._noted(exc) from None

    async def _noted(self, exc: StateLostError) -> StateLostError:
        """``exc`` with what the server says of evictions, when it evicts (see eviction_note)."""
        note = await eviction_note(self.client)
        return StateLostError(f"{exc}; {note}", exc.batches, key=exc.key) if note else exc

    async def _read_meta(self, batch_id: str) -> BatchMeta:
        keys = Keys(self._namespace)

        cluster = is_cluster(self.client)

        async def read() -> list[Any]:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.hgetall(keys.batch_meta(batch_id))
                pipe.hmget(keys.namespace_info(), ["protocol", "epoch"])
                pipe.zscore(keys.history(), batch_id)
                pipe.exists(keys.lengths(batch_id))
                if not cluster:  # (a cluster pipeline takes keyed commands only: TIME apart, below)
                    pipe.time()
                replies = await pipe.execute()
            if cluster:
                replies.append(await self.client.time())
            replies.append(asyncio.get_running_loop().time())
            return replies  # type: ignore[no-any-return]

        await with_reconnect(
            lambda: check_eviction(self.client, f"aggregator on {mask_url(self._url)}", allow=self.allow_eviction),
            what="read maxmemory-policy",
        )
        raw, (protocol, epoch), opened, lengths_kept, now, read_at = await with_reconnect(read, what="read batch meta")
        if isinstance(now, dict):  # a cluster client's TIME of some node
            now = next(iter(now.values()))
        self._clock = ServerClock(server_time(now), read_at)
        check_protocol(keys, protocol)
        if raw and epoch is not None and raw.get(b"epoch") == epoch:
            # A batch of the current epoch: whatever this aggregator saw before, this batch is whole.
            self._epoch = epoch.decode()
        else:
            self._notice_epoch(epoch, batch_id)
        if not raw:
            watch = self._watches.get(batch_id)
            if lengths_kept or (watch is not None and not watch.ended):
                # Its lengths hash lives exactly as long as the record (same TTL, both set at open
                # and at collect), and this aggregator was reading it: the record was taken.
                raise lost_key(batch_id, keys.batch_meta(batch_id), "its batch record is gone, its other keys are not")
            if opened is not None:
                raise ConfigError(
                    "batch_id",
                    f"batch {batch_id!r} expired: opened {time.ctime(float(opened))}, its keys are gone "
                    f"(kept collected_ttl_s after collect, the producer's result_ttl_s if never collected)",
                )
            hint = "" if epoch is not None else " (the namespace holds no state: never used, or Redis lost it)"
            raise ConfigError("batch_id", f"batch {batch_id!r} was never opened in namespace {self._namespace!r}{hint}")
        return BatchMeta.decode(raw)

    def _notice_epoch(self, epoch: bytes | str | None, batch_id: str) -> None:
        """Raise StateLostError when the namespace epoch this aggregator saw is gone or changed."""
        now = epoch.decode() if isinstance(epoch, bytes) else epoch
        seen = self._epoch
        if now is not None:
            self._epoch = now
        if seen is not None and now != seen:
            raise StateLostError(
                f"namespace {self._namespace!r} lost its state (epoch {seen} is "
                f"{'gone' if now is None else 'replaced by ' + now}): Redis restarted without persistence, was "
                f"flushed, evicted it or failed over to an empty replica. Batch {batch_id!r} lost its queued trajectories and "
                "results: open it again under a new id and push it again",
                [batch_id],
            )

    async def _check_state(self, batch_id: str, watch: BatchWatch) -> None:
        """Called while waiting idle for results, and before a deadline or timeout resolves
        what is missing: a vanished epoch, a batch record that is gone or a done stream that
        went backwards (see watch.py) ends the wait at once. Never on a page of results:
        a busy batch pays nothing for it."""
        keys = Keys(self._namespace)
        try:
            if self._epoch is not None:
                epoch = await with_reconnect(
                    lambda: self.client.hget(keys.namespace_info(), "epoch"), what="read namespace epoch"
                )
                self._notice_epoch(epoch, batch_id)
            await with_reconnect(
                lambda: check_written(self.client, batch_id, keys.batch_meta(batch_id), watch),
                what="check batch state",
            )
        except StateLostError as exc:
            raise await self._noted(exc) from None

    def _server_clock(self) -> ServerClock:
        if self._clock is None:  # (meta() reads it; a caller that built its own meta has none yet)
            loop_now = asyncio.get_running_loop().time()
            return ServerClock(time.time(), loop_now)
        return self._clock

    async def result(self, batch_id: str, uid: str, *, timeout_s: float | None = None) -> ScoreResult:
        """One sample's result, as soon as it lands (at once if it already has), whoever pushed it.

        Served by the process's one result listener: any number of concurrent calls
        cost one XREAD per page of results. Raises ResultTimeoutError past ``timeout_s``.
        """
        meta = await self.meta(batch_id)
        if self._listener is None:
            self._listener = acquire_listener(self._url, self._client, self._namespace)
        keys = Keys(self._namespace, self._partitions or meta.partitions)
        return await self._listener.wait(
            batch_id, uid, list(range(keys.partitions)), keys, group=meta.group, timeout_s=timeout_s
        )

    async def stream(self, batch_id: str, *, timeout_s: float | None = None) -> AsyncIterator[ScoreResult]:
        """Yield each sample's result once, as it lands; ends when the batch is complete.

        Stops early (without raising) at ``timeout_s`` or the batch deadline; use
        ``collect`` for policy handling of what is missing.
        """
        meta = await self.meta(batch_id)
        async for page in self._results(batch_id, meta, timeout_s):
            for record, extra in page:
                yield ScoreResult.from_record(record, extra)

    async def _results(
        self, batch_id: str, meta: BatchMeta, timeout_s: float | None, ended: dict[str, bool] | None = None
    ) -> AsyncIterator[list[tuple[ResultRecord, dict[str, Any]]]]:
        """The batch's results as records and their extras, each uid once, a page at a time
        (one async step per result cost more than decoding it). When it stops short, ``ended["deadline"]``
        says whether the batch deadline (rather than ``timeout_s``) was the limit."""
        keys = Keys(self._namespace, self._partitions or meta.partitions)
        loop = asyncio.get_running_loop()
        # Both limits on the monotonic clock; the deadline (the server's time, see
        # watch.py) is converted once, with the server time read with the meta: neither
        # this host's clock nor a wall-clock step during the wait moves it.
        timeout_end = loop.time() + timeout_s if timeout_s is not None else None
        deadline_end = self._server_clock().to_loop(meta.deadline) if meta.deadline else None
        end = min((e for e in (timeout_end, deadline_end) if e is not None), default=None)
        if ended is not None:
            ended["deadline"] = deadline_end is not None and deadline_end == end
        done = [keys.done(batch_id, p, meta.group) for p in range(keys.partitions)]
        seen: set[str] = set()  # uids already read
        filled: set[int] = set()  # indices resolved: the batch is complete when all are
        if meta.size <= 0:
            return
        watch = self._watches.of(batch_id)
        for p, name in enumerate(done):
            watch.ledgers[name] = keys.results(batch_id, p, meta.group)
        if len(done) > 1 and is_cluster(self.client):
            pages = self._pages_apart(batch_id, done, end, watch)
        else:
            pages = self._pages_together(batch_id, done, end, watch)
        try:
            async for entries in pages:
                page: list[tuple[ResultRecord, dict[str, Any]]] = []
                for entry_id, fields in entries:  # one entry per worker flush: its result records
                    rows, broken = done_rows(fields)
                    if broken is not None:
                        log.warning(
                            "batch %r: done-stream entry %r holds bytes that are not result records (%s); "
                            "its samples from there on resolve as missing",
                            batch_id,
                            entry_id,
                            broken,
                        )
                    for row in rows:
                        stored = stored_record(row)
                        if stored is None:
                            log.warning("batch %r: a result record that names no sample ignored: %.80r", batch_id, row)
                            continue
                        uid, index = stored[0][0], stored[0][2]  # ResultRecord: ScoreResult's field order
                        if uid in seen:
                            continue
                        seen.add(uid)
                        if not 0 <= index < meta.size:
                            log.warning(
                                "batch %r: result for uid %r has index %d outside the batch size %d; ignored",
                                batch_id,
                                uid,
                                index,
                                meta.size,
                            )
                            continue
                        if index in filled:
                            # A second uid pushed at an index: a conflict. The first result is
                            # the sample's; this one never resolves another sample.
                            log.warning(
                                "batch %r: uid %r is a second sample at index %d; ignored",
                                batch_id,
                                uid,
                                index,
                            )
                            continue
                        filled.add(index)
                        page.append(stored)
                if page:
                    yield page
                if len(filled) >= meta.size:
                    return
        finally:
            await pages.aclose()

    async def _read(self, cursors: dict[str, Any], block: int | None) -> Any:
        """One XREAD of the done streams; ``block`` None reads what is there without waiting."""
        return await read_streams(self.client, cursors, count=1000, block=block)

    def _block_ms(self, end: float | None) -> int | None:
        """BLOCK for the next read; None once ``end`` has passed."""
        if end is None:
            return self.block_ms
        left = end - asyncio.get_running_loop().time()
        return max(1, min(self.block_ms, int(left * 1000))) if left > 0 else None

    async def _pages_together(
        self, batch_id: str, done: list[str], end: float | None, watch: BatchWatch
    ) -> AsyncGenerator[list[Any], None]:
        """Entries of every done stream, one XREAD over all of them (a single node).

        Past ``end`` it still reads, without blocking, until the streams are drained:
        a deadline resolves only what is missing, never a result already stored."""
        cursors = {name: "0-0" for name in done}
        read = dict.fromkeys(done, 0)
        while True:
            block = self._block_ms(end)
            reply = await with_reconnect(partial(self._read, cursors, block), what="read results")
            if not reply:
                if block is None:
                    return
                await self._check_state(batch_id, watch)
                continue
            for stream, entries in reply:
                name = stream.decode()
                cursors[name] = entries[-1][0]
                read[name] += len(entries)
                watch.saw(name, read[name])
                yield entries

    async def _pages_apart(
        self, batch_id: str, done: list[str], end: float | None, watch: BatchWatch
    ) -> AsyncGenerator[list[Any], None]:
        """The same from a cluster, where the done streams of a batch live in
        different slots: one blocking reader per partition, merged as they land."""
        queue: asyncio.Queue[list[Any]] = asyncio.Queue()

        async def follow(name: str) -> None:
            cursor = "0-0"
            read = 0
            while True:
                block = self._block_ms(end)
                reply = await with_reconnect(partial(self._read, {name: cursor}, block), what="read results")
                if not reply:
                    if block is None:
                        return
                    await self._check_state(batch_id, watch)
                    continue
                for _stream, entries in reply:
                    cursor = entries[-1][0]
                    read += len(entries)
                    watch.saw(name, read)
                    queue.put_nowait(entries)

        readers = [asyncio.create_task(follow(name)) for name in done]
        try:
            while True:
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait([getter, *readers], return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield getter.result()
                    continue
                getter.cancel()
                for reader in readers:
                    if reader.done() and reader.exception() is not None:
                        raise reader.exception()  # type: ignore[misc]
                if all(reader.done() for reader in readers):  # past the end: drain what landed meanwhile
                    while not queue.empty():
                        yield queue.get_nowait()
                    return
                readers = [reader for reader in readers if not reader.done()]
        finally:
            for reader in readers:
                reader.cancel()
            # A reader cancelled mid-BLOCK drops its connection (redis-py closes it); the pool opens another.
            await asyncio.gather(*readers, return_exceptions=True)

    async def collect(
        self, batch_id: str, timeout_s: float | None = None, *, on_timeout: str = "raise"
    ) -> BatchRewards:
        """Wait for every sample of the batch and build its rewards.

        Past ``timeout_s``: ``on_timeout="raise"`` raises CollectTimeoutError;
        ``"resolve"`` resolves missing samples as failed (reason ``timeout``) under
        the batch's policy. Past the batch deadline missing samples always
        resolve as failed (reason ``deadline``).
        """
        meta = await self.meta(batch_id)
        # Records and extras apart, by index (one each: _results counts by index), for the
        # records to go untracked while the batch fills (see _Records).
        by_index: dict[int, ResultRecord] = {}
        extras: dict[int, dict[str, Any]] = {}
        ended = {"deadline": False}
        async for page in self._results(batch_id, meta, timeout_s, ended):
            for record, extra in page:
                by_index[record[2]] = record
                extras[record[2]] = extra
        if len(by_index) < meta.size:
            # What is missing may have been lost rather than late: say so, not "deadline".
            await self._check_state(batch_id, self._watches.of(batch_id))
            overdue = ended["deadline"]
            if not overdue and on_timeout == "raise":
                raise CollectTimeoutError(batch_id, len(by_index), meta.size)
            limit = "deadline" if overdue else "timeout"
            missing = [index for index in range(meta.size) if index not in by_index]
            lengths, uids = await self._pushed(batch_id, missing, meta.partitions)
            for index, length, uid in zip(missing, lengths, uids):
                if length is None and uid is None:
                    reason, error = "never_pushed", f"never pushed before the batch {limit}"
                else:
                    named = f" as uid {uid!r}" if uid else ""
                    reason, error = limit, f"pushed{named} but not scored before the batch {limit}"
                failed = ScoreResult.failed(
                    uid or "", batch_id, index, reason=reason, error=error, valid_response_length=length
                )
                by_index[index], extras[index] = failed.record(), failed.extra
        order = range(meta.size)
        rewards = rewards_of_records(batch_id, meta, [by_index[i] for i in order], [extras[i] for i in order])
        await self._expire(batch_id, meta)
        return rewards

    async def _pushed(
        self, batch_id: str, indices: list[int], partitions: int
    ) -> tuple[list[int | None], list[str | None]]:
        """For samples without a result: the response length the producer recorded at
        push (None if none) and the uid it pushed them under (None if never pushed),
        from the claims the push script keeps (``Keys.claims``: ``i<index>`` -> "digest uid")."""
        if not indices:
            return [], []
        keys = Keys(self._namespace, partitions)
        # One claims hash under partition 0 on a single node; one per partition in a cluster.
        claim_parts = range(partitions) if is_cluster(self.client) else range(1)
        fields = [f"i{index}" for index in indices]

        async def read() -> list[Any]:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.hmget(keys.lengths(batch_id), indices)
                for p in claim_parts:
                    pipe.hmget(keys.claims(batch_id, p), fields)
                return await pipe.execute()  # type: ignore[no-any-return]

        lengths, *claims = await with_reconnect(read, what="read pushed samples")
        uids: list[str | None] = []
        for at in range(len(indices)):
            claim = next((c[at] for c in claims if c[at] is not None), None)
            uids.append(claim.decode().split(" ", 1)[1] if claim is not None else None)
        return [int(v) if v is not None else None for v in lengths], uids

    async def forget(self, batch_id: str) -> None:
        """Drop a collected batch's results now, not ``collected_ttl_s`` after its collect.

        For batches nobody collects twice, such as one per trajectory as an agent loop
        sends them: a batch's results stream costs some 4 KB however few samples it
        holds, so an hour of them costs gigabytes. What stays until ``collected_ttl_s``
        is small: the write-once marks (a late result of a reclaimed sample is still
        refused, not stored again) and the meta record (the id is still refused; a
        collect, stream or result of it raises ConfigError saying it was forgotten).
        Idempotent.
        """
        meta = await self._meta(batch_id)
        keys = Keys(self._namespace, self._partitions or meta.partitions)
        what = f"forgetting batch {batch_id!r}"

        async def forget_once() -> None:
            async with self.client.pipeline(transaction=False) as pipe:
                for p in range(keys.partitions):
                    pipe.delete(keys.done(batch_id, p, meta.group), keys.claims(batch_id, p))
                    pipe.expire(keys.results(batch_id, p, meta.group), self.collected_ttl_s)
                pipe.delete(keys.lengths(batch_id))
                now = self._server_clock().now()  # the server's: status compares it with other hosts'
                pipe.hset(keys.batch_meta(batch_id), "forgotten", now)
                if not meta.collected:
                    pipe.hset(keys.batch_meta(batch_id), "collected", now)
                pipe.expire(keys.batch_meta(batch_id), self.collected_ttl_s)
                pipe.zrem(keys.batches(), batch_id)
                await pipe.execute()

        # Idempotent: a stamp refused for now (OOM at maxmemory) is waited out, bounded.
        await wait_out_refusals(forget_once, what=what)
        self._watches.of(batch_id).ended = True  # its keys go by TTL (or went) from here on

    async def _expire(self, batch_id: str, meta: BatchMeta) -> None:
        keys = Keys(self._namespace, self._partitions or meta.partitions)
        # The results are read: only the closing stamps are left, idempotent. A refusal
        # for now (OOM at maxmemory, the moment results pile up) is waited out, bounded.
        await wait_out_refusals(partial(self._expire_once, batch_id, meta, keys), what=f"expiring batch {batch_id!r}")
        self._watches.of(batch_id).ended = True  # its keys go by TTL (or went) from here on

    async def _expire_once(self, batch_id: str, meta: BatchMeta, keys: Keys) -> None:
        async with self.client.pipeline(transaction=False) as pipe:
            for p in range(keys.partitions):
                pipe.expire(keys.results(batch_id, p, meta.group), self.collected_ttl_s)
                pipe.expire(keys.done(batch_id, p, meta.group), self.collected_ttl_s)
                pipe.expire(keys.claims(batch_id, p), self.collected_ttl_s)
            if not meta.collected:  # reopening the id is refused while the meta lives; it says when
                pipe.hset(keys.batch_meta(batch_id), "collected", self._server_clock().now())
            pipe.expire(keys.batch_meta(batch_id), self.collected_ttl_s)
            pipe.expire(keys.lengths(batch_id), self.collected_ttl_s)
            pipe.zrem(keys.batches(), batch_id)
            await pipe.execute()
