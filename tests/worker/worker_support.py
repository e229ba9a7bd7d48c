"""What several worker test files share: configs and pushes, a scorer that sleeps per
sample (Delays), slow samples, looks into the pending list and the results, and a dead
consumer that holds entries (ghost_holds).

Imported as ``worker_support`` (pytest puts this folder on the path, as tests/trainer does
with trainer_support.py); tests/helpers.py holds what the whole suite shares.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import Counter
from typing import Any

from helpers import (
    Counting,
    done_results,
    exact_traj,
    identity_score,
    stop_config,
)
from redis.exceptions import ConnectionError as RedisConnectionError

from stream_reward import ProducerConfig, RewardAggregator, RolloutProducer, Trajectory
from stream_reward.config import ConsumerConfig
from stream_reward.ops.deadletters import list_dead_letters
from stream_reward.scoring.scorer import Scored
from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys
from stream_reward.wire.push import REQUEUE_SCRIPT
from stream_reward.worker.consumer import Worker

HUGE_IDLE = 10**9


async def ghost_holds(redis_url: str, namespace: str, retrycounts: list[int]) -> list[bytes]:
    """A dead consumer 'ghost' reads the stream's entries; entry i is then marked idle for
    ever with times-delivered ``retrycounts[i]`` (a sweep's XAUTOCLAIM adds one)."""
    client = connect(redis_url)
    stream = Keys(namespace).stream()
    try:
        reply = await client.xreadgroup("scorers", "ghost", {stream: ">"}, count=100)
        ids = [eid for eid, _ in reply[0][1]] if isinstance(reply, list) else [eid for eid, _ in reply[stream][0]]
        for eid, count in zip(ids, retrycounts):
            await client.xclaim(stream, "scorers", "ghost", 0, [eid], idle=HUGE_IDLE, retrycount=count, justid=True)
        return ids
    finally:
        await client.aclose()


async def pending_of_stream(redis_url: str, namespace: str) -> list:
    client = connect(redis_url)
    try:
        rows = await client.xpending_range(Keys(namespace).stream(), "scorers", min="-", max="+", count=100)
        return [(r["message_id"], r["consumer"], r["time_since_delivered"], r["times_delivered"]) for r in rows]
    finally:
        await client.aclose()


async def peer_finishes_with_letters(redis_url: str, namespace: str, batch: str, **kw):
    """A burst peer with reclaim_idle_ms=60_000 takes what is left; then the batch's rewards,
    what stays pending and the dead letters."""
    scorer = Counting(first=0.0)
    peer = Worker(redis_url, scorer, stop_config(namespace, "peer", reclaim_idle_ms=60_000, **kw))
    await asyncio.wait_for(peer.run(asyncio.Event(), burst=True), 20)
    await peer.aclose()
    async with RewardAggregator(redis_url, namespace=namespace) as agg:
        rewards = await agg.collect(batch, timeout_s=1, on_timeout="resolve")
    left = await pending_of_stream(redis_url, namespace)
    letters = await list_dead_letters(redis_url, namespace=namespace)
    return scorer, rewards, left, letters


class Delays:
    """Scores by identity after ``delays[uid]`` seconds (``default`` otherwise) on a
    sample's first attempt, ``later`` after; counts attempts per (batch, uid)."""

    inline = False

    def __init__(self, delays: dict[str, float] | None = None, default: float = 0.05, later: float = 0.0) -> None:
        self.delays, self.default, self.later = delays or {}, default, later
        self.calls: Counter[tuple[str, str]] = Counter()
        self.started = asyncio.Event()

    async def score(self, t):
        self.calls[t.batch_id, t.uid] += 1
        self.started.set()
        first = self.calls[t.batch_id, t.uid] == 1
        await asyncio.sleep(self.delays.get(t.uid, self.default) if first else self.later)
        return Scored(identity_score(t))


def cfg(namespace: str, consumer: str, **kw) -> ConsumerConfig:
    return ConsumerConfig(
        namespace=namespace, consumer=consumer, **{"block_ms": 20, "drain_timeout_s": 0.3, "concurrency": 1, **kw}
    )


async def push(redis_url: str, namespace: str, trajs: list[Trajectory], *, k: int, partitions: int = 1) -> None:
    async with RolloutProducer(
        redis_url, ProducerConfig(namespace=namespace, samples_per_entry=k, partitions=partitions)
    ) as p:
        for batch in dict.fromkeys(t.batch_id for t in trajs):
            await p.open_batch(batch, sum(1 for t in trajs if t.batch_id == batch), 8)
        await p.push_many(trajs)


async def results(client, keys: Keys, batch: str, group: str = "scorers") -> list:
    out = []
    for p in range(keys.partitions):
        out += await done_results(client, keys.done(batch, p, group))
    return out


async def one_result_each(client, keys: Keys, batch: str, n: int, group: str = "scorers") -> list:
    got = await results(client, keys, batch, group)
    by_index = Counter(r.index for r in got)
    assert sorted(by_index) == list(range(n)) and set(by_index.values()) == {1}, (
        f"batch {batch!r} of group {group!r}: results by index {dict(by_index)} (want one for each of 0..{n - 1})"
    )
    return got


async def pending_count(client, keys: Keys, group: str = "scorers") -> int:
    total = 0
    for stream in keys.streams():
        total += (await client.xpending(stream, group))["pending"]
    return total


async def _async(value):
    return value


SLOW = "python:tests/data/reliability_scorers.py:slow"


def slow_traj(batch: str, i: int, sleep_s: float, poison: bool = False, hold: str | None = None) -> Trajectory:
    """``hold``: a file; the sample is not finished while it exists."""
    return Trajectory(
        batch,
        i,
        "test",
        response="poison" if poison else "ok",
        valid_response_length=1,
        extra_info={"sleep_s": sleep_s, **({"hold": hold} if hold else {})},
    )


def requeue_replies_lost(redis_url: str, *, every: bool) -> tuple:
    """A worker's client whose requeue script runs but whose reply is lost (the first time,
    or ``every`` time), and the list of the replies lost."""
    sha = hashlib.sha1(REQUEUE_SCRIPT.encode()).hexdigest()
    wc = connect(redis_url)
    original = wc.evalsha
    lost: list = []

    async def evalsha(script_sha, numkeys, *args):
        reply = await original(script_sha, numkeys, *args)
        if script_sha == sha and (every or not lost):
            lost.append(reply)
            raise RedisConnectionError("the requeue reply was lost")
        return reply

    wc.evalsha = evalsha
    return wc, lost


async def pending_rows(client, keys: Keys, group: str = "scorers") -> list:
    out = []
    for stream in keys.streams():
        rows = await client.xpending_range(stream, group, min="-", max="+", count=1000)
        out += [(r["message_id"], r["consumer"], r["time_since_delivered"], r["times_delivered"]) for r in rows]
    return out


async def finish_with_burst(redis_url: str, namespace: str, scorer, **cfg) -> None:
    w = Worker(redis_url, scorer, ConsumerConfig(namespace=namespace, block_ms=20, consumer="burst", **cfg))
    await asyncio.wait_for(w.run(asyncio.Event(), burst=True), 60)
    await w.aclose()


async def nothing_pending(client, keys: Keys) -> bool:
    return (await client.xpending(keys.stream(), "scorers"))["pending"] == 0


N = 40


def trajs(batch: str, n: int = N) -> list:
    return [exact_traj(batch, i) for i in range(n)]


async def collect(url: str, ns: str, batch: str, n: int, *, partitions: int = 1, timeout_s: float = 60, k: int = 1):
    async with (
        RolloutProducer(url, ProducerConfig(namespace=ns, partitions=partitions, samples_per_entry=k)) as producer,
        RewardAggregator(url, namespace=ns, partitions=partitions) as agg,
    ):
        await producer.open_batch(batch, n, 8)
        await producer.push_many([exact_traj(batch, i) for i in range(n)])
        return await agg.collect(batch, timeout_s=timeout_s)


async def _xlen_at_least(client: Any, key: str, n: int) -> bool:
    return await client.xlen(key) >= n


async def _no_pending(client: Any, stream: str) -> bool:
    return (await client.xpending(stream, "scorers"))["pending"] == 0
