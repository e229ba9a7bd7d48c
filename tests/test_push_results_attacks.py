"""Attacks on the push fast path, packed sends, one-copy results, tick timeouts
and the stale backlog estimate; the eight that failed at first are fixed. Each test asserts a guarantee:
every pushed sample queued once, a retry a no-op, a conflict refused whole,
one result per sample, no crash on an expected fault, no early timeout,
nothing held per resolved sample."""

from __future__ import annotations

import asyncio
import math

import msgpack
import pytest
from helpers import queued

from stream_reward import ProducerConfig, RewardAggregator, RolloutProducer, ScoreResult, Trajectory
from stream_reward.errors import BackpressureError, BrokerError, ConfigError, PushConflictError, ResultTimeoutError
from stream_reward.wire.codec import encode_result
from stream_reward.wire.connection import connect
from stream_reward.wire.ledger import DONE_FIELD, LedgerItem, LedgerWriter

pytestmark = pytest.mark.anyio


def traj(batch: str, i: int, *, uid: str = "", response: str = "r", group: str | None = None) -> Trajectory:
    return Trajectory(batch, i, "test/exact", response=f"{response}{i}", ground_truth="1", uid=uid, group=group)


async def push_fresh(redis_url: str, namespace: str, *samples: Trajectory) -> None:
    """Push from a new producer (a producer refuses a uid it pushed itself before it asks Redis)."""
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as p:
        await p.push_many(samples)


def record(batch: str, i: int, uid: str | None = None, score: float = 1.0) -> bytes:
    return encode_result(ScoreResult(uid or f"{batch}/{i}", batch, i, score))


# --------------------------------------------------------------------------------------
# Push: fast path vs slow path


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


async def test_a_custom_uid_with_a_unicode_digit_is_not_a_crash(redis_url, namespace) -> None:
    """``"b/²".isdigit()`` is True but ``int("²")`` raises: _default_index in producer.py."""
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


async def test_the_pipeline_path_of_a_single_connection_client_queues_once(redis_url, namespace) -> None:
    """A client with a pinned connection takes redis-py's pipeline, not the packed send: the same verdicts."""
    import redis.asyncio as aredis

    client = aredis.Redis.from_url(redis_url, single_connection_client=True)
    try:
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace), client=client) as p:
            await p.open_batch("s", 600, 8)
            await p.push_many([traj("s", i) for i in range(300)])
            await client.script_flush()
            async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace), client=client) as q:
                with pytest.raises(PushConflictError, match="index 5"):
                    await q.push_many([traj("s", i) for i in range(200, 600)] + [traj("s", 5, uid="z")])
            assert sorted(i for _, _, i in await queued(redis_url, p.keys)) == list(range(600))
    finally:
        await client.aclose()


# --------------------------------------------------------------------------------------
# Push: connection faults, script cache


async def test_connections_killed_under_pushes_queue_each_sample_once(redis_url, namespace) -> None:
    """CLIENT KILL TYPE normal from another thread, over and over, while large pushes are in flight."""
    import threading

    import redis

    config = ProducerConfig(namespace=namespace)
    stop = threading.Event()
    kills = [0]

    def killer() -> None:
        admin = redis.Redis.from_url(redis_url)
        try:
            while not stop.is_set():
                kills[0] += admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
                stop.wait(0.01)
        finally:
            admin.close()

    async with RolloutProducer(redis_url, config) as p:
        await p.open_batch("k", 3000, 8)
        thread = threading.Thread(target=killer)
        thread.start()
        failures: list[BaseException] = []
        try:
            for lo in range(0, 3000, 300):
                chunk = [traj("k", i, response="x" * 4000) for i in range(lo, lo + 300)]
                for _attempt in range(200):
                    try:
                        await p.push_many(chunk)
                        break
                    except BrokerError as exc:  # a retry of the whole call is safe
                        failures.append(exc)
                else:
                    raise AssertionError(f"never pushed: {failures[-1]!r}")
        finally:
            stop.set()
            thread.join()
        got = await queued(redis_url, p.keys)
    assert kills[0] > 0
    assert sorted(i for _, _, i in got) == list(range(3000)), (len(got), len(set(got)), kills, failures[:3])


async def test_script_flush_before_a_slow_path_call_is_recovered(redis_url, namespace) -> None:
    config = ProducerConfig(namespace=namespace)
    async with RolloutProducer(redis_url, config) as a, RolloutProducer(redis_url, config) as b:
        await a.open_batch("f", 600, 8)
        await a.push_many([traj("f", i) for i in range(300)])
        await b.push_many([traj("f", 0)])  # b's script is loaded
        admin = connect(redis_url)
        try:
            await admin.script_flush()
        finally:
            await admin.aclose()
        # duplicates + fresh + a conflict, over two script calls, after the cache is gone
        call = [traj("f", i) for i in range(250, 600)] + [traj("f", 1, uid="z")]
        with pytest.raises(PushConflictError, match="index 1"):
            await b.push_many(call)
        got = await queued(redis_url, a.keys)
        assert sorted(i for _, _, i in got) == list(range(600))


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


# --------------------------------------------------------------------------------------
# Results: garbage in a done stream, a uid written twice


def garbage_row(batch: str, i: int, **over: object) -> bytes:
    row = [3, f"{batch}/{i}", batch, i, 1.0, "ok", 1, 0.0, None, None, None, None, None, None]
    for k, v in over.items():
        row[{"score": 4, "extra": 8, "attempts": 6}[k]] = v
    return msgpack.packb(row, use_bin_type=True)


async def test_collect_survives_a_record_whose_score_is_not_a_number(redis_url, namespace) -> None:
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as p,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await p.open_batch("g", 3, 8)
        client = connect(redis_url)
        try:
            await client.xadd(
                p.keys.done("g", 0), {DONE_FIELD: record("g", 0) + garbage_row("g", 1, score="abc") + record("g", 2)}
            )
        finally:
            await client.aclose()
        rewards = await agg.collect("g", timeout_s=2, on_timeout="resolve")  # observed: raw ValueError
    assert rewards.status[0] == "ok" and rewards.status[2] == "ok"
    assert rewards.status[1] == "failed"


async def test_collect_survives_a_record_whose_extra_is_not_a_map(redis_url, namespace) -> None:
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as p,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await p.open_batch("g", 2, 8)
        client = connect(redis_url)
        try:
            await client.xadd(p.keys.done("g", 0), {DONE_FIELD: record("g", 0) + garbage_row("g", 1, extra=5)})
        finally:
            await client.aclose()
        rewards = await agg.collect("g", timeout_s=2, on_timeout="resolve")  # observed: TypeError in merge_extra_info
    assert rewards.status == ["ok", "failed"]


async def test_a_garbage_record_for_one_waiter_fails_only_that_waiter(redis_url, namespace) -> None:
    """One header-valid record with a non-numeric score must not fail every waiter of the listener."""
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as p,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await p.open_batch("g1", 1, 8)
        await p.open_batch("g2", 1, 8)
        bad = asyncio.ensure_future(agg.result("g1", "g1/0", timeout_s=10))
        good = asyncio.ensure_future(agg.result("g2", "g2/0", timeout_s=10))
        await asyncio.sleep(0.2)
        client = connect(redis_url)
        try:
            await client.xadd(p.keys.done("g1", 0), {DONE_FIELD: garbage_row("g1", 0, score="abc")})
            await asyncio.sleep(0.2)
            ledger = LedgerWriter(client, p.keys, "scorers", result_ttl_s=60)
            await ledger.write(0, [LedgerItem("", "g2", "g2/0", record("g2", 0, score=0.5))])
        finally:
            await client.aclose()
        r_good = await good  # observed: BrokerError "reading results: ValueError"
        assert (r_good.status, r_good.score) == ("ok", 0.5)
        r_bad = await bad
        assert r_bad.status == "failed"


async def test_a_uid_written_twice_resolves_once_with_the_first_result(redis_url, namespace) -> None:
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as p,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await p.open_batch("w", 3, 8)
        await p.push_many([traj("w", i) for i in range(3)])
        client = connect(redis_url)
        try:
            ledger = LedgerWriter(client, p.keys, "scorers", result_ttl_s=60)
            assert await ledger.write(0, [LedgerItem("", "w", "w/0", record("w", 0, score=0.25))]) == 1
            # a redelivery scored again, twice in one flush and once more later; and fail() after it
            items = [LedgerItem("", "w", "w/0", record("w", 0, score=0.75)) for _ in range(2)]
            items.append(LedgerItem("", "w", "w/1", record("w", 1, score=1.0)))
            assert await ledger.write(0, items) == 1
            await p.fail("w", 0, reason="x", error="late")
            await p.fail("w", 2, reason="x", error="given up")
        finally:
            await client.aclose()
        r0 = await agg.result("w", "w/0", timeout_s=2)
        rewards = await agg.collect("w", timeout_s=2)
    assert (r0.status, r0.score) == ("ok", 0.25)
    assert rewards.scores[:2] == [0.25, 1.0] and rewards.status == ["ok", "ok", "failed"]


# --------------------------------------------------------------------------------------
# Listener: tick timeouts


async def test_many_waiters_time_out_on_time_never_early_and_leave_nothing_behind(redis_url, namespace) -> None:
    async with RewardAggregator(redis_url, namespace=namespace) as agg:
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as p:
            await p.open_batch("t", 500, 8)
        loop = asyncio.get_running_loop()
        # Each call's timeout counts from its wait, after its batch-meta read: measured from
        # there, so that 500 reads at once through the pool (1.0-3.5 s on CI's loaded machine,
        # where a bound from the call's start failed at 3.58 s) are not charged to the timer.
        waiting_since: dict[asyncio.Task, float] = {}
        real_meta = agg.meta

        async def meta(batch_id: str):
            out = await real_meta(batch_id)
            waiting_since[asyncio.current_task()] = loop.time()
            return out

        agg.meta = meta

        async def timed(i: int) -> float:
            timeout_s = 0.2 + (i % 17) * 0.013
            with pytest.raises(ResultTimeoutError):
                await agg.result("t", f"t/{i}", timeout_s=timeout_s)
            return loop.time() - waiting_since[asyncio.current_task()] - timeout_s

        late = await asyncio.gather(*(timed(i) for i in range(500)))
        assert min(late) >= 0, min(late)
        assert max(late) < 1.0, max(late)  # a tick (TIMEOUT_TICK_S) and the loop's own delays
        listener = agg._listener
        assert listener is not None
        assert sum(len(d) for d in listener._due.values()) == 0
        assert all(not f.waiters for r in listener._readers.values() for f in r.streams.values())


async def test_many_waiters_on_one_uid_some_cancelled_all_others_resolved_nothing_left(redis_url, namespace) -> None:
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace, partitions=2)) as p,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await p.open_batch("m", 2, 8)
        waiters = [asyncio.ensure_future(agg.result("m", "m/1", timeout_s=(30 if k % 2 else None))) for k in range(60)]

        def registered() -> int:
            listener = agg._listener
            if listener is None:
                return 0
            return sum(len(f.waiters.get("m/1", ())) for r in listener._readers.values() for f in r.streams.values())

        # Every waiter registered (one future per partition) before the cancels: a cancel that
        # lands inside redis-py's meta() read can be swallowed, and the task would go on waiting.
        deadline = asyncio.get_running_loop().time() + 10
        while registered() < 2 * 60 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        for w in waiters[::3]:
            w.cancel()
        client = connect(redis_url)
        try:
            part = p.keys.partition_of("m/1")
            await LedgerWriter(client, p.keys, "scorers", result_ttl_s=60).write(
                part, [LedgerItem("", "m", "m/1", record("m", 1, score=0.5))]
            )
        finally:
            await client.aclose()
        got = await asyncio.gather(*waiters, return_exceptions=True)
        for k, r in enumerate(got):
            if k % 3 == 0:
                assert isinstance(r, asyncio.CancelledError)
            else:
                assert isinstance(r, ScoreResult) and r.score == 0.5, r
        listener = agg._listener
        assert listener is not None
        assert sum(len(d) for d in listener._due.values()) == 0
        assert all(
            not f.waiters and not f.landed.get("m/0") for r in listener._readers.values() for f in r.streams.values()
        )


async def test_an_infinite_timeout_is_no_timeout(redis_url, namespace) -> None:
    """``timeout_s=math.inf`` worked with call_later; in ResultListener.arm ``math.ceil(inf)`` raises
    OverflowError after expect() registered the waiter (never forgotten). Through score() the push
    coroutine is then never awaited: the sample is not even queued."""
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as p,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await p.open_batch("inf", 1, 8)
        task = asyncio.ensure_future(agg.result("inf", "inf/0", timeout_s=math.inf))
        await asyncio.sleep(0.2)
        client = connect(redis_url)
        try:
            await LedgerWriter(client, p.keys, "scorers", result_ttl_s=60).write(
                0, [LedgerItem("", "inf", "inf/0", record("inf", 0, score=0.5))]
            )
        finally:
            await client.aclose()
        try:
            result = await asyncio.wait_for(task, 5)  # observed: OverflowError
        finally:
            listener = agg._listener
            assert listener is not None
            leaked = [k for r in listener._readers.values() for f in r.streams.values() for k in f.waiters]
        assert result.score == 0.5
        assert leaked == []


async def test_cancelled_score_calls_leave_no_waiter_and_no_timeout(redis_url, namespace) -> None:
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as p:
        await p.open_batch("cs", 300, 8)
        tasks = [asyncio.ensure_future(p.score(traj("cs", i), timeout_s=600)) for i in range(300)]
        for k, t in enumerate(tasks):
            if k % 3 == 0:
                t.cancel()
        await asyncio.sleep(0)
        for k, t in enumerate(tasks):
            if k % 3 == 1:
                t.cancel()
        await asyncio.sleep(0.05)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        listener = p._listener
        assert listener is not None
        assert sum(len(d) for d in listener._due.values()) == 0
        assert all(not f.waiters for r in listener._readers.values() for f in r.streams.values())
        got = await queued(redis_url, p.keys)
        assert len(got) == len(set(got))


# --------------------------------------------------------------------------------------
# Backpressure


async def test_a_stale_estimate_does_not_let_many_concurrent_pushes_past_max_backlog(redis_url, namespace) -> None:
    """Another producer filled the backlog (20 > max_backlog 10). A producer whose estimate is
    stale lets every concurrent push of the loop turn go before its reading returns."""
    config = ProducerConfig(namespace=namespace, max_backlog=10, on_backlog="raise", backlog_poll_s=0.05)
    async with (
        RolloutProducer(redis_url, config) as mine,
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as other,
    ):
        await other.open_batch("o", 20, 4)
        await other.push_many(traj("o", i) for i in range(20))
        await mine.open_batch("m", 100, 4)
        results = await asyncio.gather(*(mine.push(traj("m", i)) for i in range(100)), return_exceptions=True)
        went = sum(r is None for r in results)
        assert all(r is None or isinstance(r, BackpressureError) for r in results)
        # The design lets a stale estimate's push go; it must not let max_backlog be exceeded tenfold.
        assert went <= config.max_backlog, f"{went} pushes went with a backlog of 20 over max_backlog 10"


# --------------------------------------------------------------------------------------
# End to end, partitions=2


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


# --------------------------------------------------------------------------------------
# score(): one wait per sample, the push's verdict delivered by a callback


async def test_a_refused_score_raises_the_conflict_not_a_timeout_and_frees_nothing_it_did_not_take(
    redis_url, namespace
) -> None:
    """score() awaits only the result; the push's verdict reaches it by a callback. A refused
    sample must still raise PushConflictError (even with a timeout of 0, which must never
    claim a refused sample is queued), and the uid of the sample already queued stays taken."""
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as p:
        await p.open_batch("r", 4, 8)
        await p.push(traj("r", 0, uid="x"))
        for timeout_s in (None, 0.0, 600.0):
            with pytest.raises(PushConflictError, match="already pushed under another uid"):
                await p.score(traj("r", 0, uid=f"y{timeout_s}"), timeout_s=timeout_s)
        # A push slower than the timeout: the refusal still wins (the timeout starts once queued).
        flush = p._flush

        async def slow(entries: list) -> list[int]:
            await asyncio.sleep(0.2)
            return await flush(entries)

        p._coalescer, p._flush = None, slow  # type: ignore[method-assign]  # made again at the next push
        with pytest.raises(PushConflictError, match="already pushed under another uid"):
            await p.score(traj("r", 0, uid="slow"), timeout_s=0.01)
        p._coalescer, p._flush = None, flush  # type: ignore[method-assign]
        # Many at once, coalesced with good ones: each refused call raises, each good one times out queued.
        got = await asyncio.gather(
            *(p.score(traj("r", 0, uid=f"z{k}"), timeout_s=0.05) for k in range(20)),
            p.score(traj("r", 1), timeout_s=0.05),
            return_exceptions=True,
        )
        assert all(isinstance(g, PushConflictError) for g in got[:20]), got[:20]
        assert isinstance(got[20], ResultTimeoutError)
        with pytest.raises(ConfigError, match="pushed twice"):  # x is still this producer's
            await p.push(traj("r", 2, uid="x"))
        # A refused uid is free again: pushed right, it is queued.
        await p.push(traj("r", 3, uid="y0.0"))
        assert sorted(i for _, _, i in await queued(redis_url, p.keys)) == [0, 1, 3]
        listener = p._listener
        assert listener is not None and sum(len(d) for d in listener._due.values()) == 0
        assert all(not f.waiters for r in listener._readers.values() for f in r.streams.values())


async def test_a_broker_error_in_the_push_fails_score_and_the_sample_can_be_scored_again(redis_url, namespace) -> None:
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as p:
        await p.open_batch("e", 2, 8)
        flush = p._flush

        async def broken(entries: list) -> list[int]:
            raise BrokerError("push of 1 trajectories failed: injected")

        p._flush = broken  # type: ignore[method-assign]  # the coalescer is made at the first push
        with pytest.raises(BrokerError, match="injected"):
            await p.score(traj("e", 0), timeout_s=600)
        assert await queued(redis_url, p.keys) == []
        p._coalescer = None
        p._flush = flush  # type: ignore[method-assign]
        with pytest.raises(ResultTimeoutError):  # pushed this time (no worker): queued, not yet scored
            await p.score(traj("e", 0), timeout_s=0.05)
        assert [i for _, _, i in await queued(redis_url, p.keys)] == [0]


async def test_cancelled_score_calls_release_their_uids_and_queue_each_sample_at_most_once(
    redis_url, namespace
) -> None:
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as p:
        await p.open_batch("k", 200, 8)
        for i in range(0, 200, 4):
            tasks = [asyncio.ensure_future(p.score(traj("k", j), timeout_s=600)) for j in range(i, i + 4)]
            for _ in range(i % 5):
                await asyncio.sleep(0)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.05)  # flushes already under way land
        landed = {i for _, _, i in await queued(redis_url, p.keys)}
        for i in range(200):
            try:
                await p.push(traj("k", i))
            except ConfigError:  # still reserved: only a sample whose push landed before the cancel
                assert i in landed, f"sample {i} was never queued but its uid stayed reserved"
        got = await queued(redis_url, p.keys)
        assert sorted(i for _, _, i in got) == list(range(200))
