"""Adversarial tests of the worker's own connections (wire/lane.py): its reads and its result
flushes go on lanes. A flush whose reply is lost after it ran, a script cache flushed under
it, its connections killed again and again, a database other than 0, an error reply: every
sample scored and counted once, every entry acked, nothing silently 0."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import pytest
from helpers import (
    Counting,
    CutProxy,
    assert_each_once,
    exact_traj,
    lane_of,
    push_exact,
    running_worker,
    score_batch,
)
from redis.exceptions import NoScriptError, ResponseError

from stream_reward import RewardAggregator
from stream_reward.wire.codec import encode_result
from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys
from stream_reward.wire.ledger import _WRITE_SCRIPT, LedgerItem, LedgerWriter
from stream_reward.wire.trajectory import ScoreResult

pytestmark = pytest.mark.anyio

N = 40


def trajs(batch: str, n: int = N) -> list:
    return [exact_traj(batch, i) for i in range(n)]


def item(batch: str, i: int, dead: bool = False) -> LedgerItem:
    result = encode_result(ScoreResult(f"{batch}-{i}", batch, i, float(i), "ok"))
    return LedgerItem("", batch, f"{batch}-{i}", result, b"dead" if dead else None, ack=False)


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


async def test_a_script_cache_flushed_under_the_worker_is_loaded_again(own_url, namespace) -> None:
    admin = connect(own_url)
    try:
        async with running_worker(own_url, namespace, Counting(first=0.0)):
            await assert_each_once(own_url, namespace, "a", await score_batch(own_url, namespace, trajs("a")), N)
            await admin.script_flush()
            await assert_each_once(own_url, namespace, "b", await score_batch(own_url, namespace, trajs("b")), N)
    finally:
        await admin.aclose()


async def test_the_worker_scores_each_sample_once_while_its_connections_are_killed_again_and_again(
    own_url, namespace
) -> None:
    admin = connect(own_url)
    kills = 0
    calm = asyncio.Event()

    async def storm() -> None:
        nonlocal kills
        while not calm.is_set():
            await asyncio.sleep(0.03)
            kills += await admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")

    try:
        async with running_worker(own_url, namespace, Counting(first=0.0, later=0.0), concurrency=8, read_count=4):
            killer = asyncio.ensure_future(storm())
            try:
                # A collect well under reclaim_idle_ms: a read whose reply a kill cut must not
                # leave its entries to the reclaimer.
                rewards = await score_batch(own_url, namespace, trajs("k", 300), timeout_s=20)
            finally:
                # Stopped by a flag, not a cancel: redis-py under Python 3.11 can swallow a
                # cancel that lands inside a command (asyncio.wait_for returns the command's
                # result instead), and the gather below would wait for ever.
                calm.set()
                await asyncio.wait_for(asyncio.gather(killer, return_exceptions=True), 10)
        assert kills > 10, f"only {kills} connections killed: nothing tested"
        await assert_each_once(own_url, namespace, "k", rewards, 300)
    finally:
        await admin.aclose()


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


async def test_a_worker_on_database_3_reads_and_writes_there(own_url, namespace) -> None:
    """A lane that forgot the database would read an empty stream and write the results
    where the trainer never looks: the collect would time out."""
    url = f"{own_url}?db=3"
    rewards = None
    async with running_worker(url, namespace, Counting(first=0.0)):
        rewards = await score_batch(url, namespace, trajs("d"), timeout_s=20)
    await assert_each_once(url, namespace, "d", rewards, N)
    db0 = connect(own_url)
    try:
        assert [k async for k in db0.scan_iter(match=f"*{namespace}*")] == []
    finally:
        await db0.aclose()


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
