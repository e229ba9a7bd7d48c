"""The read loop (stream_reward.worker.reading).

After a failed read, the worker takes back at once the entries pending under it that the
read can have delivered and that it does not hold, rather than leave them to the reclaimer
for reclaim_idle_ms. Each sample is scored once, every entry acked, nothing stalls, a stop
returns in time, and a worker restarted under the same name does not score settled
samples again.
"""

from __future__ import annotations

import asyncio
import collections
import time

import pytest
from helpers import (
    Counting,
    CutProxy,
    assert_each_once,
    exact_traj,
    identity_score,
    push_exact,
    running_worker,
)
from worker_support import collect

from stream_reward import ProducerConfig, RewardAggregator, RolloutProducer
from stream_reward.config import ConsumerConfig
from stream_reward.scoring.scorer import Scored
from stream_reward.worker.consumer import Worker

pytestmark = pytest.mark.anyio


class Slow:
    """Identity scores after ``delays[index]`` (default ``delay``); counts calls per uid."""

    inline = False

    def __init__(self, delay: float = 0.0, delays: dict[int, float] | None = None) -> None:
        self.delay, self.delays = delay, delays or {}
        self.calls: collections.Counter[str] = collections.Counter()

    async def score(self, t):
        self.calls[t.uid] += 1
        d = self.delays.get(t.index, self.delay)
        if d:
            await asyncio.sleep(d)
        return Scored(identity_score(t))

    def twice(self) -> dict[str, int]:
        return {u: c for u, c in self.calls.items() if c > 1}


def path_of(url: str) -> str:
    return url[len("unix://") :]


async def _collect(url, ns, batch, timeout_s=15, partitions=1):
    async with RewardAggregator(url, namespace=ns, partitions=partitions) as agg:
        return await agg.collect(batch, timeout_s=timeout_s)


async def _push(url, ns, batch, n, k=1, partitions=1):
    async with RolloutProducer(url, ProducerConfig(namespace=ns, samples_per_entry=k, partitions=partitions)) as p:
        await p.open_batch(batch, n, 8)
        await p.push_many([exact_traj(batch, i) for i in range(n)])


async def _arm_later(proxy: CutProxy, delay: float, times: int) -> None:
    await asyncio.sleep(delay)
    proxy.arm(b"XREADGROUP", times=times)


# --- a read whose reply was lost: what it delivered is taken back at once


async def test_lost_replies_while_entries_are_held_score_each_once(own_url, namespace) -> None:
    """Cuts land while earlier entries are still scoring (held): the recovery must skip them."""
    n = 40
    scorer = Slow(delay=0.4)
    await push_exact(own_url, namespace, "h", n)
    async with CutProxy(path_of(own_url)) as proxy:
        async with running_worker(proxy.url, namespace, scorer, concurrency=8, read_count=4):
            arming = asyncio.ensure_future(_arm_later(proxy, 0.2, 3))
            rewards = await _collect(own_url, namespace, "h")
            await arming
        assert proxy.cuts >= 1
    assert scorer.twice() == {}
    await assert_each_once(own_url, namespace, "h", rewards, n)


async def test_lost_replies_with_entries_of_several_samples_partly_settled(own_url, namespace) -> None:
    """k=4 entries, some samples fast some slow: an entry partly settled when a cut lands."""
    n = 32
    scorer = Slow(delay=0.0, delays={i: 0.6 for i in range(n) if i % 4 == 3})
    await push_exact(own_url, namespace, "k", n, k=4)
    async with CutProxy(path_of(own_url)) as proxy:
        async with running_worker(proxy.url, namespace, scorer, concurrency=6, read_count=8):
            arming = asyncio.ensure_future(_arm_later(proxy, 0.15, 4))
            rewards = await _collect(own_url, namespace, "k")
            await arming
        assert proxy.cuts >= 1
    assert scorer.twice() == {}
    await assert_each_once(own_url, namespace, "k", rewards, n)


async def test_the_recovery_read_itself_failing(own_url, namespace) -> None:
    """Two replies cut in a row: the read's, then the recovery read's."""
    n = 12
    scorer = Slow()
    await push_exact(own_url, namespace, "rr", n)
    async with CutProxy(path_of(own_url)) as proxy:
        proxy.arm(b"XREADGROUP", times=3)
        async with running_worker(proxy.url, namespace, scorer, concurrency=8, read_count=4):
            rewards = await _collect(own_url, namespace, "rr", timeout_s=10)
        assert proxy.cuts == 3
    assert scorer.twice() == {}
    await assert_each_once(own_url, namespace, "rr", rewards, n)


async def test_a_stop_while_the_recovery_waits_for_room_returns_in_time(own_url, namespace) -> None:
    """concurrency 2, a slow scorer, entries of 4: the recovered entries do not fit. A stop
    must end the wait (the recovery holds the reclaimer's lock, which the drain takes)."""
    scorer = Slow(delay=5.0)
    await push_exact(own_url, namespace, "st", 16, k=4)
    async with CutProxy(path_of(own_url)) as proxy:
        proxy.arm(b"XREADGROUP", times=1)
        cfg = ConsumerConfig(namespace=namespace, block_ms=20, drain_timeout_s=0.3, concurrency=2, read_count=8)
        worker = Worker(proxy.url, scorer, cfg)
        stop = asyncio.Event()
        task = asyncio.ensure_future(worker.run(stop))
        try:
            for _ in range(100):
                if sum(scorer.calls.values()) >= 2:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            stop.set()
            await asyncio.wait_for(task, 10)
            took = time.monotonic() - t0
        finally:
            if not task.done():
                task.cancel()
            await worker.aclose()
        assert proxy.cuts == 1
    assert took < 4.0, f"stop took {took:.1f} s"
    # What it did not finish went back to the group: a second worker finishes the batch.
    scorer2 = Slow()
    async with running_worker(own_url, namespace, scorer2, concurrency=8, reclaim_idle_ms=500):
        rewards = await _collect(own_url, namespace, "st")
    await assert_each_once(own_url, namespace, "st", rewards, 16)


async def test_a_burst_worker_with_a_lost_read_ends_with_everything_scored(own_url, namespace) -> None:
    n = 20
    scorer = Slow(delay=0.05)
    await push_exact(own_url, namespace, "b", n, k=2)
    async with CutProxy(path_of(own_url)) as proxy:
        proxy.arm(b"XREADGROUP", times=2)
        cfg = ConsumerConfig(namespace=namespace, block_ms=20, drain_timeout_s=0.3, concurrency=4, read_count=4)
        worker = Worker(proxy.url, scorer, cfg)
        try:
            await asyncio.wait_for(worker.run(burst=True), 10)
        finally:
            await worker.aclose()
        assert proxy.cuts == 2
    assert scorer.twice() == {}
    rewards = await _collect(own_url, namespace, "b", timeout_s=5)
    await assert_each_once(own_url, namespace, "b", rewards, n)


async def test_lost_reads_over_several_partitions(own_url, namespace) -> None:
    n = 30
    scorer = Slow(delay=0.1)
    await _push(own_url, namespace, "p", n, partitions=3)
    async with CutProxy(path_of(own_url)) as proxy:
        async with running_worker(proxy.url, namespace, scorer, concurrency=6, read_count=3, partitions=3):
            arming = asyncio.ensure_future(_arm_later(proxy, 0.1, 3))
            rewards = await _collect(own_url, namespace, "p", partitions=3)
            await arming
        assert proxy.cuts >= 1
    assert scorer.twice() == {}
    await assert_each_once(own_url, namespace, "p", rewards, n, partitions=3)


async def test_lost_reads_while_the_reclaimer_sweeps_slow_samples(own_url, namespace) -> None:
    """reclaim_idle_ms small, samples slower than it: the reclaimer and the recovery both
    see this consumer's pending entries."""
    n = 24
    scorer = Slow(delay=0.5)
    await push_exact(own_url, namespace, "rc", n)
    async with CutProxy(path_of(own_url)) as proxy:
        async with running_worker(
            proxy.url, namespace, scorer, concurrency=6, read_count=3, reclaim_idle_ms=300, reclaim_interval_s=0.05
        ):
            arming = asyncio.ensure_future(_arm_later(proxy, 0.2, 4))
            rewards = await _collect(own_url, namespace, "rc")
            await arming
        assert proxy.cuts >= 1
    assert scorer.twice() == {}
    await assert_each_once(own_url, namespace, "rc", rewards, n)


async def test_a_hand_back_then_a_lost_read(own_url, namespace) -> None:
    """Entries of 8 samples, concurrency 2: the worker hands samples back (_spill); cuts
    land meanwhile."""
    n = 32
    scorer = Slow(delay=0.2)
    await push_exact(own_url, namespace, "sp", n, k=8)
    async with CutProxy(path_of(own_url)) as proxy:
        async with running_worker(proxy.url, namespace, scorer, concurrency=2, read_count=2) as w:
            arming = asyncio.ensure_future(_arm_later(proxy, 0.3, 3))
            rewards = await _collect(own_url, namespace, "sp", timeout_s=25)
            await arming
            spilled = w.stats.spilled
        assert proxy.cuts >= 1
    assert spilled > 0, "nothing handed back: not tested"
    assert scorer.twice() == {}
    await assert_each_once(own_url, namespace, "sp", rewards, n)


async def test_a_fast_scorer_under_many_lost_reads(own_url, namespace) -> None:
    """Results settle (ack, then held dropped) while a recovery read is on its way: the
    recovery must not take an entry the writer just acked."""
    n = 300
    scorer = Slow(delay=0.0)
    await push_exact(own_url, namespace, "f", n)
    async with CutProxy(path_of(own_url)) as proxy:

        async def storm() -> None:
            for _ in range(40):
                proxy.arm(b"XREADGROUP", times=1)
                await asyncio.sleep(0.05)

        async with running_worker(proxy.url, namespace, scorer, concurrency=8, read_count=4):
            s = asyncio.ensure_future(storm())
            rewards = await _collect(own_url, namespace, "f", timeout_s=25)
            await s
        assert proxy.cuts >= 5
    assert scorer.twice() == {}
    await assert_each_once(own_url, namespace, "f", rewards, n)


async def test_a_restarted_worker_of_the_same_name_does_not_rescore_settled_samples(own_url, namespace) -> None:
    """A worker named "w1" dies with an entry of 4 samples partly settled (2 results written,
    the entry pending under w1). It restarts under the same name (a stable name: the
    heartbeat check lets it once the old one stops beating) and its first read's reply is
    lost. Its recovery finds the dead incarnation's entry pending under w1: taking it with
    deliveries=None skips the ledger check (_settled_before) the reclaimer makes, and the
    settled samples are scored again."""
    n = 4
    # Samples 0 and 2 fast, 1 and 3 hang in the first incarnation.
    first = Slow(delays={1: 60.0, 3: 60.0})
    await push_exact(own_url, namespace, "rs", n, k=4)
    cfg = ConsumerConfig(
        namespace=namespace,
        consumer="w1",
        block_ms=20,
        drain_timeout_s=0.3,
        concurrency=8,
        heartbeat_interval_s=0.2,
        reclaim_idle_ms=1500,
    )
    dead = Worker(own_url, first, cfg)
    run = asyncio.ensure_future(dead.run(asyncio.Event()))
    try:
        for _ in range(100):
            if dead.stats.scored >= 2 and dead.stats.in_flight <= 2:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # the two results written
    finally:
        run.cancel()  # a crash: nothing released, the entry stays pending under w1
        await asyncio.gather(run, return_exceptions=True)
        await dead.aclose()
    settled_uids = {exact_traj("rs", i).uid for i in (0, 2)}
    assert all(first.calls[u] == 1 for u in settled_uids), first.calls

    second = Slow()
    async with CutProxy(path_of(own_url)) as proxy:
        proxy.arm(b"XREADGROUP", times=1)
        worker = Worker(proxy.url, second, cfg)
        stop = asyncio.Event()
        task = asyncio.ensure_future(worker.run(stop))
        try:
            rewards = await _collect(own_url, namespace, "rs", timeout_s=10)
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
            await worker.aclose()
    rescored = {u: second.calls[u] for u in settled_uids if second.calls[u]}
    assert rescored == {}, f"settled samples scored again by the restarted worker: {rescored}"
    await assert_each_once(own_url, namespace, "rs", rewards, n)


async def test_a_lost_reply_to_a_read_that_delivered_entries_leaves_none_to_the_reclaimer(own_url, namespace) -> None:
    """The server ran the worker's XREADGROUP, so its entries are pending under the worker,
    and the reply was cut. The worker never saw them: left to the reclaimer, they waited
    reclaim_idle_ms (30 s) and a sweep. It reads its own pending entries back instead."""
    n = 12
    await push_exact(own_url, namespace, "lr", n)
    async with CutProxy(own_url[len("unix://") :]) as proxy:
        proxy.arm(b"XREADGROUP", times=1)
        async with running_worker(proxy.url, namespace, Counting(first=0.0, later=0.0), concurrency=8, read_count=4):
            async with RewardAggregator(own_url, namespace=namespace) as agg:
                rewards = await agg.collect("lr", timeout_s=10)
        assert proxy.cuts == 1
    await assert_each_once(own_url, namespace, "lr", rewards, n)


async def test_a_lost_reply_to_a_read_leaves_nothing_unscored(redis_url, namespace) -> None:
    """XREADGROUP runs (entries now pending on this consumer), its reply is lost: the
    worker must still score them (its own pending, or a reclaim)."""
    async with CutProxy(redis_url[len("unix://") :]) as proxy:
        async with running_worker(proxy.url, namespace, Counting(first=0.0), reclaim_idle_ms=500):
            await asyncio.sleep(0.3)
            proxy.arm(b"XREADGROUP", times=3)
            rewards = await collect(redis_url, namespace, "rl", 40, timeout_s=30)
        assert proxy.cuts >= 1
    await assert_each_once(redis_url, namespace, "rl", rewards, 40)
