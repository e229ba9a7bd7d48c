"""The producer (trainer/producer.py): ``push``, ``push_many``, ``score`` and ``aclose``.

It promises: a push returns once Redis holds the sample, or raises; a sample that
contradicts one already in its batch (pushed by any producer, its uid the default uid of
another index included) is refused with PushConflictError and nothing of it is queued; a
call with a bad sample queues nothing and may be pushed again; a push cancelled midway
leaves its samples pushable, each queued at most once; concurrent pushes share round
trips; it recreates its streams and groups after Redis lost its state; it remembers only
the most recent batches, yet pushes to more at once are safe; closing it leaves no
connection open. The backlog bound is in test_backlog.py, one ``score()`` call's life in
test_samples.py, the flush in test_flush.py.
"""

from __future__ import annotations

import asyncio
import gc
import warnings

import pytest
from helpers import queued
from trainer_support import graded, stream_samples, traj

from stream_reward import ProducerConfig, RewardAggregator, RolloutProducer, Trajectory
from stream_reward.errors import BrokerError, PayloadTooLargeError, PushConflictError
from stream_reward.ops.embedded import EmbeddedServer
from stream_reward.trainer.batches import _RECENT_BATCHES
from stream_reward.wire.connection import connect

pytestmark = pytest.mark.anyio


SCORER = "python:tests/data/scorers.py:exact"


async def push_fresh(redis_url: str, namespace: str, *samples: Trajectory) -> None:
    """Push from a new producer (a producer refuses a uid it pushed itself before it asks Redis)."""
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as p:
        await p.push_many(samples)


async def named_connections(admin, name: str) -> int:
    return sum(1 for c in await admin.client_list() if c.get("name") == name)


async def settle_named(admin, name: str, want: int, within_s: float = 3.0) -> int:
    """The count of connections named ``name`` once it reaches ``want`` (or the last seen)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        n = await named_connections(admin, name)
        if n == want or loop.time() > deadline:
            return n
        await asyncio.sleep(0.05)


def no_unclosed_transports() -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
        gc.collect()
    return [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]


# Conflicts and odd uids


async def test_a_conflicting_push_is_refused_at_push_across_producers(redis_url, namespace, spawn_workers):
    from stream_reward.errors import PushConflictError

    config = ProducerConfig(namespace=namespace)
    async with RolloutProducer(redis_url, config) as a, RolloutProducer(redis_url, config) as b:
        await a.open_batch("c", 3, 4)
        await a.push(Trajectory("c", 0, "test/exact", response="1", ground_truth="1", uid="x"))
        # Another producer: the same index under another uid.
        with pytest.raises(PushConflictError, match="index was already pushed under another uid"):
            await b.push(Trajectory("c", 0, "test/exact", response="0", ground_truth="1", uid="y"))
        # The same uid at another index.
        with pytest.raises(PushConflictError, match="uid was already pushed at another index"):
            await b.push(Trajectory("c", 1, "test/exact", response="1", ground_truth="1", uid="x"))
        # The same uid and index, other content.
        with pytest.raises(PushConflictError, match="other content"):
            await b.push(Trajectory("c", 0, "test/exact", response="wrong", ground_truth="1", uid="x"))
        # The same sample again, unchanged (a retry): accepted, not queued twice.
        await b.push(Trajectory("c", 0, "test/exact", response="1", ground_truth="1", uid="x"))
        # Coalesced with a conflict, a good push still lands; the refused one does not.
        ok = Trajectory("c", 1, "test/exact", response="1", ground_truth="1", uid="z1")
        bad = Trajectory("c", 0, "test/exact", response="1", ground_truth="1", uid="z0")
        got = await asyncio.gather(b.push(ok), b.push(bad), return_exceptions=True)
        assert got[0] is None and isinstance(got[1], PushConflictError)
        await b.push(Trajectory("c", 2, "test/exact", response="1", ground_truth="1", uid="z2"))
        client = connect(redis_url)
        try:
            assert await client.xlen(a.keys.stream()) == 3  # x, z1, z2: nothing refused was queued
        finally:
            await client.aclose()
    spawn_workers(1, "--scorer", SCORER)
    async with RewardAggregator(redis_url, namespace=namespace) as agg:
        rewards = await agg.collect("c", timeout_s=30)
    assert rewards.status == ["ok"] * 3 and [r.uid for r in rewards.results] == ["x", "z1", "z2"]


async def test_conflicts_between_default_and_custom_uids(redis_url, namespace):
    from stream_reward.errors import PushConflictError

    config = ProducerConfig(namespace=namespace)
    async with RolloutProducer(redis_url, config) as a, RolloutProducer(redis_url, config) as b:
        await a.open_batch("d", 4, 4)
        await a.push(graded("d", 0, True))  # default uid "d/0"
        with pytest.raises(PushConflictError, match="default uid of index 0"):
            await b.push(Trajectory("d", 1, "test/exact", response="1", ground_truth="1", uid="d/0"))
        with pytest.raises(PushConflictError, match="another uid"):
            await b.push(Trajectory("d", 0, "test/exact", response="1", ground_truth="1", uid="custom"))
        with pytest.raises(PushConflictError, match="other content"):
            await b.push(Trajectory("d", 0, "test/exact", response="changed", ground_truth="1000"))
        await b.push(graded("d", 0, True))  # unchanged: a no-op
        await b.push(Trajectory("d", 1, "test/exact", response="1", ground_truth="1", uid="c1"))
        with pytest.raises(PushConflictError, match="another uid"):
            await a.push(graded("d", 1, True))  # default uid at an index a custom uid holds
        with pytest.raises(PushConflictError, match="at another index"):
            await a.push(Trajectory("d", 2, "test/exact", response="1", ground_truth="1", uid="c1"))
        client = connect(redis_url)
        try:
            assert await client.xlen(a.keys.stream()) == 2
        finally:
            await client.aclose()


async def test_a_custom_uid_with_a_unicode_digit_is_not_a_crash(redis_url, namespace) -> None:
    """``"b/²".isdigit()`` is True but ``int("²")`` raises: _default_index in samples.py."""
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as p:
        await p.open_batch("b", 4, 8)
        await p.push(traj("b", 1, uid="b/²"))  # observed: raw ValueError
        assert await queued(redis_url, p.keys) == [("b", "b/²", 1)]


async def test_empty_fields_and_empty_calls(redis_url, namespace) -> None:
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as p:
        await p.open_batch("b", 4, 8)
        assert await p.push_many([]) == 0
        t = Trajectory("b", 0, "", response="", ground_truth=None)
        await p.push(t)
        await push_fresh(redis_url, namespace, t)
        with pytest.raises(PushConflictError, match="other content"):
            await push_fresh(redis_url, namespace, Trajectory("b", 0, "", response="", ground_truth=""))
        assert await queued(redis_url, p.keys) == [("b", "b/0", 0)]


async def test_partitions_two_odd_uids_retries_and_mixed_batches_score_each_sample_once(
    redis_url, namespace, spawn_workers
) -> None:
    spawn_workers(1, "--scorer", "python:tests/data/scorers.py:exact", "--partitions", "2")
    config = ProducerConfig(namespace=namespace, partitions=2)
    n = 150

    def sample(b: str, i: int) -> Trajectory:
        uid = [f"{b}/{i}", f"ü {i} ✓", f"{b}/{i}x", "y" * 300 + str(i)][i % 4]
        gt = str(i)
        return Trajectory(
            b,
            i,
            "test/exact",
            response=gt if i % 3 else gt + "!",
            ground_truth=gt,
            uid=uid,
            group=f"g{i // 5}" if i % 2 else None,
        )

    samples = [sample(b, i) for i in range(n) for b in ("p", "q")]
    async with (
        RolloutProducer(redis_url, config) as a,
        RolloutProducer(redis_url, config) as b,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await a.open_batch("p", n, 8)
        await a.open_batch("q", n, 8)
        async with RolloutProducer(redis_url, config) as c:
            await asyncio.gather(
                a.push_many(samples), b.push_many(samples[::-1]), *(c.score(t, timeout_s=60) for t in samples[:40])
            )
        rp, rq = await asyncio.gather(agg.collect("p", timeout_s=60), agg.collect("q", timeout_s=60))
    for rewards in (rp, rq):
        assert rewards.status == ["ok"] * n
        assert rewards.scores == [1.0 if i % 3 else 0.0 for i in range(n)]
        assert [r.uid for r in rewards.results] == [sample(rewards.batch_id, i).uid for i in range(n)]
    # Queued once each: counted by the push script's count of samples queued (less the
    # copies a worker handed back), since the worker trims the entries it acked (every
    # 2 s), and the stream may hold fewer by now.
    client = connect(redis_url)
    try:
        added = []
        for p in range(a.keys.partitions):
            samples, requeued = await client.hmget(a.keys.pushed(p), "samples", "requeued")
            added.append(int(samples or 0) - int(requeued or 0))
    finally:
        await client.aclose()
    assert sum(added) == 2 * n, added
    got = await queued(redis_url, a.keys)
    assert len(set(got)) == len(got)


# Bad samples and cancelled pushes


async def test_a_push_many_with_a_bad_sample_queues_nothing_and_can_be_pushed_again(redis_url, namespace) -> None:
    batch = [traj("b", i) for i in range(300)]
    bad = list(batch)
    bad[250] = traj("b", 250, response="x" * 10_000)  # over the message size below
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace, max_message_bytes=4096)) as producer:
        await producer.open_batch("b", 300, 8)
        with pytest.raises(PayloadTooLargeError):
            await producer.push_many(bad)
        assert await stream_samples(redis_url, producer) == []  # every sample is encoded before any is sent
        assert await producer.push_many(batch) == 300
        assert await stream_samples(redis_url, producer) == [(f"b/{i}", i) for i in range(300)]


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
        assert await stream_samples(redis_url, producer) == [(f"b/{i}", i) for i in range(2000)]


async def test_a_cancelled_push_leaves_the_sample_pushable_and_queued_at_most_once(redis_url, namespace) -> None:
    config = ProducerConfig(namespace=namespace)
    async with RolloutProducer(redis_url, config) as p:
        await p.open_batch("c", 400, 8)
        for i in range(0, 400, 4):
            tasks = [asyncio.ensure_future(p.push(traj("c", j))) for j in range(i, i + 4)]
            for _ in range(i % 7):
                await asyncio.sleep(0)
            for t in tasks[::2]:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await p.push_many([traj("c", i) for i in range(0, 400, 2)])  # the cancelled ones, pushed again
        got = await queued(redis_url, p.keys)
        assert sorted(i for _, _, i in got) == list(range(400))


# Round trips, lost state, many batches


def test_coalesced_pushes_share_round_trips(redis_url, namespace):
    async def run() -> int:
        client = connect(redis_url)
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace, max_backlog=0)) as producer:
            await producer.open_batch("co", 300, 4)  # a script call of its own: counted from here on
            before = int((await client.info("commandstats")).get("cmdstat_evalsha", {}).get("calls", 0))
            await asyncio.gather(*(producer.push(graded("co", i, True)) for i in range(300)))
            assert len(await queued(redis_url, producer.keys)) == 300
        after = int((await client.info("commandstats")).get("cmdstat_evalsha", {}).get("calls", 0))
        await client.aclose()
        return after - before

    assert asyncio.run(run()) <= 3  # 300 concurrent push() calls: one flush (plus a chunk or two), not 300


async def test_producer_recreates_its_stream_and_group_after_redis_lost_its_state(namespace):
    """A restart without persistence drops the stream and group; the producer's flag that
    they exist is stale. Its next push must not fail forever ("unreachable or refused")."""
    from stream_reward.ops.embedded import EmbeddedServer

    with EmbeddedServer() as server:
        config = ProducerConfig(namespace=namespace, backlog_poll_s=0.0)
        async with RolloutProducer(server.url, config) as producer:
            await producer.open_batch("lost", 4, 4)
            await producer.push(graded("lost", 0, True))
            server.kill()
            with pytest.raises(BrokerError):
                await producer.push(graded("lost", 1, True))
            server.start()
            await producer.push(graded("lost", 1, True))
            client = connect(server.url)
            try:
                (group,) = await client.xinfo_groups(producer.keys.stream())
                assert group["name"] == b"scorers" and await client.xlen(producer.keys.stream()) == 1
            finally:
                await client.aclose()


@pytest.mark.anyio
async def test_concurrent_pushes_to_more_batches_than_remembered(redis_url: str, namespace: str) -> None:
    n = _RECENT_BATCHES * 3
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
        await asyncio.gather(*(producer.open_batch(f"b{i}", 1, 8) for i in range(n)))
        pushed = await asyncio.gather(
            *(producer.push_many([Trajectory(f"b{i}", 0, "openai/gsm8k", "#### 1", "1")]) for i in range(n))
        )
    assert pushed == [1] * n


# Closing


async def test_closing_a_producer_with_a_backlog_reading_in_flight_leaves_no_connection_open(namespace) -> None:
    """A push starts a backlog reading in the background and returns; the producer closes
    at once. The reading must end with it: left running it reached for a client after the close
    (a new one, or redis-py's retry reconnecting the closed one), a connection nobody closes."""
    with EmbeddedServer() as server:
        admin = connect(server.url)
        try:
            (mine,) = [c["id"] for c in await admin.client_list()]
            for k in range(10):
                producer = RolloutProducer(server.url, ProducerConfig(namespace=namespace, backlog_poll_s=0.001))
                await producer.open_batch(f"b{k}", 1, 4)
                await producer.push(Trajectory(f"b{k}", 0, "test", response="a"))
                # As a push that finds the last reading stale starts one, and returns.
                reading = producer._start_backlog_reading()
                for _ in range(k % 3):
                    await asyncio.sleep(0)
                await producer.aclose()
                assert reading is not None and reading.done(), "a backlog reading outlived its producer"
            await asyncio.sleep(0.3)
            assert [c["id"] for c in await admin.client_list()] == [mine]
        finally:
            await admin.aclose()


async def test_closing_the_producer_leaves_no_connection_of_its_lanes(redis_url, namespace, spawn_workers) -> None:
    spawn_workers(1)
    name = f"bye-{namespace}"
    admin = connect(redis_url)
    try:
        async with RolloutProducer(f"{redis_url}?client_name={name}", ProducerConfig(namespace=namespace)) as p:
            await p.open_batch("z", 4, 4)
            results = await asyncio.gather(
                *(
                    p.score(Trajectory("z", i, "openai/gsm8k", response="#### 2", ground_truth="2"), timeout_s=30)
                    for i in range(4)
                )
            )
            assert [r.score for r in results] == [1.0] * 4
            assert p._lane is not None and p._lane._protocol is not None
            (reader,) = p._listener._readers.values()
            assert reader.lane is not None and reader.lane._protocol is not None
        assert await settle_named(admin, name, 0) == 0
    finally:
        await admin.aclose()
    assert no_unclosed_transports() == []
