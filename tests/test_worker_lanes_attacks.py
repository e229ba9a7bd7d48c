"""More attacks on the worker's lanes (reads and result flushes on wire/lane.py connections),
by a helper: a reply lost after a flush holding a dead letter or after a read, CLIENT PAUSE
under the flushes then a stop, a server restart mid-run, a client= on database 5, and a stop
while a lane's reconnection hangs in its handshake."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import time
from typing import Any

import msgpack
import pytest
import redis.asyncio as aredis
from helpers import (
    Counting,
    CutProxy,
    assert_each_once,
    exact_traj,
    push_exact,
    running_worker,
    stop_config,
    wait_until,
)

from stream_reward import ProducerConfig, RewardAggregator, RolloutProducer
from stream_reward.ops.embedded import EmbeddedServer
from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys
from stream_reward.wire.ledger import _WRITE_SCRIPT
from stream_reward.worker.consumer import Worker

pytestmark = pytest.mark.anyio

SHA = hashlib.sha1(_WRITE_SCRIPT.encode()).hexdigest().encode()
LANE_CMDS = {"xreadgroup", "evalsha", "script|load", "script"}


async def collect(url: str, ns: str, batch: str, n: int, *, partitions: int = 1, timeout_s: float = 60, k: int = 1):
    async with (
        RolloutProducer(url, ProducerConfig(namespace=ns, partitions=partitions, samples_per_entry=k)) as producer,
        RewardAggregator(url, namespace=ns, partitions=partitions) as agg,
    ):
        await producer.open_batch(batch, n, 8)
        await producer.push_many([exact_traj(batch, i) for i in range(n)])
        return await agg.collect(batch, timeout_s=timeout_s)


async def kill_lane_like(admin: Any) -> int:
    """CLIENT KILL every connection whose last command is one the worker's lanes send."""
    killed = 0
    listing = await admin.execute_command("CLIENT", "LIST")
    text = listing.decode() if isinstance(listing, bytes) else listing
    for line in text.splitlines():
        fields = dict(kv.split("=", 1) for kv in line.split(" ") if "=" in kv)
        if fields.get("cmd") in LANE_CMDS:
            with contextlib.suppress(Exception):
                killed += await admin.execute_command("CLIENT", "KILL", "ID", fields["id"]) == b"OK" or 1
    return killed


async def add_garbage(client: Any, stream: str, n: int) -> None:
    """Entries naming no sample: each is dead-lettered alone (no batch to record it in)."""
    for i in range(n):
        await client.xadd(stream, {b"junk": f"garbage-{i}".encode()})


async def add_poison_in_batch(client: Any, stream: str, batch: str, index: int) -> None:
    """An entry whose header names a sample of ``batch`` but whose payload does not decode."""
    payload = b"\xc1not msgpack at all"
    header = msgpack.packb((batch, index, f"{batch}-{index}", len(payload)))
    await client.xadd(stream, {b"h": header, b"d": payload})


async def _xlen_at_least(client: Any, key: str, n: int) -> bool:
    return await client.xlen(key) >= n


# ---------------------------------------------------------------------------- lost replies


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


async def warm_up(url: str, ns: str) -> None:
    """One sample scored and flushed, so that the result script is in the server's cache."""
    await push_exact(url, ns, "warm", 1)
    admin = connect(url)
    try:
        await wait_until(lambda: _xlen_at_least(admin, Keys(ns).done("warm"), 1))
    finally:
        await admin.aclose()


async def _no_pending(client: Any, stream: str) -> bool:
    return (await client.xpending(stream, "scorers"))["pending"] == 0


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


# ---------------------------------------------------------------------------- pauses, restarts


@pytest.mark.parametrize("mode", ["ALL", "WRITE"])
async def test_a_client_pause_under_the_flushes_then_a_stop_returns_in_time_and_nothing_is_lost(
    namespace, mode
) -> None:
    with EmbeddedServer() as server:
        url = server.url
        await push_exact(url, namespace, "ps", 12)
        admin = connect(url)
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


async def test_a_server_restart_mid_run_loses_and_doubles_nothing(namespace) -> None:
    """SHUTDOWN SAVE, then the same server again on the same socket: the lanes reconnect to
    an empty script cache (NOSCRIPT), reads resume."""
    with EmbeddedServer() as server:
        url = server.url
        async with running_worker(url, namespace, Counting(first=0.01, later=0.0), concurrency=8, reclaim_idle_ms=500):
            async with RolloutProducer(url, ProducerConfig(namespace=namespace)) as producer:
                async with RewardAggregator(url, namespace=namespace) as agg:
                    await producer.open_batch("rs", 200, 8)
                    await producer.push_many([exact_traj("rs", i) for i in range(200)])
                    admin = connect(url)
                    await wait_until(lambda: _xlen_at_least(admin, Keys(namespace).done("rs"), 3))
                    with contextlib.suppress(Exception):
                        await admin.execute_command("SHUTDOWN", "SAVE")
                    await admin.aclose()
                    assert server._proc is not None
                    server._proc.wait(10)
                    server._proc = None
                    await asyncio.sleep(0.3)
                    server.start()
                    rewards = await agg.collect("rs", timeout_s=60)
            admin = connect(url)
            await wait_until(lambda: _no_pending(admin, Keys(namespace).stream()))
            await admin.aclose()
        await assert_each_once(url, namespace, "rs", rewards, 200)


# ---------------------------------------------------------------------------- auth, databases


@pytest.mark.parametrize("kind", ["connect", "plain redis-py"])
async def test_a_worker_given_a_client_on_database_5_uses_it_for_reads_and_flushes(own_url, namespace, kind) -> None:
    """The worker's client= is on database 5 (one from ``connect``, whose url says nothing of
    a database for the worker itself, or a plain redis-py client): the trainer on database 5
    must get every result."""
    url5 = f"{own_url}?db=5"
    if kind == "connect":
        client, worker_url = connect(url5), own_url
    else:
        client, worker_url = aredis.Redis(unix_socket_path=own_url[len("unix://") :], db=5), url5
    try:
        async with running_worker(worker_url, namespace, Counting(first=0.0), client=client):
            rewards = await collect(url5, namespace, f"c5{kind[0]}", 40, timeout_s=20)
        await assert_each_once(url5, namespace, f"c5{kind[0]}", rewards, 40)
    finally:
        await client.aclose()


# ---------------------------------------------------------------------------- hung reconnection


async def test_a_stop_while_a_lane_reconnects_to_a_hung_password_server_returns_and_leaks_nothing(
    namespace,
) -> None:
    """The lanes' connections are killed and the server hung (SIGSTOP) at once: the lanes'
    reconnection hangs in its AUTH/SELECT handshake. A stop must end run() in time, and
    leave no task or transport behind while the server stays hung."""
    with EmbeddedServer(extra_args=["--requirepass", "pw-h"]) as server:
        url = f"unix://:pw-h@{server.socket_path}?db=4"
        await push_exact(url, namespace, "hr", 4)
        admin = connect(url)
        scorer = Counting(first=5.0)
        w = Worker(url, scorer, stop_config(namespace, "w1"))
        stop = asyncio.Event()
        before = set(asyncio.all_tasks())
        run = asyncio.ensure_future(w.run(stop))
        assert server.pid
        try:
            await asyncio.wait_for(scorer.started.wait(), 5)
            await asyncio.sleep(0.2)
            await kill_lane_like(admin)
            os.kill(server.pid, signal.SIGSTOP)
            await asyncio.sleep(0.5)
            stop.set()
            t0 = time.monotonic()
            done, _ = await asyncio.wait([run], timeout=0.3 + 5.5)
            assert done, f"run() not back {time.monotonic() - t0:.1f} s after a stop"
            await asyncio.sleep(0.5)
            left = [
                t
                for t in asyncio.all_tasks() - before - {asyncio.current_task(), run}
                if not t.done() and "lane" in repr(t.get_coro())
            ]
            assert not left, f"lane tasks left running after run() returned: {left}"
        finally:
            os.kill(server.pid, signal.SIGCONT)
            run.cancel()
            await asyncio.wait([run], timeout=5)
            await w.aclose()
            await admin.aclose()
