"""Attacks on score()'s one object per sample (_ScoreCall, commit f35562b): the listener's
watch/unwatch and its waiter helpers, the tick arm() returns, _entry's encode-before-reserve
(shared with push_many) and the split room check. Each test states the guarantee it attacks;
each checks that nothing is left behind (uid reservations, backlog count, waiters, timeouts)."""

from __future__ import annotations

import asyncio

import pytest
from helpers import Timed, done_results, queued, running_worker, wait_until

from stream_reward import ProducerConfig, RewardAggregator, RolloutProducer, ScoreResult, Trajectory
from stream_reward.errors import (
    BackpressureError,
    BrokerError,
    CodecError,
    PayloadTooLargeError,
    PushConflictError,
    ResultTimeoutError,
)
from stream_reward.trainer import listener as listener_mod

pytestmark = pytest.mark.anyio


def traj(batch: str, i: int, *, response: str = "r", **kw) -> Trajectory:
    return Trajectory(batch, i, "test/exact", response=f"{response}{i}", ground_truth="1", **kw)


def expected(t: Trajectory) -> float:
    return t.index + len(t.response) / 1000


def worker(url: str, ns: str, **cfg):
    """An in-process worker scoring by identity (helpers.Timed: index + len(response)/1000)."""
    return running_worker(url, ns, Timed(), **cfg)


def waiters(listener) -> dict:
    streams = [(name, f) for r in listener._readers.values() for name, f in r.streams.items()]
    return {(name, u): list(fs) for name, f in streams for u, fs in f.waiters.items()}


def waiting_on(listener, uid: str) -> int:
    return sum(len(fs) for (_, u), fs in waiters(listener).items() if u == uid)


def due(listener) -> int:
    return sum(len(d) for d in listener._due.values())


def clean(listener) -> None:
    assert due(listener) == 0, listener._due
    assert waiters(listener) == {}, waiters(listener)


async def outcome(aw) -> object:
    try:
        return await aw
    except BaseException as exc:  # noqa: BLE001
        return exc


async def settle(aws, timeout_s: float = 10) -> list:
    """Each awaitable's result or exception (all of them within ``timeout_s``)."""
    return await asyncio.wait_for(asyncio.gather(*aws, return_exceptions=True), timeout_s)


async def _queued(redis_url: str, p: RolloutProducer, t: Trajectory) -> bool:
    return (t.batch_id, t.uid, t.index) in await queued(redis_url, p.keys)


async def _true(value: bool) -> bool:
    return value


async def _zero(count) -> bool:
    return await count == 0


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


# --- 1. Two (or three) waiters on one uid, one cancelled

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


@pytest.mark.parametrize(("first", "cancel"), CASES)
async def test_two_waiters_on_one_uid_one_cancelled_the_other_gets_the_result(
    redis_url, namespace, first, cancel
) -> None:
    """Attacks _add_waiter/_drop_waiter (and its single-waiter fast path), watch/unwatch vs
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
    """Attacks the moment _land pops a uid's waiters: score() and two result() calls on one
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


# --- 2. Trajectories that fail to encode

BAD = {  # a sample (index 1 of batch "e") that cannot be encoded, and what it raises
    "too_large": ({"response": "x" * 10_000}, PayloadTooLargeError),
    "not_msgpackable": ({"extra_info": {"o": object()}}, CodecError),
    # Suspicious in the diff: _entry reserves the uid, then reads traj.response_length (len of
    # response_ids). Ids given as a one-shot iterable pass pack_ids (array() takes any
    # iterable) and fail at len(): after the reservation, outside any cleanup.
    "ids_without_len": ({"response_ids": iter([1, 2, 3])}, TypeError),
}


@pytest.mark.parametrize("path", ["score", "push_many"])
@pytest.mark.parametrize("kind", list(BAD))
async def test_a_sample_that_fails_to_encode_reserves_nothing_and_counts_nothing(
    redis_url, namespace, kind, path
) -> None:
    """Attacks _entry (encode before reserve) in score() and in push_many's _submit: a
    clear error, then the same uids can be pushed/scored, the backlog estimate is what it
    was, nothing of the call is queued and no waiter is left."""
    cfg = ProducerConfig(namespace=namespace, max_message_bytes=4096, backlog_poll_s=1000)
    async with RolloutProducer(redis_url, cfg) as p:
        await p.open_batch("e", 20, 8)
        await p.push(traj("e", 19))
        if p._backlog_reading is not None:
            await p._backlog_reading  # no other reading for 1000 s: the estimate holds still
        before = p._backlog
        fields, error = BAD[kind]
        good = [traj("e", i) for i in range(3)]
        bad = Trajectory("e", 1, "test/exact", **{"response": "r1", "ground_truth": "1", **fields})
        assert bad.uid == good[1].uid
        with pytest.raises(error):
            if path == "score":
                await asyncio.wait_for(p.score(bad, timeout_s=5), 5)
            else:
                await asyncio.wait_for(p.push_many([good[0], bad, good[2]]), 5)
        assert p._backlog == before, (p._backlog, before)
        reserved = [t.uid for t in good if t.uid in p._uids("e")]
        assert reserved == [], f"uids left reserved after a failed encode: {reserved}"
        assert await queued(redis_url, p.keys) == [("e", "e/19", 19)]
        if p._listener is not None:
            clean(p._listener)
        if path == "push_many":
            assert await p.push_many(good) == 3
        else:
            async with worker(redis_url, namespace):
                r = await asyncio.wait_for(p.score(good[1], timeout_s=10), 15)
            assert (r.uid, r.score) == (good[1].uid, expected(good[1]))
            clean(p._listener)


# --- 3. max_backlog reached


@pytest.mark.parametrize("mode", ["raise", "wait"])
async def test_score_refused_or_given_up_at_max_backlog_releases_its_uid_and_count(redis_url, namespace, mode) -> None:
    """Attacks the split room check (_has_room / _make_room / _count) on score()'s path: a
    BackpressureError ("raise") or a cancel while waiting for room ("wait") leaves no uid
    reserved, no waiter, and the backlog estimate uncounted; the same uids score fine once
    workers drained the backlog."""
    cfg = ProducerConfig(namespace=namespace, max_backlog=3, on_backlog=mode, backlog_poll_s=0.02)
    async with RolloutProducer(redis_url, cfg) as p:
        await p.open_batch("b", 40, 8)
        await p.push_many([traj("b", i) for i in range(30, 33)])  # the backlog is full
        await asyncio.sleep(0.05)
        samples = [traj("b", i) for i in range(10)]
        if mode == "raise":
            got = await settle([p.score(t, timeout_s=5) for t in samples], 5)
            assert all(isinstance(g, BackpressureError) for g in got), got
        else:
            tasks = [asyncio.ensure_future(p.score(t, timeout_s=5)) for t in samples]
            await asyncio.sleep(0.3)
            assert not any(x.done() for x in tasks), [x for x in tasks if x.done()]
            for x in tasks:
                x.cancel()
            got = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(isinstance(g, asyncio.CancelledError) for g in got), got
        assert [t.uid for t in samples if t.uid in p._uids("b")] == []
        assert p._backlog == 3, p._backlog
        if p._listener is not None:
            clean(p._listener)
        assert sorted(i for _, _, i in await queued(redis_url, p.keys)) == [30, 31, 32]
        async with worker(redis_url, namespace):
            await wait_until(lambda: _zero(p.backlog()), 10, 0.02)  # drained: room again
            await asyncio.sleep(0.05)  # past backlog_poll_s: the next push reads the backlog again
            rs = await asyncio.wait_for(asyncio.gather(*(p.score(t, timeout_s=10) for t in samples[:3])), 15)
        assert [r.score for r in rs] == [expected(t) for t in samples[:3]]
        clean(p._listener)


# --- 4. A result the listener already holds


@pytest.mark.parametrize("how", ["kept_by_result", "landed_before_push"])
async def test_score_of_a_uid_whose_result_is_known_returns_it_at_once(redis_url, namespace, how) -> None:
    """Attacks watch()'s landed path and the DUPLICATE reread: a second producer's score() of
    a sample already scored gets that result with no worker running, promptly, through a
    single or a multi-sample flush, and leaves no waiter or timeout behind."""
    cfg = ProducerConfig(namespace=namespace, partitions=2)
    samples = [traj("k", i, group=f"g{i % 3}") for i in range(12)]
    async with RolloutProducer(redis_url, cfg) as p1, RewardAggregator(redis_url, namespace=namespace) as agg:
        await p1.open_batch("k", 20, 8)
        async with worker(redis_url, namespace, partitions=2):
            if how == "kept_by_result":
                await asyncio.wait_for(asyncio.gather(*(p1.score(t, timeout_s=10) for t in samples)), 15)
                for t in samples:  # the shared listener now keeps both done streams
                    assert (await agg.result("k", t.uid, timeout_s=5)).score == expected(t)
            else:
                await p1.push_many(samples)
                await asyncio.wait_for(asyncio.gather(*(_landed(redis_url, p1, t) for t in samples)), 15)
        # No worker from here: only what landed can answer.
        async with RolloutProducer(redis_url, cfg) as p2:
            loop = asyncio.get_running_loop()
            start = loop.time()
            alone = await asyncio.wait_for(p2.score(samples[0], timeout_s=None), 3)
            together = await asyncio.wait_for(asyncio.gather(*(p2.score(t, timeout_s=5) for t in samples[1:])), 4)
            assert loop.time() - start < 3
            assert [r.score for r in [alone, *together]] == [expected(t) for t in samples]
            await asyncio.sleep(0.02)
            clean(p2._listener)


# --- 5. Timeouts


@pytest.mark.parametrize("when", ["expire", "cancel_after_verdict", "cancel_as_verdict_lands", "result_calls"])
async def test_timed_out_or_cancelled_calls_leave_no_armed_timeout(redis_url, namespace, when) -> None:
    """Attacks the tick arm() returns (kept on the call, handed to unwatch/forget): score()
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


# --- 6. Others


async def test_a_waiter_registered_as_another_is_resolved_is_not_dropped_by_its_unwatch(
    redis_url, namespace, monkeypatch
) -> None:
    """Attacks _drop_waiter's single-waiter fast path: _land pops and resolves score() A's
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


@pytest.mark.parametrize("verdict", ["fresh", "duplicate", "conflict", "failed_flush"])
async def test_the_backlog_estimate_counts_only_what_score_queued(redis_url, namespace, verdict) -> None:
    """Attacks _ScoreCall.apply's backlog correction (readings held off): a FRESH push adds
    one to the estimate, and so does a DUPLICATE (it may be this call's own sample, found by a
    send retried after its reply was lost: the estimate errs high until the next reading,
    never low), and so does a failed flush (its sample may have been queued before the reply
    was lost); a refusal adds nothing; the refused or failed sample's uid is free again."""
    cfg = ProducerConfig(namespace=namespace, backlog_poll_s=1000)
    async with RolloutProducer(redis_url, cfg) as a, RolloutProducer(redis_url, cfg) as p:
        await a.open_batch("c", 10, 8)
        await a.push_many([traj("c", 0), traj("c", 1, uid="taken")])
        await p.push(traj("c", 9))
        if p._backlog_reading is not None:
            await p._backlog_reading
        before = p._backlog
        t = {"fresh": traj("c", 2), "duplicate": traj("c", 0), "conflict": traj("c", 1, uid="mine")}.get(
            verdict, traj("c", 3)
        )
        if verdict == "failed_flush":

            async def broken(calls: list, cluster: bool) -> list:  # the flush's round trip fails
                raise BrokerError("injected")

            p._call_push = broken  # type: ignore[method-assign]
        got = await outcome(asyncio.wait_for(p.score(t, timeout_s=0.1), 5))
        error, added, kept = {
            "fresh": (ResultTimeoutError, 1, True),
            "duplicate": (ResultTimeoutError, 1, True),
            "conflict": (PushConflictError, 0, False),
            "failed_flush": (BrokerError, 1, False),
        }[verdict]
        assert isinstance(got, error), got
        assert p._backlog - before == added, (p._backlog, before)
        assert (t.uid in p._uids("c")) == kept
        clean(p._listener)


async def _landed(redis_url: str, p: RolloutProducer, t: Trajectory) -> None:
    """Until t's result is in its done stream (read directly: the listener must not keep it)."""
    from stream_reward.wire.connection import connect

    client = connect(redis_url)
    done = p.keys.done(t.batch_id, p.keys.partition_of(t.uid, t.group), p.config.group)

    async def there() -> bool:
        return any(r.uid == t.uid for r in await done_results(client, done))

    try:
        await wait_until(there, 10, 0.02)
    finally:
        await client.aclose()
