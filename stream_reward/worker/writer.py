"""The result writer: settles what a worker finished.

Scoring tasks queue a result (or an ack alone) per sample; one writer task sends
everything queued since its last round trip in one Lua call per partition, result and
ack together, so that results are batched under load and still land within a round trip
when idle. An entry of several samples is acked with the result of its last sample to
settle, never before. Apart from the other loops because at a stop it is the one allowed
to outlive the drain, up to the drain deadline (``_stop_writer``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import defaultdict
from typing import cast

from stream_reward.errors import BrokerError
from stream_reward.wire.connection import (
    with_reconnect,
)
from stream_reward.wire.ledger import LedgerItem
from stream_reward.worker.state import WorkerState

__all__ = ["ResultWriting"]

log = logging.getLogger(__name__)


class ResultWriting(WorkerState):
    """Queue settled samples and write them, acks and all."""

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
