"""The process's one result listener (trainer/listener.py) behind ``score()`` and ``result()``.

It promises: many concurrent waiters each get their own result without a read of their
own; a result read before its waiter came (or pushed by another process) still reaches
it; waiters on one uid are independent (one cancelled, the others resolved); a garbled
record fails only its own waiter; a uid written twice resolves once, with the first
result; timeouts fire on time, never early, and nothing (waiter, armed timeout, followed
stream) is left once a waiter is gone; its connection killed or its read replies lost, it
reads on and every waiter gets its own result.
"""

from __future__ import annotations

import asyncio
import math
import random
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import CutProxy, LoopLag, lane_client_id, queued, traj, wait_until
from redis.exceptions import ResponseError
from trainer_support import (
    clean,
    due,
    expected,
    garbage_row,
    graded,
    outcome,
    record,
    settle,
    waiters,
    worker,
)

from stream_reward import ProducerConfig, RewardAggregator, RolloutProducer, ScoreResult, Trajectory
from stream_reward.errors import ResultTimeoutError
from stream_reward.trainer import listener as listener_mod
from stream_reward.wire.connection import connect
from stream_reward.wire.ledger import DONE_FIELD, LedgerItem, LedgerWriter

pytestmark = pytest.mark.anyio


SCORER = "python:tests/data/scorers.py:exact"


async def xread_calls(redis_url: str) -> int:
    client = connect(redis_url)
    try:
        stats = await client.info("commandstats")
    finally:
        await client.aclose()
    return int(stats.get("cmdstat_xread", {}).get("calls", 0))


def waiting_on(listener, uid: str) -> int:
    return sum(len(fs) for (_, u), fs in waiters(listener).items() if u == uid)


async def _queued(redis_url: str, p: RolloutProducer, t: Trajectory) -> bool:
    return (t.batch_id, t.uid, t.index) in await queued(redis_url, p.keys)


async def _true(value: bool) -> bool:
    return value


class Hold:
    """Holds the producer's flushes until ``opened``; ``after`` runs once a flush returned,
    before the coalescer hands out its verdicts."""

    def __init__(self, p: RolloutProducer) -> None:
        self.real, self.started, self.opened, self.after = p._flush, asyncio.Event(), asyncio.Event(), None
        p._coalescer, p._flush = None, self.flush  # type: ignore[method-assign]

    async def flush(self, entries: list) -> list[int]:
        self.started.set()
        await self.opened.wait()
        verdicts = await self.real(entries)
        if self.after is not None:
            self.after()
        return verdicts


CASES = [
    ("result", "score_not_taken"),  # score() cancelled before its push is taken into a flush
    ("result", "score_in_flight"),  # cancelled with its flush in flight (verdict not in)
    ("result", "score_after_verdict"),
    ("score", "score_after_verdict"),
    ("result", "result"),  # the result() call cancelled, score() waits on
    ("score", "result"),
    ("score", "one_of_two_results"),
    ("score", "one_of_two_scores"),  # two producers score the same sample; one is cancelled
]


# Waiters and their results


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
        samples = [graded(f"s{b}", i, (i * 7 + b) % 3 != 0) for b in range(n_batches) for i in range(per_batch)]
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
        # One push to more batches than the producer remembers must not evict a uid set it is using.
        assert await producer.push_many(graded(f"m{b}", 0, True) for b in range(n_batches)) == n_batches
        # And one in-flight score() per batch, all at once.
        # Each batch's second sample in a GRPO group of its own: they spread over both partitions.
        second = [
            Trajectory(f"m{b}", 1, "test/exact", "1001" if b % 2 == 0 else "0", "1001", group=f"m{b}")
            for b in range(n_batches)
        ]
        assert {producer.keys.partition_of(t.uid, t.group) for t in second} == {0, 1}
        results = await asyncio.wait_for(asyncio.gather(*(producer.score(t, timeout_s=60) for t in second)), 90)
    assert [(r.batch_id, r.score) for r in results] == [(f"m{b}", 1.0 if b % 2 == 0 else 0.0) for b in range(n_batches)]


async def test_result_of_a_sample_already_read_for_score_by_the_shared_listener(redis_url, namespace, spawn_workers):
    """score() does not keep results it was not asked for; a later result() of one of
    them, on the same process-wide listener, reads the stream again instead of hanging."""
    spawn_workers(1, "--scorer", SCORER)
    config = ProducerConfig(namespace=namespace)
    async with RolloutProducer(redis_url, config) as producer, RewardAggregator(redis_url, namespace=namespace) as agg:
        await producer.open_batch("shared", 3, 4)
        await producer.push(graded("shared", 0, True))
        assert (await producer.score(graded("shared", 1, False), timeout_s=30)).score == 0.0
        assert (await producer.score(graded("shared", 2, True), timeout_s=30)).score == 1.0
        assert producer._listener is agg._listener or agg._listener is None
        r0 = await agg.result("shared", "shared/0", timeout_s=5)
        assert agg._listener is producer._listener  # one listener per process, loop, server and namespace
    assert (r0.index, r0.score) == (0, 1.0)


@pytest.mark.parametrize(("first", "cancel"), CASES)
async def test_two_waiters_on_one_uid_one_cancelled_the_other_gets_the_result(
    redis_url, namespace, first, cancel
) -> None:
    """_add_waiter/_drop_waiter (and its single-waiter fast path), watch/unwatch vs
    expect/forget on one uid: cancelling one waiter must not drop the other's future, the
    remaining waiters get the right result, and no waiter is left in the listener."""
    cfg = ProducerConfig(namespace=namespace, partitions=2)
    async with (
        RolloutProducer(redis_url, cfg) as p,
        RolloutProducer(redis_url, cfg) as p2,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await p.open_batch("w", 20, 8)
        await p.push(traj("w", 19))  # groups ready: the push is handed over without an await
        t = traj("w", 3)
        hold = Hold(p) if cancel == "score_in_flight" else None
        tasks: dict[str, asyncio.Task] = {}

        def listener():
            return p._listener or agg._listener

        def registered() -> int:
            return 0 if listener() is None else waiting_on(listener(), t.uid)

        others = {"one_of_two_results": ["result", "result2"], "one_of_two_scores": ["score2"]}.get(cancel, ["result"])
        for kind in ["score", *others] if first == "score" else [*others, "score"]:
            had = registered()
            if kind == "score":
                tasks[kind] = asyncio.ensure_future(p.score(t, timeout_s=20))
                if cancel == "score_not_taken":
                    await asyncio.sleep(0)
                    assert p._coalescer is not None and len(p._coalescer._pending) == 1
                    continue
                if cancel == "score_in_flight":
                    await asyncio.wait_for(hold.started.wait(), 5)
                else:
                    await wait_until(lambda: _queued(redis_url, p, t), 5, 0.01)
            elif kind == "score2":
                tasks[kind] = asyncio.ensure_future(p2.score(t, timeout_s=20))
            else:
                tasks[kind] = asyncio.ensure_future(agg.result("w", t.uid, timeout_s=20))
            # result() waits on both partitions' done streams, score() on its own one
            more = 1 if kind.startswith("score") else 2
            await wait_until(lambda had=had, more=more: _true(registered() == had + more), 5, 0.005)
        victim = "result" if cancel in ("result", "one_of_two_results") else "score"
        tasks[victim].cancel()
        got = await outcome(tasks.pop(victim))
        assert isinstance(got, asyncio.CancelledError), got
        if hold is not None:
            hold.opened.set()  # the flush goes on: the sample is queued all the same
        if cancel == "score_not_taken":
            assert t.uid not in p._uids("w"), "a cancelled, never-pushed score() kept its uid"
            await p.push(t)  # so the remaining waiter has a result to get
        await asyncio.sleep(0.05)
        assert all(not x.done() for x in tasks.values()), {k: x for k, x in tasks.items() if x.done()}
        async with worker(redis_url, namespace, partitions=2):
            rest = await settle(tasks.values(), 15)
        for kind, r in zip(tasks, rest):
            assert isinstance(r, ScoreResult) and (r.uid, r.score) == (t.uid, expected(t)), (kind, r)
        await asyncio.sleep(0.02)
        clean(listener())


async def test_cancel_one_waiter_as_the_result_lands_the_others_get_it(redis_url, namespace, monkeypatch) -> None:
    """The moment _land pops a uid's waiters: score() and two result() calls on one
    uid, one of them cancelled from inside _land (its future already resolved): the others
    still get the result, and unwatch/forget of a popped list leave nothing behind."""
    cfg = ProducerConfig(namespace=namespace)
    async with RolloutProducer(redis_url, cfg) as p, RewardAggregator(redis_url, namespace=namespace) as agg:
        await p.open_batch("l", 10, 8)
        for victim, t in (("score", traj("l", 1)), ("result", traj("l", 2))):
            tasks = {"score": asyncio.ensure_future(p.score(t, timeout_s=10))}
            await wait_until(lambda t=t: _queued(redis_url, p, t), 5, 0.01)
            for k in ("result", "result2"):
                tasks[k] = asyncio.ensure_future(agg.result("l", t.uid, timeout_s=10))
            await wait_until(lambda t=t: _true(waiting_on(p._listener, t.uid) == 3), 5, 0.005)
            real = listener_mod._Reader._land

            def land(name, followed, entries, real=real, tasks=tasks, victim=victim):
                real(name, followed, entries)
                if not tasks[victim].done():
                    tasks[victim].cancel()

            monkeypatch.setattr(listener_mod._Reader, "_land", staticmethod(land))
            async with worker(redis_url, namespace):
                got = dict(zip(tasks, await settle(tasks.values())))
            monkeypatch.undo()
            for k, r in got.items():
                if k != victim:
                    assert isinstance(r, ScoreResult) and r.score == expected(t), (k, r)
            await asyncio.sleep(0.02)
            clean(p._listener)


async def test_a_waiter_registered_as_another_is_resolved_is_not_dropped_by_its_unwatch(
    redis_url, namespace, monkeypatch
) -> None:
    """_drop_waiter's single-waiter fast path: _land pops and resolves score() A's
    future; before A's task runs its unwatch, a second producer's score() B of the same
    sample registers a new one-future list for the uid. A's unwatch must drop only its own
    future, not B's: B (a DUPLICATE, which rereads the done stream) gets the result."""
    from stream_reward.wire.codec import row_header
    from stream_reward.wire.ledger import done_rows

    cfg = ProducerConfig(namespace=namespace)
    async with RolloutProducer(redis_url, cfg) as p, RolloutProducer(redis_url, cfg) as p2:
        await p.open_batch("f", 10, 8)
        await p2._ensure_groups()  # p2's push is handed over in its first step
        t = traj("f", 2)
        a = asyncio.ensure_future(p.score(t, timeout_s=10))
        await wait_until(lambda: _queued(redis_url, p, t), 5, 0.01)
        b: list[asyncio.Task] = []
        real = listener_mod._Reader._land

        def land(name, followed, entries):
            uids = {row_header(r)[0] for _, f in entries for r in done_rows(f)[0]}
            if not b and t.uid in uids and t.uid in followed.waiters:
                b.append(asyncio.ensure_future(p2.score(t, timeout_s=3)))  # runs before A wakes
            real(name, followed, entries)

        monkeypatch.setattr(listener_mod._Reader, "_land", staticmethod(land))
        async with worker(redis_url, namespace):
            ra = await asyncio.wait_for(a, 10)
            assert b, "the landing was not seen"
            rb = await outcome(asyncio.wait_for(b[0], 5))
        monkeypatch.undo()
        assert ra.score == expected(t)
        assert isinstance(rb, ScoreResult) and rb.score == expected(t), rb
        clean(p._listener)


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


# Timeouts


async def test_score_times_out_with_a_clear_error_and_the_sample_stays_queued(redis_url, namespace):
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
        await producer.open_batch("nobody", 1, 4)
        with pytest.raises(ResultTimeoutError, match="no result for uid"):
            await producer.score(graded("nobody", 0, True), timeout_s=0.2)
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
                await producer.score(graded("nobody", i, True), timeout_s=timeout_s)
            return loop.time() - started

        async with LoopLag() as lag:
            took = await asyncio.gather(timed(0, 0.3), timed(1, 0.45), timed(2, 0.7))
    # Late by a tick and a loop turn at most, plus however long the loop itself did not run
    # (a loaded machine): never early, whatever the load.
    for timeout_s, t in zip((0.3, 0.45, 0.7), took):
        assert timeout_s <= t <= timeout_s + TIMEOUT_TICK_S + 0.2 + lag.worst_s, (timeout_s, t, lag.worst_s)


async def test_resolved_samples_leave_no_timeout_behind(redis_url, namespace, spawn_workers):
    spawn_workers(1, "--scorer", SCORER)
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
        await producer.open_batch("t", 200, 4)
        results = await asyncio.gather(*(producer.score(graded("t", i, True), timeout_s=600) for i in range(200)))
        assert all(r.status == "ok" for r in results)
        listener = producer._listener
        assert listener is not None
        # Each of them was due to time out in 10 minutes: none is still held for it.
        assert sum(len(due) for due in listener._due.values()) == 0


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
        await producer.push(graded("lin", 0, True))
        # No worker yet: a waiter that outlives several lingers and reader turns.
        waiter = asyncio.ensure_future(agg.result("lin", "lin/0", timeout_s=30))
        while agg._listener is None or not agg._listener._readers:
            await asyncio.sleep(0.01)
        listener = agg._listener
        # Long enough that the check 0.2 s after the last waiter left still comes before
        # it on a loaded machine (a second of slack).
        listener.linger_s = 1.2
        (reader,) = listener._readers.values()
        name = producer.keys.done("lin")
        await asyncio.sleep(3.2)  # two reader turns (block_ms 1 s), past linger_s with a waiter
        assert name in reader.streams
        spawn_workers(1, "--scorer", SCORER)
        assert (await asyncio.wait_for(waiter, 30)).status == "ok"
        left = time.monotonic()
        await asyncio.sleep(0.2)
        assert name in reader.streams  # the last waiter just left: not yet
        while name in reader.streams and time.monotonic() - left < 10:
            await asyncio.sleep(0.05)
        assert name not in reader.streams
        assert time.monotonic() - left >= 1.2
        # Asked again later: read again from the start.
        await producer.push(graded("lin", 1, True))
        assert (await agg.result("lin", "lin/0", timeout_s=10)).status == "ok"
        assert (await agg.result("lin", "lin/1", timeout_s=30)).status == "ok"


@pytest.mark.parametrize("when", ["expire", "cancel_after_verdict", "cancel_as_verdict_lands", "result_calls"])
async def test_timed_out_or_cancelled_calls_leave_no_armed_timeout(redis_url, namespace, when) -> None:
    """The tick arm() returns (kept on the call, handed to unwatch/forget): score()
    calls that time out, or are cancelled once their timeout is armed (later, or in the
    very turn the flush hands out verdicts), and result() calls alike, leave nothing in
    listener._due or the waiters."""
    cfg = ProducerConfig(namespace=namespace, coalesce_max_entries=4096)
    n = 120
    async with RolloutProducer(redis_url, cfg) as p, RewardAggregator(redis_url, namespace=namespace) as agg:
        await p.open_batch("t", n + 1, 8)
        await p.push(traj("t", n))
        samples = [traj("t", i) for i in range(n)]
        if when == "expire":
            got = await settle([p.score(t, timeout_s=(i % 7) * 0.04) for i, t in enumerate(samples)], 5)
            assert all(isinstance(g, ResultTimeoutError) for g in got), [type(g) for g in got]
        elif when == "result_calls":
            await p.push_many(samples)
            got = await settle([agg.result("t", t.uid, timeout_s=0.1) for t in samples[: n // 2]], 5)
            assert all(isinstance(g, ResultTimeoutError) for g in got), got[:3]
            tasks = [asyncio.ensure_future(agg.result("t", t.uid, timeout_s=10)) for t in samples[n // 2 :]]
            await wait_until(lambda: _true(due(p._listener or agg._listener) == len(tasks)), 5, 0.01)
            for x in tasks:
                x.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        else:
            hold = Hold(p)
            tasks = [asyncio.ensure_future(p.score(t, timeout_s=10)) for t in samples]
            if when == "cancel_as_verdict_lands":
                hold.after = lambda: [x.cancel() for x in tasks]
            await asyncio.wait_for(hold.started.wait(), 5)
            hold.opened.set()
            if when == "cancel_after_verdict":
                await wait_until(lambda: _true(due(p._listener) == n), 5, 0.01)
                for x in tasks:
                    x.cancel()
            got = await settle(tasks, 5)
            assert all(isinstance(g, asyncio.CancelledError) for g in got), got[:3]
            # The verdicts were in: every sample is queued and keeps its uid.
            assert len(await queued(redis_url, p.keys)) == n + 1
        await asyncio.sleep(0.02)
        clean(p._listener or agg._listener)


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

        async with LoopLag() as lag:
            late = await asyncio.gather(*(timed(i) for i in range(500)))
        assert min(late) >= 0, min(late)
        # A tick (TIMEOUT_TICK_S) and the loop's own turns, plus however long the loop did not
        # run at all (a loaded machine).
        assert max(late) < 1.0 + lag.worst_s, (max(late), lag.worst_s)
        listener = agg._listener
        assert listener is not None
        assert sum(len(d) for d in listener._due.values()) == 0
        assert all(not f.waiters for r in listener._readers.values() for f in r.streams.values())


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


# Its connection killed, its replies lost


async def test_score_gets_its_result_when_the_listeners_connection_is_killed_mid_read(
    redis_url, namespace, spawn_workers
) -> None:
    admin = connect(redis_url)
    spawn_workers(1)
    try:
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
            await producer.open_batch("r", 4, 4)
            first = await producer.score(Trajectory("r", 0, "openai/gsm8k", response="#### 1", ground_truth="1"))
            assert first.status == "ok"
            (reader,) = producer._listener._readers.values()
            assert reader.lane is not None, "the listener does not read on a lane"
            for i in (1, 2):
                victim = await lane_client_id(reader.lane) if i == 1 else None
                scoring = asyncio.ensure_future(
                    producer.score(
                        Trajectory("r", i, "openai/gsm8k", response="#### 2", ground_truth="2"), timeout_s=30
                    )
                )
                if victim is not None:
                    await admin.client_kill_filter(_id=victim)
                result = await asyncio.wait_for(scoring, 30)
                assert (result.index, result.status, result.score) == (i, "ok", 1.0)
    finally:
        await admin.aclose()


async def test_score_calls_get_their_own_results_while_the_listeners_lane_is_killed_again_and_again(
    own_url, namespace, spawn_workers
) -> None:
    # Its own server: the killer kills every XREAD client, and on the shared one those
    # include the tests running beside it.
    spawn_workers(1, url=own_url)
    admin = connect(own_url)
    stop = asyncio.Event()
    kills = 0

    async def killer() -> None:
        nonlocal kills
        while not stop.is_set():
            for c in await admin.client_list():
                if c.get("cmd") == "xread":
                    try:
                        await admin.client_kill_filter(_id=c["id"])
                        kills += 1
                    except ResponseError:
                        pass
            await asyncio.sleep(0.005 + random.random() * 0.03)

    try:
        async with RolloutProducer(own_url, ProducerConfig(namespace=namespace)) as producer:
            await producer.open_batch("L", 200, 4)
            warm = await producer.score(Trajectory("L", 0, "openai/gsm8k", response="#### 2", ground_truth="2"))
            assert warm.status == "ok"
            killing = asyncio.ensure_future(killer())
            rng = random.Random(5)

            async def one(i: int):
                await asyncio.sleep(rng.random() * 2)
                answer = str(i % 7)
                sample = Trajectory("L", i, "openai/gsm8k", response=f"#### {answer}", ground_truth=str(i % 3))
                return i, await producer.score(sample, timeout_s=60)

            results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(1, 200))), 90)
            stop.set()
            await killing
            assert kills >= 5, f"only {kills} kills: nothing tested"
            for i, result in results:
                want = 1.0 if str(i % 7) == str(i % 3) else 0.0
                assert (result.index, result.status, result.score) == (i, "ok", want), (i, result)
    finally:
        stop.set()
        await admin.aclose()


async def test_listener_results_survive_lost_xread_replies(redis_url, namespace, spawn_workers) -> None:
    """The proxy swallows XREAD replies (results in them) after the server sent them: the
    listener must read them again, from the same cursor, on a new connection."""
    spawn_workers(1)
    async with CutProxy(redis_url[len("unix://") :]) as proxy:
        async with RolloutProducer(proxy.url, ProducerConfig(namespace=namespace)) as producer:
            await producer.open_batch("X", 20, 4)
            await producer.score(Trajectory("X", 0, "openai/gsm8k", response="#### 2", ground_truth="2"))
            proxy.arm(b"XREAD", times=6)
            trajs = [
                Trajectory("X", i, "openai/gsm8k", response=f"#### {i % 2}", ground_truth="1") for i in range(1, 20)
            ]
            results = await asyncio.wait_for(
                asyncio.gather(*(producer.score(t, timeout_s=40) for t in trajs)),
                60,
            )
            assert proxy.cuts >= 1, "no XREAD reply was lost: nothing tested"
            for t, r in zip(trajs, results):
                assert (r.index, r.status, r.score) == (t.index, "ok", float(t.index % 2))
