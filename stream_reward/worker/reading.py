"""The read loop: XREADGROUP new entries while there is room under ``concurrency``.

One XREADGROUP over every partition (one round trip), or against a cluster, where no
command spans two hash slots, one read loop per partition on the node that owns it; the
loops share ``concurrency`` by reserving room before they block. A read whose reply was
lost may still have delivered entries: after a failed read they are taken back at once
(``_recover_delivered``) instead of after reclaim_idle_ms. Streams that vanished (Redis
restarted without persistence, flushed) are recreated and the namespace rejoined.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from typing import Any

import anyio
from redis.exceptions import ResponseError

from stream_reward.wire.connection import (
    CLUSTER_ERRORS,
    TRANSIENT_ERRORS,
    LogLimiter,
    fault_text,
    is_cluster,
    is_permanent,
    is_transient,
    permanent_error,
)
from stream_reward.wire.entries import ensure_group, read_group
from stream_reward.wire.lane import Lane
from stream_reward.wire.namespace import join_namespace
from stream_reward.worker.opening import EntryOpening
from stream_reward.worker.state import sleep_unless, sole_error

__all__ = ["Reading"]

log = logging.getLogger(__name__)


class Reading(EntryOpening):
    """Read new entries and hand them to ``_process``."""

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
        with sole_error():
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
                    limiter.warning("read failed: %s; reading again", fault_text(exc))
                    await sleep_unless(stop, backoff_s * (0.5 + random.random()))
                    backoff_s = min(backoff_s * 2, 2.0)
                    continue
                except ResponseError as exc:
                    if is_transient(exc):  # BUSY, LOADING: the server is there, and busy
                        limiter.warning("read failed: %s; reading again", fault_text(exc))
                        await sleep_unless(stop, backoff_s * (0.5 + random.random()))
                        backoff_s = min(backoff_s * 2, 2.0)
                        continue
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


_RECOVER_MARGIN_MS = 1000


def _iter_reply(reply: Any) -> Any:
    # RESP2 gives [[stream, entries], ...]; RESP3 a dict.
    if isinstance(reply, dict):
        return [
            (k, v[0] if v and isinstance(v[0], list) and len(v) == 1 and isinstance(v[0][0], list) else v)
            for k, v in reply.items()
        ]
    return [(stream, entries) for stream, entries in reply]
