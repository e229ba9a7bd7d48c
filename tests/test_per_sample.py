"""The per-sample path (issue 16): score() / result() from one shared listener, and the push path under it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import queued

from stream_reward import ProducerConfig, RewardAggregator, RolloutProducer, SyncRolloutProducer, Trajectory
from stream_reward.errors import ResultTimeoutError
from stream_reward.wire.connection import connect

pytestmark = pytest.mark.anyio

SCORER = "python:tests/data/scorers.py:exact"


def traj(batch: str, i: int, right: bool) -> Trajectory:
    gt = str(1000 + i)
    return Trajectory(batch, i, "test/exact", response=gt if right else gt + "0", ground_truth=gt, group=f"g{i // 4}")


async def xread_calls(redis_url: str) -> int:
    client = connect(redis_url)
    try:
        stats = await client.info("commandstats")
    finally:
        await client.aclose()
    return int(stats.get("cmdstat_xread", {}).get("calls", 0))


async def test_many_concurrent_score_calls_each_get_their_own_result_without_an_xread_each(
    own_url, namespace, spawn_workers
):
    redis_url = own_url
    spawn_workers(2, "--scorer", SCORER, "--partitions", "2", url=redis_url)
    n_batches, per_batch = 3, 200
    before = await xread_calls(redis_url)
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace, partitions=2)) as producer:
        for b in range(n_batches):
            await producer.open_batch(f"s{b}", per_batch, 8)
        samples = [traj(f"s{b}", i, (i * 7 + b) % 3 != 0) for b in range(n_batches) for i in range(per_batch)]
        results = await asyncio.wait_for(asyncio.gather(*(producer.score(t, timeout_s=60) for t in samples)), 90)
    for t, r in zip(samples, results):
        assert (r.uid, r.batch_id, r.index, r.status) == (t.uid, t.batch_id, t.index, "ok")
        assert r.score == (1.0 if t.response == t.ground_truth else 0.0)
    reads = await xread_calls(redis_url) - before
    # One XREAD per page of results (whatever worker flushes landed meanwhile), never one
    # per result. How many results a flush holds is the workers' timing: on a loaded
    # machine they flush nearly one by one (345 reads for 600 results once), so the bound
    # is on flushes, below.
    client = connect(redis_url)
    try:
        keys = producer.keys
        flushes = sum([await client.xlen(keys.done(f"s{b}", p)) for b in range(n_batches) for p in range(2)])
    finally:
        await client.aclose()
    # Each read returns at least one flush, except a few that only end a block (a wake, a timeout).
    assert reads <= flushes + 2 * n_batches * 2 + 5, (reads, flushes)


async def test_score_times_out_with_a_clear_error_and_the_sample_stays_queued(redis_url, namespace):
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
        await producer.open_batch("nobody", 1, 4)
        with pytest.raises(ResultTimeoutError, match="no result for uid"):
            await producer.score(traj("nobody", 0, True), timeout_s=0.2)
        client = connect(redis_url)
        try:
            assert await client.xlen(producer.keys.stream()) == 1
        finally:
            await client.aclose()


async def test_timeouts_fire_on_time_never_early(redis_url, namespace):
    from stream_reward.trainer.listener import TIMEOUT_TICK_S

    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
        await producer.open_batch("nobody", 3, 4)  # no worker: nothing is scored
        loop = asyncio.get_running_loop()

        async def timed(i: int, timeout_s: float) -> float:
            started = loop.time()
            with pytest.raises(ResultTimeoutError):
                await producer.score(traj("nobody", i, True), timeout_s=timeout_s)
            return loop.time() - started

        took = await asyncio.gather(timed(0, 0.3), timed(1, 0.45), timed(2, 0.7))
    for timeout_s, t in zip((0.3, 0.45, 0.7), took):
        assert timeout_s <= t <= timeout_s + TIMEOUT_TICK_S + 0.2, (timeout_s, t)


async def test_resolved_samples_leave_no_timeout_behind(redis_url, namespace, spawn_workers):
    spawn_workers(1, "--scorer", SCORER)
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
        await producer.open_batch("t", 200, 4)
        results = await asyncio.gather(*(producer.score(traj("t", i, True), timeout_s=600) for i in range(200)))
        assert all(r.status == "ok" for r in results)
        listener = producer._listener
        assert listener is not None
        # Each of them was due to time out in 10 minutes: none is still held for it.
        assert sum(len(due) for due in listener._due.values()) == 0


async def test_result_of_a_sample_pushed_by_another_process(redis_url, namespace, spawn_workers):
    spawn_workers(1, "--scorer", SCORER)
    code = textwrap.dedent(
        f"""
        import sys
        from stream_reward import ProducerConfig, SyncRolloutProducer, Trajectory
        with SyncRolloutProducer({redis_url!r}, ProducerConfig(namespace={namespace!r})) as p:
            p.open_batch("other", 3, 4)
            p.push_many(Trajectory("other", i, "test/exact", response="7", ground_truth=str(6 + i), uid=f"u{{i}}")
                        for i in range(3))
        """
    )
    async with RewardAggregator(redis_url, namespace=namespace) as agg:
        # One waiter is registered before the batch even exists (the other process opens it).
        proc = subprocess.Popen([sys.executable, "-c", code])
        try:
            for _ in range(100):
                try:
                    await agg.meta("other")
                    break
                except Exception:
                    await asyncio.sleep(0.05)
            early = asyncio.ensure_future(agg.result("other", "u1", timeout_s=30))
            assert proc.wait(timeout=60) == 0
            r1 = await early
            # Asked after it landed: served from what the listener read (or reads again).
            r0 = await agg.result("other", "u0", timeout_s=30)
            r2 = await agg.result("other", "u2", timeout_s=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert (r0.index, r0.score, r1.index, r1.score, r2.score) == (0, 0.0, 1, 1.0, 0.0)


async def test_hundreds_of_concurrent_batches(redis_url, namespace, spawn_workers):
    spawn_workers(1, "--scorer", SCORER, "--partitions", "2")
    # Two partitions of 300 batches: more done streams than the producer keeps names of
    # (it drops them all at 256), so the names are dropped with scores in flight.
    n_batches = 300
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace, partitions=2)) as producer:
        for b in range(n_batches):
            await producer.open_batch(f"m{b}", 2, 4)
        # One push of more batches than the producer remembers used to raise KeyError.
        assert await producer.push_many(traj(f"m{b}", 0, True) for b in range(n_batches)) == n_batches
        # And one in-flight score() per batch, all at once.
        # Each batch's second sample in a GRPO group of its own: they spread over both partitions.
        second = [
            Trajectory(f"m{b}", 1, "test/exact", "1001" if b % 2 == 0 else "0", "1001", group=f"m{b}")
            for b in range(n_batches)
        ]
        assert {producer.keys.partition_of(t.uid, t.group) for t in second} == {0, 1}
        results = await asyncio.wait_for(asyncio.gather(*(producer.score(t, timeout_s=60) for t in second)), 90)
    assert [(r.batch_id, r.score) for r in results] == [(f"m{b}", 1.0 if b % 2 == 0 else 0.0) for b in range(n_batches)]


def test_sync_producer_score_from_many_threads(redis_url, namespace, spawn_workers):
    from concurrent.futures import ThreadPoolExecutor

    spawn_workers(1, "--scorer", SCORER)
    with SyncRolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
        producer.open_batch("th", 40, 4)
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda i: producer.score(traj("th", i, i % 2 == 0), timeout_s=60), range(40)))
        closing = time.monotonic()
    # Closing ends the listener's blocking read at once; it used to wait out its 30 s idle drop.
    assert time.monotonic() - closing < 5
    assert [r.score for r in results] == [1.0 if i % 2 == 0 else 0.0 for i in range(40)]


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


async def test_backpressure_holds_when_redis_reports_no_lag(redis_url, namespace):
    """After an AOF restart (or deletions mid-stream) XINFO GROUPS reports lag nil."""
    from stream_reward.errors import BackpressureError

    config = ProducerConfig(
        namespace=namespace, max_backlog=10, on_backlog="raise", backlog_poll_s=0.0, samples_per_entry=1
    )  # an entry per sample: the test deletes one mid-stream
    async with RolloutProducer(redis_url, config) as producer:
        await producer.open_batch("lag", 40, 4)
        await producer.push_many(traj("lag", i, True) for i in range(12))
        client = connect(redis_url)
        try:
            stream = producer.keys.stream()
            ids = [entry_id for entry_id, _ in await client.xrange(stream, count=3)]
            await client.xdel(stream, ids[1])  # a tombstone, then a group position Redis cannot count from
            await client.execute_command("XGROUP", "SETID", stream, "scorers", ids[0])
            (group,) = await client.xinfo_groups(stream)
            assert group["lag"] is None  # the condition under test
        finally:
            await client.aclose()
        with pytest.raises(BackpressureError, match="exceeds max_backlog 10"):
            await producer.push(traj("lag", 20, True))


def test_coalesced_pushes_share_round_trips(redis_url, namespace):
    async def run() -> int:
        client = connect(redis_url)
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace, max_backlog=0)) as producer:
            await producer.open_batch("co", 300, 4)  # a script call of its own: counted from here on
            before = int((await client.info("commandstats")).get("cmdstat_evalsha", {}).get("calls", 0))
            await asyncio.gather(*(producer.push(traj("co", i, True)) for i in range(300)))
            assert len(await queued(redis_url, producer.keys)) == 300
        after = int((await client.info("commandstats")).get("cmdstat_evalsha", {}).get("calls", 0))
        await client.aclose()
        return after - before

    assert asyncio.run(run()) <= 3  # 300 concurrent push() calls: one flush (plus a chunk or two), not 300


async def test_producer_recreates_its_stream_and_group_after_redis_lost_its_state(namespace):
    """A restart without persistence drops the stream and group; the producer's flag that
    they exist is stale. Its next push must not fail forever ("unreachable or refused")."""
    from stream_reward.errors import BrokerError
    from stream_reward.ops.embedded import EmbeddedServer

    with EmbeddedServer() as server:
        config = ProducerConfig(namespace=namespace, backlog_poll_s=0.0)
        async with RolloutProducer(server.url, config) as producer:
            await producer.open_batch("lost", 4, 4)
            await producer.push(traj("lost", 0, True))
            server.kill()
            with pytest.raises(BrokerError):
                await producer.push(traj("lost", 1, True))
            server.start()
            await producer.push(traj("lost", 1, True))
            client = connect(server.url)
            try:
                (group,) = await client.xinfo_groups(producer.keys.stream())
                assert group["name"] == b"scorers" and await client.xlen(producer.keys.stream()) == 1
            finally:
                await client.aclose()


async def test_result_of_a_sample_already_read_for_score_by_the_shared_listener(redis_url, namespace, spawn_workers):
    """score() does not keep results it was not asked for; a later result() of one of
    them, on the same process-wide listener, reads the stream again instead of hanging."""
    spawn_workers(1, "--scorer", SCORER)
    config = ProducerConfig(namespace=namespace)
    async with RolloutProducer(redis_url, config) as producer, RewardAggregator(redis_url, namespace=namespace) as agg:
        await producer.open_batch("shared", 3, 4)
        await producer.push(traj("shared", 0, True))
        assert (await producer.score(traj("shared", 1, False), timeout_s=30)).score == 0.0
        assert (await producer.score(traj("shared", 2, True), timeout_s=30)).score == 1.0
        assert producer._listener is agg._listener or agg._listener is None
        r0 = await agg.result("shared", "shared/0", timeout_s=5)
        assert agg._listener is producer._listener  # one listener per process, loop, server and namespace
    assert (r0.index, r0.score) == (0, 1.0)


async def test_conflicts_between_default_and_custom_uids(redis_url, namespace):
    from stream_reward.errors import PushConflictError

    config = ProducerConfig(namespace=namespace)
    async with RolloutProducer(redis_url, config) as a, RolloutProducer(redis_url, config) as b:
        await a.open_batch("d", 4, 4)
        await a.push(traj("d", 0, True))  # default uid "d/0"
        with pytest.raises(PushConflictError, match="default uid of index 0"):
            await b.push(Trajectory("d", 1, "test/exact", response="1", ground_truth="1", uid="d/0"))
        with pytest.raises(PushConflictError, match="another uid"):
            await b.push(Trajectory("d", 0, "test/exact", response="1", ground_truth="1", uid="custom"))
        with pytest.raises(PushConflictError, match="other content"):
            await b.push(Trajectory("d", 0, "test/exact", response="changed", ground_truth="1000"))
        await b.push(traj("d", 0, True))  # unchanged: a no-op
        await b.push(Trajectory("d", 1, "test/exact", response="1", ground_truth="1", uid="c1"))
        with pytest.raises(PushConflictError, match="another uid"):
            await a.push(traj("d", 1, True))  # default uid at an index a custom uid holds
        with pytest.raises(PushConflictError, match="at another index"):
            await a.push(Trajectory("d", 2, "test/exact", response="1", ground_truth="1", uid="c1"))
        client = connect(redis_url)
        try:
            assert await client.xlen(a.keys.stream()) == 2
        finally:
            await client.aclose()


async def test_a_stale_backlog_estimate_with_room_lets_pushes_go_and_catches_up_in_the_background(redis_url, namespace):
    """The backlog estimate (last reading + own pushes) only errs high for one producer;
    another producer's pushes it learns from the reading it starts in the background."""
    from stream_reward.errors import BackpressureError

    config = ProducerConfig(namespace=namespace, max_backlog=10, on_backlog="raise", backlog_poll_s=0.05)
    async with (
        RolloutProducer(redis_url, config) as mine,
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as other,
    ):
        await other.open_batch("o", 20, 4)
        await other.push_many(traj("o", i, True) for i in range(20))  # the backlog is now 20, over our limit
        await mine.open_batch("m", 5, 4)
        await mine.push(traj("m", 0, True))  # our estimate says 0: it goes, and a reading starts
        await asyncio.sleep(0.1)
        # The reading counts samples exactly (each entry is stamped with the samples queued
        # before it): the other's 20 and our 1.
        with pytest.raises(BackpressureError, match="backlog 21 \\+ 1 exceeds max_backlog 10"):
            await mine.push(traj("m", 1, True))


async def test_pushes_waiting_for_room_share_one_backlog_reading(redis_url, namespace):
    from stream_reward.errors import BackpressureError

    config = ProducerConfig(namespace=namespace, max_backlog=10, on_backlog="raise", backlog_poll_s=0.05)
    async with RolloutProducer(redis_url, config) as mine:
        await mine.open_batch("w", 60, 4)
        await mine.push_many(traj("w", i, True) for i in range(10))  # our estimate is at the limit
        await asyncio.sleep(0.06)  # and stale
        client = connect(redis_url)
        try:
            await client.config_resetstat()
            replies = await asyncio.gather(
                *(mine.push(traj("w", i, True)) for i in range(10, 60)), return_exceptions=True
            )
            stats = await client.info("commandstats")
        finally:
            await client.aclose()
    assert all(isinstance(r, BackpressureError) for r in replies)
    assert stats["cmdstat_xinfo|groups"]["calls"] <= 2  # one reading for all 50, not one each


async def test_a_followed_done_stream_is_dropped_only_linger_after_its_last_waiter_left(
    redis_url, namespace, spawn_workers
):
    """The listener stops following a batch's done stream nobody waits on, ``linger_s``
    after the last waiter left: not while one waits (however long), not at once after."""
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await producer.open_batch("lin", 2, 8)
        await producer.push(traj("lin", 0, True))
        # No worker yet: a waiter that outlives several lingers and reader turns.
        waiter = asyncio.ensure_future(agg.result("lin", "lin/0", timeout_s=30))
        while agg._listener is None or not agg._listener._readers:
            await asyncio.sleep(0.01)
        listener = agg._listener
        listener.linger_s = 0.6
        (reader,) = listener._readers.values()
        name = producer.keys.done("lin")
        await asyncio.sleep(2.2)  # two reader turns (block_ms 1 s), past linger_s with a waiter
        assert name in reader.streams
        spawn_workers(1, "--scorer", SCORER)
        assert (await asyncio.wait_for(waiter, 30)).status == "ok"
        left = time.monotonic()
        await asyncio.sleep(0.2)
        assert name in reader.streams  # the last waiter just left: not yet
        while name in reader.streams and time.monotonic() - left < 5:
            await asyncio.sleep(0.05)
        assert name not in reader.streams
        assert time.monotonic() - left >= 0.6
        # Asked again later: read again from the start.
        await producer.push(traj("lin", 1, True))
        assert (await agg.result("lin", "lin/0", timeout_s=10)).status == "ok"
        assert (await agg.result("lin", "lin/1", timeout_s=30)).status == "ok"
