"""The push script (wire/push.py): each sample queued exactly once. A call with something
already there takes the slow path and queues only the fresh samples; an index twice in
one call is refused once; a retried push is a no-op (large indices, default and custom
uids, odd uids); a conflict is refused whole; two producers racing on the same indices
queue each sample once; many batches over many chunks, with repeats and conflicts across
chunks, come out right.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from helpers import (
    Timed,
    exact_traj,
    push_fresh,
    queued,
    running,
    samples_of,
    stream_samples,
    traj,
    undelivered_samples,
)

from stream_reward import ProducerConfig, RolloutProducer, Trajectory
from stream_reward.errors import PushConflictError
from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys, key_slot

pytestmark = pytest.mark.anyio


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
        assert await stream_samples(redis_url, producer) == [(f"b/{i}", i) for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9)]


async def test_the_same_index_twice_in_one_call_is_refused_once(redis_url, namespace) -> None:
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
        await producer.open_batch("b", 10, 8)
        # Fresh in Redis, but index 3 twice in the call: the client sends it down the slow path.
        with pytest.raises(PushConflictError, match="index 3"):
            await producer.push_many([traj("b", 3), traj("b", 4), traj("b", 3, uid="custom-3")])
        assert await stream_samples(redis_url, producer) == [("b/3", 3), ("b/4", 4)]


async def test_a_retried_push_of_a_large_index_under_its_default_uid_is_a_no_op(redis_url, namespace) -> None:
    """The fast path writes claim fields formatted by Python (``i100000000000000``), the
    slow path looks them up formatted by Lua's tostring (``i1e+14``): a retry misses the claim."""
    index = 10**14
    t = traj("b", index)
    config = ProducerConfig(namespace=namespace)
    async with RolloutProducer(redis_url, config) as a, RolloutProducer(redis_url, config) as b:
        await a.open_batch("b", 4, 8)
        await a.push(t)
        await b.push(t)  # the same sample again (a retry by another producer): a no-op
        assert await queued(redis_url, a.keys) == [("b", f"b/{index}", index)]


async def test_a_retried_push_of_a_large_index_under_a_custom_uid_is_a_no_op(redis_url, namespace) -> None:
    index = 10**14
    t = traj("b", index, uid="custom")
    config = ProducerConfig(namespace=namespace)
    async with RolloutProducer(redis_url, config) as a, RolloutProducer(redis_url, config) as b:
        await a.open_batch("b", 4, 8)
        await a.push(t)
        await b.push(t)  # observed: PushConflictError "its uid was already pushed at another index"
        assert await queued(redis_url, a.keys) == [("b", "custom", index)]


async def test_odd_uids_are_queued_once_retries_are_no_ops_and_conflicts_refused(redis_url, namespace) -> None:
    """Spaces, unicode, a very long uid, a uid that is only digits, one with the claim separator."""
    uids = ["a b  c", "ünï cødé ✓", "x" * 20_000, "12", " ", "1 2", "b/1x", "b/01", "u12", "i3", "\r\n$3\r\n", "\x00z"]
    samples = [traj("b", i, uid=u) for i, u in enumerate(uids)]
    config = ProducerConfig(namespace=namespace)
    async with RolloutProducer(redis_url, config) as a, RolloutProducer(redis_url, config) as b:
        await a.open_batch("b", 20, 8)
        assert await a.push_many(samples) == len(samples)
        assert await b.push_many(samples) == len(samples)  # all duplicates: no-op
        # Each uid at another index, each index under another uid: every one refused.
        for i, u in enumerate(uids):
            with pytest.raises(PushConflictError, match="another index"):
                await push_fresh(redis_url, namespace, traj("b", 100 + i, uid=u))
            with pytest.raises(PushConflictError, match="another uid"):
                await push_fresh(redis_url, namespace, traj("b", i, uid=u + "'"))
        assert await queued(redis_url, a.keys) == [("b", u, i) for i, u in enumerate(uids)]


async def test_several_batches_over_many_chunks_with_repeats_and_conflicts_across_chunks(redis_url, namespace) -> None:
    """One push_many of 700 entries over 3 batches (several 256-entry script calls), then a
    second call mixing duplicates, conflicts in later chunks and fresh samples."""
    config = ProducerConfig(namespace=namespace, coalesce_max_entries=4096)
    async with RolloutProducer(redis_url, config) as a, RolloutProducer(redis_url, config) as b:
        for name in ("x", "y", "z"):
            await a.open_batch(name, 400, 8)
        first = [traj(name, i, uid=(f"{name}-{i}" if i % 3 else "")) for i in range(0, 400, 2) for name in "xyz"]
        first += [traj("x", i) for i in range(401, 501)]  # past the batch size: still queued once
        assert await a.push_many(first) == len(first)
        # duplicates (batches y and z, in another order and chunking), conflicts in later chunks, fresh
        second = [t for t in first[::-1] if t.batch_id != "x"]
        second.insert(150, traj("y", 4, uid="y-other"))  # index taken by "y-4"
        second.insert(300, traj("z", 399, uid="y-1"))  # fresh: uids are per batch
        second.append(traj("x", 7, uid="x-2"))  # uid elsewhere ("x-2" is at index 2), in the last chunk
        second += [traj(name, i) for i in range(1, 60, 2) for name in "xyz"]  # fresh
        with pytest.raises(PushConflictError):
            await b.push_many(second)
        want = [(t.batch_id, t.uid, t.index) for t in first]
        want += [("z", "y-1", 399)] + [(n, f"{n}/{i}", i) for i in range(1, 60, 2) for n in "xyz"]
        got = await queued(redis_url, a.keys)
        assert sorted(got) == sorted(want) and len(got) == len(set(got))


async def test_two_producers_racing_on_the_same_indices_queue_each_sample_once(redis_url, namespace) -> None:
    config = ProducerConfig(namespace=namespace, partitions=2)
    async with RolloutProducer(redis_url, config) as a, RolloutProducer(redis_url, config) as b:
        await a.open_batch("r", 600, 8)
        same = [traj("r", i, group=f"g{i // 4}") for i in range(300)]
        theirs = [traj("r", i, uid=f"b{i}", group=f"g{i // 4}") for i in range(300, 600)]
        mine = [traj("r", i, uid=f"a{i}", group=f"g{i // 4}") for i in range(300, 600)]

        async def one_by_one(p: RolloutProducer, samples: list[Trajectory]) -> list[object]:
            return await asyncio.gather(*(p.push(t) for t in samples), return_exceptions=True)

        ra, rb, rc, rd = await asyncio.gather(
            a.push_many(same), b.push_many(same), one_by_one(a, mine), one_by_one(b, theirs)
        )
        assert ra == rb == 300
        for x, y in zip(rc, rd):  # exactly one of each pair wins its index
            assert (x is None) != (y is None), (x, y)
            assert isinstance(x or y, PushConflictError)
        got = await queued(redis_url, a.keys)
        assert sorted(i for _, _, i in got) == list(range(600))
        assert len({u for _, u, _ in got}) == 600


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
