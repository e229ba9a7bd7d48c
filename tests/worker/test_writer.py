"""The result writer (stream_reward.worker.writer): results and acks, one script call per
partition, on the worker's own connection (wire/lane.py).

A flush whose reply is lost after it ran counts each result once (dead letters included);
a script cache flushed under the writer is loaded again, and only the calls Redis refused
go again; an error reply is raised, never counted as 0 written; flushes paused under a stop
leave the stop bounded and lose nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

import msgpack
import pytest
from helpers import (
    Counting,
    CutProxy,
    assert_each_once,
    exact_traj,
    identity_score,
    lane_of,
    push_exact,
    running_worker,
    score_batch,
    stop_config,
    wait_until,
)
from redis.exceptions import NoScriptError, ResponseError
from worker_support import N, _no_pending, _xlen_at_least, trajs

from stream_reward import ProducerConfig, RewardAggregator, RolloutProducer
from stream_reward.ops.embedded import EmbeddedServer
from stream_reward.scoring.scorer import Scored
from stream_reward.wire.codec import encode_result
from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys
from stream_reward.wire.ledger import _WRITE_SCRIPT, LedgerItem, LedgerWriter
from stream_reward.wire.trajectory import ScoreResult
from stream_reward.worker.consumer import Worker

pytestmark = pytest.mark.anyio


def item(batch: str, i: int, dead: bool = False) -> LedgerItem:
    result = encode_result(ScoreResult(f"{batch}-{i}", batch, i, float(i), "ok"))
    return LedgerItem("", batch, f"{batch}-{i}", result, b"dead" if dead else None, ack=False)


class HalfFlushedLane:
    """A lane on which the script cache empties between the two calls of one write: the
    first call runs, the second is refused NOSCRIPT (an injected transport: a real server
    cannot be stopped between two pipelined commands)."""

    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    async def call(self, commands: list[bytes]) -> list[Any]:
        self.sent.append(commands)
        if len(self.sent) == 1:
            return [1, NoScriptError("NOSCRIPT No matching script.")]
        if commands[0].startswith(b"*3\r\n$6\r\nSCRIPT"):
            return [b"sha"]
        return [1] * len(commands)


SHA = hashlib.sha1(_WRITE_SCRIPT.encode()).hexdigest().encode()


async def add_garbage(client: Any, stream: str, n: int) -> None:
    """Entries naming no sample: each is dead-lettered alone (no batch to record it in)."""
    for i in range(n):
        await client.xadd(stream, {b"junk": f"garbage-{i}".encode()})


async def add_poison_in_batch(client: Any, stream: str, batch: str, index: int) -> None:
    """An entry whose header names a sample of ``batch`` but whose payload does not decode."""
    payload = b"\xc1not msgpack at all"
    header = msgpack.packb((batch, index, f"{batch}-{index}", len(payload)))
    await client.xadd(stream, {b"h": header, b"d": payload})


async def warm_up(url: str, ns: str) -> None:
    """One sample scored and flushed, so that the result script is in the server's cache."""
    await push_exact(url, ns, "warm", 1)
    admin = connect(url)
    try:
        await wait_until(lambda: _xlen_at_least(admin, Keys(ns).done("warm"), 1))
    finally:
        await admin.aclose()


# --- a flush whose reply is lost after it ran


async def test_a_result_flush_whose_reply_is_lost_after_it_ran_counts_once(redis_url, namespace) -> None:
    """The proxy passes the flush's script call on and drops the connection instead of its
    reply, three times: the results are in Redis, the worker cannot know, and sends them
    again on a new connection."""
    sha = hashlib.sha1(_WRITE_SCRIPT.encode()).hexdigest().encode()
    async with CutProxy(redis_url[len("unix://") :]) as proxy:
        async with running_worker(proxy.url, namespace, Counting(first=0.0)):
            # A flush first, so the script is in the server's cache: a cut NOSCRIPT reply
            # would be a call that never ran, and test nothing.
            await assert_each_once(
                redis_url, namespace, "warm", await score_batch(redis_url, namespace, trajs("warm")), N
            )
            proxy.arm(sha, times=3)
            rewards = await score_batch(redis_url, namespace, trajs("f"))
        assert proxy.cuts == 3, "the flush's reply was not lost: nothing tested"
    await assert_each_once(redis_url, namespace, "f", rewards, N)


async def test_a_lost_reply_to_a_flush_holding_an_unknown_batch_dead_letter_writes_it_once(
    redis_url, namespace
) -> None:
    """The flush of a garbage entry (dead letter, no batch to record it in) runs, its reply
    is lost: sent again, the script's k == 0 branch appends the dead letter again."""
    keys = Keys(namespace)
    admin = connect(redis_url)
    try:
        async with CutProxy(redis_url[len("unix://") :]) as proxy:
            async with running_worker(proxy.url, namespace, Counting(first=0.0)):
                await warm_up(redis_url, namespace)  # the script loaded: the cut flush runs
                proxy.arm(SHA)
                await add_garbage(admin, keys.stream(), 1)
                await wait_until(lambda: _xlen_at_least(admin, keys.dead_letters(), 1))
                await wait_until(lambda: _no_pending(admin, keys.stream()))
                await asyncio.sleep(0.5)
            assert proxy.cuts == 1, "the flush's reply was not lost: nothing tested"
        assert await admin.xlen(keys.dead_letters()) == 1, "the dead letter was written twice"
    finally:
        await admin.aclose()


async def test_a_lost_reply_to_a_flush_holding_a_poison_sample_of_a_batch_writes_it_once(redis_url, namespace) -> None:
    keys = Keys(namespace)
    admin = connect(redis_url)
    try:
        async with CutProxy(redis_url[len("unix://") :]) as proxy:
            async with running_worker(proxy.url, namespace, Counting(first=0.0)):
                async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
                    async with RewardAggregator(redis_url, namespace=namespace) as agg:
                        await producer.open_batch("pz", 3, 8)
                        await producer.push_many([exact_traj("pz", 0), exact_traj("pz", 1)])
                        await wait_until(lambda: _xlen_at_least(admin, keys.done("pz"), 1))
                        proxy.arm(SHA, times=2)
                        await add_poison_in_batch(admin, keys.stream(), "pz", 2)
                        rewards = await agg.collect("pz", timeout_s=20)
                await asyncio.sleep(0.3)
            assert proxy.cuts >= 1, "nothing cut"
        assert [(r.index, r.status) for r in rewards.results] == [(0, "ok"), (1, "ok"), (2, "failed")]
        assert await admin.xlen(keys.dead_letters()) == 1, "the dead letter was written twice"
        assert await _no_pending(admin, keys.stream())
    finally:
        await admin.aclose()


# --- the write script on the lane: cache flushed, error replies


async def test_a_script_cache_flushed_under_the_worker_is_loaded_again(own_url, namespace) -> None:
    admin = connect(own_url)
    try:
        async with running_worker(own_url, namespace, Counting(first=0.0)):
            await assert_each_once(own_url, namespace, "a", await score_batch(own_url, namespace, trajs("a")), N)
            await admin.script_flush()
            await assert_each_once(own_url, namespace, "b", await score_batch(own_url, namespace, trajs("b")), N)
    finally:
        await admin.aclose()


async def test_an_error_reply_to_a_flush_on_the_lane_is_raised_not_counted_as_0(redis_url, namespace) -> None:
    client = connect(redis_url)
    lane = lane_of(client)
    keys = Keys(namespace)
    try:
        await client.set(keys.done("w"), "not a stream")
        ledger = LedgerWriter(client, keys, "scorers", result_ttl_s=60, lane=lane)
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await ledger.write(0, [item("w", 0)])
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await ledger.write_partitions({0: [item("w", 1)], 1: []})
    finally:
        lane.close()
        await client.aclose()


async def test_a_script_flush_between_two_writes_on_the_lane_loads_it_once_and_counts_each_once(
    own_url, namespace
) -> None:
    client = connect(own_url)
    lane = lane_of(client)
    keys = Keys(namespace, partitions=2)
    try:
        ledger = LedgerWriter(client, keys, "scorers", result_ttl_s=60, lane=lane)
        assert await ledger.write_partitions({0: [item("s", 0)], 1: [item("s", 1)]}) == 2
        await client.script_flush()
        assert await ledger.write_partitions({0: [item("s", 2), item("s", 0)], 1: [item("s", 3)]}) == 2
        assert await client.script_exists(hashlib.sha1(_WRITE_SCRIPT.encode()).hexdigest()) == [True]
    finally:
        lane.close()
        await client.aclose()


async def test_only_the_calls_refused_noscript_go_again(redis_url, namespace) -> None:
    """The first partition's call ran (its dead letter is written); sent again it would be
    written twice. Only the second goes again, after the script is loaded."""
    client = connect(redis_url)
    try:
        ledger = LedgerWriter(client, Keys(namespace, partitions=2), "scorers", result_ttl_s=60)
        fake = HalfFlushedLane()
        ledger._lane = fake  # type: ignore[assignment]
        assert await ledger.write_partitions({0: [item("h", 0, dead=True)], 1: [item("h", 1)]}) == 2
        assert [len(c) for c in fake.sent] == [2, 1, 1]
        assert b"SCRIPT" in fake.sent[1][0] and b"h-1" in fake.sent[2][0] and b"h-0" not in fake.sent[2][0]
    finally:
        await client.aclose()


# --- flushes paused under a stop


@pytest.mark.parametrize("mode", ["ALL", "WRITE"])
async def test_a_client_pause_under_the_flushes_then_a_stop_returns_in_time_and_nothing_is_lost(
    namespace, mode
) -> None:
    with EmbeddedServer() as server:
        url = server.url
        await push_exact(url, namespace, "ps", 12)
        admin = connect(url, timeout_s=None)  # its UNPAUSE may wait out the pause (ALL holds it too)
        scorer = Counting(first=0.2, later=0.0)
        w = Worker(url, scorer, stop_config(namespace, "w1"))
        stop = asyncio.Event()
        run = asyncio.ensure_future(w.run(stop))
        try:
            await asyncio.wait_for(scorer.started.wait(), 5)
            await admin.execute_command("CLIENT", "PAUSE", 15000, mode)
            await asyncio.sleep(0.5)  # results finish scoring, their flush is held by the pause
            stop.set()
            t0 = time.monotonic()
            done, _ = await asyncio.wait([run], timeout=0.3 + 5.5)
            took = time.monotonic() - t0
            assert done, f"run() not back {took:.1f} s after a stop under CLIENT PAUSE {mode}"
            assert run.exception() is None, run.exception()
        finally:
            await admin.execute_command("CLIENT", "UNPAUSE")
            run.cancel()
            await asyncio.wait([run], timeout=5)
            await w.aclose()
        # A second worker finishes what the first left: each counted once, all acked.
        async with running_worker(url, namespace, Counting(first=0.0), reclaim_idle_ms=300, consumer="w2"):
            async with RewardAggregator(url, namespace=namespace) as agg:
                rewards = await agg.collect("ps", timeout_s=30)
            await wait_until(lambda: _no_pending(admin, Keys(namespace).stream()))
        await assert_each_once(url, namespace, "ps", rewards, 12)
        await admin.aclose()


class Gated:
    """Scores by identity once ``gate`` is set; ``calls`` lists the uids it was given."""

    inline = False

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.gate = asyncio.Event()

    async def score(self, t: Any) -> Any:
        self.calls.append(t.uid)
        await self.gate.wait()
        return Scored(identity_score(t))


async def test_results_refused_for_memory_are_written_once_memory_is_back(own_url, namespace, caplog) -> None:
    """``OOM command not allowed`` (noeviction at maxmemory) is the server's answer for now,
    not a lost server: the writer keeps the results, logs the real cause, and writes them
    when memory frees; the worker stays up."""
    n = 6
    admin = connect(own_url)
    scorer = Gated()
    try:
        async with running_worker(own_url, namespace, scorer) as w:
            await push_exact(own_url, namespace, "oom", n)

            async def all_given() -> bool:
                return len(scorer.calls) == n

            await wait_until(all_given)
            await admin.config_set("maxmemory-policy", "noeviction")
            await admin.config_set("maxmemory", 1)  # below what is used: every write is refused
            scorer.gate.set()

            async def refused() -> bool:
                return any("maxmemory" in r.getMessage() for r in caplog.records)

            await wait_until(refused)
            assert not any("unreachable" in r.getMessage() for r in caplog.records)
            await admin.config_set("maxmemory", 0)
            async with RewardAggregator(own_url, namespace=namespace) as agg:
                rewards = await agg.collect("oom", timeout_s=30)
            assert w.stats.in_flight == 0
        await assert_each_once(own_url, namespace, "oom", rewards, n)
    finally:
        await admin.aclose()
