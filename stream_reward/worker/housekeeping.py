"""Housekeeping: heartbeats, renewing held entries, dropping stale notes, trimming.

The housekeeper renews the entries this worker holds well within reclaim_idle_ms, so that
no peer takes a slow sample from a live worker; heartbeats its stats (what ``status`` and
the name check read); drops quarantine notes a Redis error left behind; and trims stream
entries every group has acked. None of it may take the worker down.
"""

from __future__ import annotations

import asyncio
import logging
import os

from stream_reward.wire.codec import PROTOCOL_VERSION
from stream_reward.wire.connection import (
    REDIS_ERRORS,
)
from stream_reward.wire.heartbeat import encode_heartbeat, server_time
from stream_reward.worker.state import WorkerState, sleep_unless

__all__ = ["Housekeeping"]

log = logging.getLogger(__name__)


class Housekeeping(WorkerState):
    """The housekeeper loop and its chores."""

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
            await sleep_unless(stop, tick_s)

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
        # A round trip first: a worker that cannot reach Redis writes no heartbeat and
        # goes stale for the others, and ``seen`` is when the server saw it.
        now = await server_time(self._client)
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


def _parse_id(value: bytes | str) -> tuple[int, int]:
    text = value.decode() if isinstance(value, bytes) else value
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)
