"""Helpers the test files share: polling for a condition, scoring one batch end to end, and
listing what is queued."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from stream_reward import BatchPolicy, BatchRewards, ProducerConfig, RewardAggregator, RolloutProducer, Trajectory
from stream_reward.wire.codec import decode_trajectory
from stream_reward.wire.connection import connect
from stream_reward.wire.entries import FIELD_HANDED_BACK, FIELD_PAYLOAD, read_members
from stream_reward.wire.keys import Keys


async def wait_until(
    predicate: Callable[[], Awaitable[object]], timeout_s: float = 30.0, every_s: float = 0.05
) -> None:
    """Poll ``predicate`` until it is true; fail the test if it is not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(every_s)
    raise AssertionError("condition not reached in time")


async def score_batch(
    redis_url: str,
    namespace: str,
    trajs: list[Trajectory],
    *,
    width: int = 8,
    policy: BatchPolicy | None = None,
    timeout_s: float = 30,
) -> BatchRewards:
    """Open the trajectories' batch, push them all, collect: what a trainer does with running workers."""
    batch_id = trajs[0].batch_id
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await producer.open_batch(batch_id, len(trajs), width, policy=policy)
        await producer.push_many(trajs)
        return await agg.collect(batch_id, timeout_s=timeout_s)


async def done_results(client, done_key: str) -> list:
    """Every result record in a done stream, in order, as ScoreResults (a done-stream
    entry holds one worker flush's records back to back, see wire/ledger.py)."""
    from stream_reward.wire.codec import result_from_row
    from stream_reward.wire.ledger import done_rows

    out = []
    for _, fields in await client.xrange(done_key):
        rows, broken = done_rows(fields)
        assert broken is None, broken
        out += [result_from_row(row) for row in rows]
    return out


def samples_of(fields: dict) -> list[Trajectory]:
    """The trajectories one stream entry holds (one or more: see wire/entries.py)."""
    members = read_members(fields)
    assert members is not None, f"an entry with unreadable headers: {fields!r}"
    out, at = [], 0
    for batch, index, uid, size in members:
        t = decode_trajectory(fields[FIELD_PAYLOAD][at : at + size])
        assert (t.batch_id, t.index, t.uid) == (batch, index, uid), "a header names another sample"
        out.append(t)
        at += size
    return out


async def queued(redis_url: str, keys: Keys) -> list[tuple[str, str, int]]:
    """(batch, uid, index) of every sample producers queued in every stream of ``keys``, stream
    by stream (not the copies a worker handed back: see Worker._spill)."""
    client = connect(redis_url)
    try:
        out = []
        for stream in keys.streams():
            for _, fields in await client.xrange(stream):
                if FIELD_HANDED_BACK not in fields:
                    out += [(t.batch_id, t.uid, t.index) for t in samples_of(fields)]
        return out
    finally:
        await client.aclose()


async def pending_samples(redis_url: str, namespace: str, partitions: int = 1, group: str = "scorers") -> int:
    """Samples delivered to the group's consumers and not yet acked (XPENDING counts entries)."""
    client = connect(redis_url)
    try:
        total = 0
        for stream in Keys(namespace, partitions).streams():
            for row in await client.xpending_range(stream, group, min="-", max="+", count=100_000):
                for _, fields in await client.xrange(stream, min=row["message_id"], max=row["message_id"]):
                    total += len(samples_of(fields))
        return total
    finally:
        await client.aclose()
