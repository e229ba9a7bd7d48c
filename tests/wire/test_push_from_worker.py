"""The push script's stamps and slow path, and the requeue script's keys: a push with
duplicates cuts each fresh sample out of the right entry and stamps only the fresh ones;
stamps stay exact with producers pushing and workers handing back at once, and go on from
the newest entry when the counts are gone; the requeue script's keys share one hash slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import random

import pytest
from helpers import (
    Timed,
    exact_traj,
    samples_of,
    started,
    undelivered_samples,
)

from stream_reward import ProducerConfig, RolloutProducer, Trajectory
from stream_reward.config import ConsumerConfig
from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys, key_slot
from stream_reward.worker.consumer import Worker

pytestmark = pytest.mark.anyio


@contextlib.asynccontextmanager
async def running(url: str, ns: str, scorer, **cfg):
    w = Worker(url, scorer, ConsumerConfig(namespace=ns, block_ms=20, drain_timeout_s=0.3, **cfg))
    async with started(w):
        yield w


async def test_the_slow_path_cuts_each_fresh_sample_out_of_the_right_entry(redis_url, namespace) -> None:
    """A push with some duplicates takes the script's slow path, which cuts each fresh sample
    out of its prepared entry by offset: with entries split by count and by size, each
    queued sample must be exactly itself (helpers.samples_of checks header vs payload)."""
    from helpers import queued

    keys = Keys(namespace)
    sizes = [1, 90, 1, 200, 3, 70, 70, 70, 1, 1] * 4

    def big(i: int) -> Trajectory:
        return Trajectory("sp", i, "test/exact", response=chr(97 + i % 26) * (sizes[i] * 1024), ground_truth="1")

    n = len(sizes)
    cfg = ProducerConfig(namespace=namespace, max_message_bytes=1 << 20, samples_per_entry=3)
    async with RolloutProducer(redis_url, cfg) as p, RolloutProducer(redis_url, cfg) as first:
        await first.open_batch("sp", n, 8)
        await first.push_many(big(i) for i in range(0, n, 2))  # the even ones first
        await p.push_many(big(i) for i in range(n))  # then all, by another producer: evens are duplicates
        got = sorted(q[2] for q in await queued(redis_url, keys))
        assert got == list(range(n))
        client = connect(redis_url)
        try:
            for _, f in await client.xrange(keys.stream()):
                for t in samples_of(f):
                    assert t.response == big(t.index).response
        finally:
            await client.aclose()


async def test_slow_path_stamps_count_only_fresh_samples(redis_url, namespace) -> None:
    keys = Keys(namespace)
    client = connect(redis_url)
    try:
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
            await producer.open_batch("s", 32, 8)
            await producer.push_many(exact_traj("s", i) for i in range(16))
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as other:
            # 8 already queued (duplicates) and 8 fresh: the slow path
            await other.push_many(exact_traj("s", i) for i in range(8, 24))
            before = 0
            for _, fields in await client.xrange(keys.stream()):
                assert int(fields[b"n"]) == before
                before += len(samples_of(fields))
            assert before == 24
            assert int(await client.hget(keys.pushed(0), "samples")) == 24
            assert await other.backlog() == 24
    finally:
        await client.aclose()


async def test_stamps_stay_exact_with_producers_pushing_concurrently(redis_url, namespace) -> None:
    """Four producers push in small random pushes at once while backlog() is read: every
    entry's stamp is the samples before it in stream order, and backlog() never reads below
    the samples queued before it was called."""

    keys = Keys(namespace)
    client = connect(redis_url)
    rnd = random.Random(5)
    n = 400
    try:
        producers = [RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) for _ in range(4)]
        for p in producers:
            await p.__aenter__()
        try:
            await producers[0].open_batch("c", n, 8)
            chunks: list[list[int]] = [[] for _ in producers]
            i = 0
            while i < n:
                k = rnd.randint(1, 20)
                chunks[rnd.randrange(4)].append(list(range(i, min(n, i + k))))
                i += k
            low: list[tuple[int, int]] = []

            async def pusher(p, mine):
                for c in mine:
                    await p.push_many(exact_traj("c", j) for j in c)
                    await asyncio.sleep(0)

            async def reader():
                for _ in range(30):
                    before = await undelivered_samples(client, keys)
                    got = await producers[0].backlog()
                    low.append((before, got))
                    await asyncio.sleep(0.001)

            await asyncio.gather(*(pusher(p, m) for p, m in zip(producers, chunks)), reader())
            before = 0
            for _, fields in await client.xrange(keys.stream()):
                assert int(fields[b"n"]) == before
                before += len(samples_of(fields))
            assert before == n
            assert all(got >= b for b, got in low), [x for x in low if x[1] < x[0]]
            assert await producers[0].backlog() == n
        finally:
            for p in producers:
                await p.__aexit__(None, None, None)
    finally:
        await client.aclose()


async def test_stamps_stay_exact_when_the_counts_go_while_workers_hand_back_and_producers_push(
    redis_url, namespace
) -> None:
    """The pushed-counts hash is deleted again and again while two workers (concurrency 2)
    hand samples back and a producer pushes: every entry's stamp is still the samples queued
    before it in stream order, and backlog() never reads below the truth."""
    from helpers import samples_of

    from stream_reward.wire.push import FIELD_STAMP  # noqa: F401

    keys = Keys(namespace)
    client = connect(redis_url)
    n = 160
    try:
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
            await producer.open_batch("k", n, 8)
            await producer.push_many(exact_traj("k", i) for i in range(64))
            await client.delete(keys.pushed(0))
            cfg = dict(concurrency=2, trim_interval_s=3600)
            async with (
                running(redis_url, namespace, Timed(0.05), consumer="a", **cfg) as a,
                running(redis_url, namespace, Timed(0.05), consumer="b", **cfg) as b,
            ):

                async def deleter():
                    for _ in range(40):
                        await client.delete(keys.pushed(0))
                        await asyncio.sleep(0.005)

                async def pusher():
                    for lo in range(64, n, 8):
                        await producer.push_many(exact_traj("k", i) for i in range(lo, lo + 8))
                        await asyncio.sleep(0.01)

                await asyncio.gather(deleter(), pusher())
            # Read once both stopped: a stop hands back the samples it started and cancelled.
            spilled = a.stats.spilled + b.stats.spilled
            assert spilled > 0
            # With workers reading meanwhile a reading may fall legitimately between the two
            # looks: only checked once they stopped, with the counts gone and back.
            low: list[tuple[int, int]] = []
            for _ in range(2):
                truth = await undelivered_samples(client, keys)
                low.append((truth, await producer.backlog()))
                await client.delete(keys.pushed(0))
            entries = await client.xrange(keys.stream())
            # A worker trims at its start: on a slow machine the first entry may already be
            # acked (its samples scored or handed back) and gone. The first left starts the
            # count; the total below still checks that stamp.
            before = int(entries[0][1][b"n"]) if entries else 0
            for eid, fields in entries:
                assert int(fields[b"n"]) == before, (eid, before)
                before += len(samples_of(fields))
            assert before == n + spilled
            assert all(got >= b for b, got in low), [x for x in low if x[1] < x[0]]
    finally:
        await client.aclose()


@pytest.mark.parametrize("per_entry", [1, 16, 1024])
async def test_stamps_go_on_from_the_newest_entry_of_any_size_when_the_counts_are_gone(
    redis_url, namespace, per_entry
) -> None:
    """The counts go after a push of entries of ``per_entry`` samples (up to 1024: the
    script counts the newest entry's headers by unpacking them all onto Lua's stack); the
    next push is stamped with every sample before it."""
    from helpers import samples_of

    keys = Keys(namespace)
    client = connect(redis_url)
    n = 2 * per_entry  # the newest entry full
    try:
        async with RolloutProducer(
            redis_url, ProducerConfig(namespace=namespace, samples_per_entry=per_entry)
        ) as producer:
            await producer.open_batch("e", n + 5, 8)
            await producer.push_many(exact_traj("e", i) for i in range(n))
            await client.delete(keys.pushed(0))
            await producer.push_many(exact_traj("e", i) for i in range(n, n + 5))
            before = 0
            for _, fields in await client.xrange(keys.stream()):
                assert int(fields[b"n"]) == before
                before += len(samples_of(fields))
            assert before == n + 5
            assert await producer.backlog() == n + 5
    finally:
        await client.aclose()


@pytest.mark.parametrize("partitions", [1, 2, 3, 8])
def test_requeue_script_keys_share_a_slot(partitions) -> None:
    keys = Keys("nsx", partitions)
    for p in range(partitions):
        slots = {key_slot(keys.stream(p)), key_slot(keys.pushed(p)), key_slot(keys.dead_letters(p))}
        assert len(slots) == 1, (p, slots)
