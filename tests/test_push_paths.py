"""The push's fast and slow paths (wire/push.py) and its hand-packed send
(wire/packed.py): each sample queued exactly once, whatever path it took,
whatever went wrong around it."""

from __future__ import annotations

import asyncio

import pytest
from helpers import samples_of

from stream_reward import ProducerConfig, RolloutProducer, Trajectory
from stream_reward.errors import PayloadTooLargeError, PushConflictError
from stream_reward.wire.connection import connect
from stream_reward.wire.packed import pack_command

pytestmark = pytest.mark.anyio


def traj(batch: str, i: int, *, uid: str = "", response: str = "r") -> Trajectory:
    return Trajectory(batch, i, "test/exact", response=f"{response}{i}", ground_truth="1", uid=uid)


async def queued(redis_url: str, producer: RolloutProducer) -> list[tuple[str, int]]:
    """(uid, index) of every sample in the producer's stream, in order."""
    client = connect(redis_url)
    try:
        entries = await client.xrange(producer.keys.stream(0))
    finally:
        await client.aclose()
    return [(t.uid, t.index) for _, fields in entries for t in samples_of(fields)]


def test_pack_command_is_resp() -> None:
    assert pack_command("SET", b"k\r\n", 12) == b"*3\r\n$3\r\nSET\r\n$3\r\nk\r\n\r\n$2\r\n12\r\n"
    assert pack_command("ECHO", "é") == b"*2\r\n$4\r\nECHO\r\n$2\r\n\xc3\xa9\r\n"


async def test_a_call_with_something_already_there_takes_the_slow_path_and_queues_only_the_fresh(
    redis_url, namespace
) -> None:
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
        await producer.open_batch("b", 20, 8)
        await producer.push_many([traj("b", i) for i in range(5)])  # all fresh: the fast path
        other = RolloutProducer(redis_url, ProducerConfig(namespace=namespace))
        async with other:
            # Two already there unchanged (duplicates), one index taken by another uid, five fresh.
            call = [traj("b", 0), traj("b", 1), traj("b", 2, uid="someone-else"), *(traj("b", i) for i in range(5, 10))]
            with pytest.raises(PushConflictError, match="index 2"):
                await other.push_many(call)
        assert await queued(redis_url, producer) == [(f"b/{i}", i) for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9)]


async def test_the_same_index_twice_in_one_call_is_refused_once(redis_url, namespace) -> None:
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
        await producer.open_batch("b", 10, 8)
        # Fresh in Redis, but index 3 twice in the call: the client sends it down the slow path.
        with pytest.raises(PushConflictError, match="index 3"):
            await producer.push_many([traj("b", 3), traj("b", 4), traj("b", 3, uid="custom-3")])
        assert await queued(redis_url, producer) == [("b/3", 3), ("b/4", 4)]


async def test_a_push_after_the_server_lost_its_scripts_loads_them_again(redis_url, namespace) -> None:
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
        await producer.open_batch("b", 300, 8)
        await producer.push_many([traj("b", i) for i in range(100)])
        client = connect(redis_url)
        try:
            await client.script_flush()
        finally:
            await client.aclose()
        await producer.push_many([traj("b", i) for i in range(100, 300)])  # two script calls, both NOSCRIPT
        assert await queued(redis_url, producer) == [(f"b/{i}", i) for i in range(300)]


async def test_a_push_many_with_a_bad_sample_queues_nothing_and_can_be_pushed_again(redis_url, namespace) -> None:
    batch = [traj("b", i) for i in range(300)]
    bad = list(batch)
    bad[250] = traj("b", 250, response="x" * 10_000)  # over the message size below
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace, max_message_bytes=4096)) as producer:
        await producer.open_batch("b", 300, 8)
        with pytest.raises(PayloadTooLargeError):
            await producer.push_many(bad)
        assert await queued(redis_url, producer) == []  # every sample is encoded before any is sent
        assert await producer.push_many(batch) == 300
        assert await queued(redis_url, producer) == [(f"b/{i}", i) for i in range(300)]


async def test_a_long_push_many_cancelled_midway_can_be_pushed_again_whole(redis_url, namespace) -> None:
    batch = [traj("b", i, response="x" * 2000) for i in range(2000)]
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
        await producer.open_batch("b", 2000, 8)
        task = asyncio.ensure_future(producer.push_many(batch))
        client = connect(redis_url)
        try:
            while not await client.exists(producer.keys.stream(0)) or await client.xlen(producer.keys.stream(0)) == 0:
                await asyncio.sleep(0)
        finally:
            await client.aclose()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.2)  # a call already handed to Redis still lands
        assert await producer.push_many(batch) == 2000
        assert await queued(redis_url, producer) == [(f"b/{i}", i) for i in range(2000)]
