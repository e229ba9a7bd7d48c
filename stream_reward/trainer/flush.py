"""The producer's flush: one coalesced group of pushes sent to Redis in one round trip.

The coalescer (``coalescer.py``) hands ``_flush`` the entries of concurrent pushes; it
groups them into push-script calls per (partition, chunk), sends them packed on the
producer's own connection (``wire/lane.py``) where one serves, or in one pipeline, reloads
the script when a restarted server lost it, and places each call's reply against the
backlog estimate (``backlog.py``). Everything here runs once per flush, not per sample.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError

from stream_reward.trainer.backlog import _BacklogLayer
from stream_reward.trainer.samples import _Entry
from stream_reward.wire.connection import is_cluster, is_permanent, wait_out_refusals
from stream_reward.wire.entries import XADD_MANY_CHUNK
from stream_reward.wire.lane import Lane
from stream_reward.wire.packed import can_send_packed, pack_command, send_packed
from stream_reward.wire.push import DUPLICATE, FRESH, PUSH_SCRIPT, push_args

# A push whose lane connection is lost is sent again on a new one: up to 3 tries, 50 then 100 ms apart.
_LANE_ATTEMPTS = 3
_LANE_BACKOFF_S = 0.05


class _FlushLayer(_BacklogLayer):
    """Sends a RolloutProducer's coalesced pushes (see the module docstring)."""

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
            # A refused script ran none of its writes, and calls that landed before it are
            # found as duplicates: a refusal for now is waited out.
            replies = await wait_out_refusals(
                lambda: self._call_push(calls, cluster), what=f"push of {len(entries)} trajectories failed"
            )
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
                # A duplicate too: the same content, and a push retried after part of it
                # landed finds that part as duplicates, whose lengths are not written yet.
                if verdict in (FRESH, DUPLICATE) and entry.length >= 0:
                    lengths.setdefault(entry.batch, {})[entry.index] = entry.length
            await wait_out_refusals(
                lambda: asyncio.gather(
                    *(self.client.hset(self.keys.lengths(b), mapping=m) for b, m in lengths.items())
                ),
                what="recording response lengths",
            )
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
