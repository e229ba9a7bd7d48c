"""What the aggregator holds against the server: its clock, and what it has read of a batch.

Two things a collect must not take from its own host:

- **Time.** A batch's deadline is stamped in the server's time by the open script
  (``trainer/batches.py``). The aggregator reads the server's ``TIME`` once per
  collect, with the batch meta, and carries it on the loop's monotonic clock
  (``ServerClock``): a producer or trainer whose clock is off by an hour neither
  misses a deadline nor hits one at once, and no sample pays a round trip for it.
- **What was written.** Keys the pipeline wrote can vanish without the namespace
  epoch going: an operator's DEL, an eviction (``--allow-eviction``), a failover to a
  replica that had not received everything. ``BatchWatch`` remembers, per batch,
  how many done-stream entries this aggregator has read from each stream; a check
  made while a wait is idle (and before what is missing is resolved at a deadline or
  timeout) compares that with the server: a batch record that is gone, or a done
  stream holding fewer entries than were read from it, is a ``StateLostError``
  naming the batch and the key, never a "deadline", "expired" or "never opened".
  Done streams are never trimmed while a batch lives (only ``forget`` deletes them,
  after the meta says so), so their length only grows.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

from stream_reward.errors import ConfigError, StateLostError

__all__ = ["ServerClock", "BatchWatch", "Watches", "server_time", "lost_key", "check_written"]

_WATCHED_BATCHES = 256  # batches remembered per aggregator, newest last

# What may have taken a key, for the message: the causes a namespace epoch would not show.
_CAUSES = "deleted, evicted (a maxmemory-policy other than noeviction) or lost in a failover to a replica that lagged"


def server_time(reply: Any) -> float:
    """Seconds since the epoch from a TIME reply (redis-py: (seconds, microseconds))."""
    seconds, micros = reply
    return int(seconds) + int(micros) / 1e6


class ServerClock:
    """The server's time, read once and carried on the loop's monotonic clock."""

    __slots__ = ("_server", "_loop")

    def __init__(self, server_now: float, loop_now: float) -> None:
        self._server = server_now
        self._loop = loop_now

    def now(self) -> float:
        """The server's time now, as far as this host's monotonic clock can tell."""
        return self._server + (asyncio.get_running_loop().time() - self._loop)

    def to_loop(self, server_at: float) -> float:
        """The loop time at which the server's clock shows ``server_at``."""
        return server_at - self._server + self._loop


class BatchWatch:
    """What one aggregator has read of one batch: done-stream entries per stream."""

    __slots__ = ("entries", "ledgers", "ended")

    def __init__(self) -> None:
        self.entries: dict[str, int] = {}
        self.ledgers: dict[str, str] = {}  # done stream -> the write-once ledger written with it
        self.ended = False  # collected or forgotten here: its keys may go by TTL from now on

    def saw(self, stream: str, count: int) -> None:
        """``count`` entries of ``stream`` read by one pass from its start."""
        if count > self.entries.get(stream, 0):
            self.entries[stream] = count


class Watches:
    """The watches of an aggregator's recent batches, bounded."""

    def __init__(self) -> None:
        self._by_batch: OrderedDict[str, BatchWatch] = OrderedDict()

    def of(self, batch_id: str) -> BatchWatch:
        watch = self._by_batch.get(batch_id)
        if watch is None:
            watch = self._by_batch[batch_id] = BatchWatch()
            while len(self._by_batch) > _WATCHED_BATCHES:
                self._by_batch.popitem(last=False)
        else:
            self._by_batch.move_to_end(batch_id)
        return watch

    def get(self, batch_id: str) -> BatchWatch | None:
        return self._by_batch.get(batch_id)


def lost_key(batch_id: str, key: str, what: str) -> StateLostError:
    """The error for a key of ``batch_id`` the pipeline wrote and the server no longer holds."""
    return StateLostError(
        f"batch {batch_id!r} lost state: {what} ({key!r}) — {_CAUSES}. Its results cannot be trusted to be "
        "complete: open it again under a new id and push it again",
        [batch_id],
        key=key,
    )


async def check_written(client: Any, batch_id: str, meta_key: str, watch: BatchWatch | None) -> None:
    """One round trip: raise StateLostError when the batch record is gone, or a done stream
    holds fewer entries than this aggregator read from it (results went backwards)."""
    if watch is not None and watch.ended:
        return  # collected or forgotten: its keys go by their TTL now, which is no loss
    # The counts as they stand before the round trip: on a cluster the other streams'
    # readers run meanwhile, and an entry read after this XLEN ran is no loss.
    had = {s: n for s, n in watch.entries.items() if n > 0} if watch is not None else {}
    streams = list(had)
    async with client.pipeline(transaction=False) as pipe:
        pipe.hmget(meta_key, ["size", "forgotten"])
        for stream in streams:
            pipe.xlen(stream)
            pipe.exists(watch.ledgers[stream])  # type: ignore[union-attr]
        (size, forgotten), *replies = await pipe.execute()
    if size is None:
        raise lost_key(batch_id, meta_key, "its batch record is gone while it was being collected")
    if forgotten:  # another caller's forget() dropped its results: no loss, and no waiting for them
        raise ConfigError(
            "batch_id",
            f"batch {batch_id!r} was forgotten while being collected (RewardAggregator.forget): its results "
            "were dropped then",
        )
    for at, stream in enumerate(streams):
        length, ledger_kept = int(replies[2 * at]), replies[2 * at + 1]
        if length < had[stream]:
            raise lost_key(
                batch_id, stream, f"its results stream holds {length} entries, {had[stream]} were read from it before"
            )
        if not ledger_kept:
            # Written with the stream's first entry, expiring with it: gone, a redelivered
            # sample would be scored and counted again.
            ledger = watch.ledgers[stream]  # type: ignore[union-attr]
            raise lost_key(batch_id, ledger, "its write-once result ledger is gone, its results stream is not")
