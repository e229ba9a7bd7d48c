"""One ``score()`` call from its push to its result (trainer/samples.py's ``_ScoreCall``).

It promises: a cancel at any point leaks no uid reservation, waiter, timeout, backlog
count or logged error; a refusal or a failed flush raises at once, to the right caller
only, never as a timeout; ``timeout_s`` counts from the queueing; a close ends every
caller; a duplicate gets its result; a sample that fails to encode reserves nothing;
and a finished call leaves no reference cycle for the garbage collector. A refused score
never returns another sample's result; a push or a score pending at ``aclose`` gets an
error, not a hang or a cancel.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import time

import pytest
from helpers import (
    IdentityScorer,
    LoopLag,
    Timed,
    done_results,
    identity_worker,
    no_waiters,
    queued,
    running_worker,
    sample_traj,
    traj,
    wait_until,
)
from trainer_support import clean, expected, outcome

from stream_reward import (
    ProducerConfig,
    RewardAggregator,
    RolloutProducer,
    ScoreResult,
    SyncRolloutProducer,
    Trajectory,
)
from stream_reward.errors import (
    BackpressureError,
    BrokerError,
    CodecError,
    ConfigError,
    PayloadTooLargeError,
    PushConflictError,
    ResultTimeoutError,
)
from stream_reward.scoring.scorer import Scored
from stream_reward.trainer import listener as listener_mod
from stream_reward.wire.connection import connect

pytestmark = pytest.mark.anyio


class Ident:
    """Scores a sample by its identity (index + len(response)/1000): a wrong result shows."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay

    async def score(self, t: Trajectory) -> Scored:
        if self.delay:
            await asyncio.sleep(self.delay)
        return Scored(t.index + len(t.response) / 1000)


def worker(redis_url: str, namespace: str, delay: float = 0.0, **cfg):
    return running_worker(redis_url, namespace, Ident(delay), **cfg)


@contextlib.contextmanager
def loop_noise():
    """Everything the loop's exception handler hears inside the block (and at a gc.collect at its end)."""
    loop = asyncio.get_running_loop()
    heard: list[str] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _l, ctx: heard.append(f"{ctx.get('message')}: {ctx.get('exception')!r}"))
    try:
        yield heard
        gc.collect()
    finally:
        loop.set_exception_handler(previous)


class Gate:
    """A flush replacement: signals it started, waits to be opened, then flushes (or raises)."""

    def __init__(self, p: RolloutProducer, *, fail: BaseException | None = None, delay: float = 0.0) -> None:
        self.p = p
        self.real = p._flush
        self.started = asyncio.Event()
        self.opened = asyncio.Event()
        self.done = asyncio.Event()
        self.fail = fail
        self.delay = delay
        self.calls: list[int] = []
        self.ended_at: float | None = None
        self.on_return = None  # called after the flush returned, before the verdicts are set
        if delay:
            self.opened.set()  # a slow flush: open at once, it only sleeps
        p._coalescer, p._flush = None, self.flush  # type: ignore[method-assign]

    async def flush(self, entries: list) -> list[int]:
        self.calls.append(len(entries))
        self.started.set()
        try:
            await self.opened.wait()
            if self.delay:
                await asyncio.sleep(self.delay)
            if self.fail is not None:
                raise self.fail
            verdicts = await self.real(entries)
            if self.on_return is not None:
                self.on_return()
            return verdicts
        finally:
            self.ended_at = time.monotonic()
            self.done.set()

    def restore(self) -> None:
        self.p._coalescer, self.p._flush = None, self.real  # type: ignore[method-assign]


async def uid_invariant(redis_url: str, p: RolloutProducer, t: Trajectory) -> str:
    """After a cancelled score(t): its uid is reserved only if t is queued; a free uid can be
    scored again (the worker must be running) and returns t's result. Returns which case."""
    in_redis = (t.batch_id, t.uid, t.index) in await queued(redis_url, p.keys)
    if not in_redis and t.uid in p._uids(t.batch_id):  # a worker may have scored and deleted its entry
        async with RewardAggregator(redis_url, namespace=p.config.namespace) as agg:
            in_redis = isinstance(await outcome(agg.result(t.batch_id, t.uid, timeout_s=2)), ScoreResult)
    if t.uid in p._uids(t.batch_id):
        assert in_redis, f"uid {t.uid!r} left reserved for a sample that was never queued"
        with pytest.raises(ConfigError, match="pushed twice"):
            await p.score(t, timeout_s=5)
        return "reserved"
    r = await asyncio.wait_for(p.score(t, timeout_s=10), 15)
    assert (r.uid, r.score) == (t.uid, expected(t))
    return "free"


POINTS = [
    "in_submit",
    "queued_not_taken",
    "flush_in_flight",
    "as_verdict_lands",
    "after_verdict",
    "as_result_lands",
    "result_before_verdict",
]


async def _is_queued(redis_url: str, p: RolloutProducer, t: Trajectory) -> bool:
    return (t.batch_id, t.uid, t.index) in await queued(redis_url, p.keys)


def worker_score_call(url: str, ns: str, **cfg):
    """An in-process worker_score_call scoring by identity (helpers.Timed: index + len(response)/1000)."""
    return running_worker(url, ns, Timed(), **cfg)


BAD = {  # a sample (index 1 of batch "e") that cannot be encoded, and what it raises
    "too_large": ({"response": "x" * 10_000}, PayloadTooLargeError),
    "not_msgpackable": ({"extra_info": {"o": object()}}, CodecError),
    # Ids given as a one-shot iterable pass pack_ids (array() takes any iterable) and fail
    # at len() when _entry reads traj.response_length: it must raise before it reserves the uid.
    "ids_without_len": ({"response_ids": iter([1, 2, 3])}, TypeError),
}


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


SCORER = "python:tests/data/scorers.py:exact"


# Cancels at every point


@pytest.mark.parametrize("point", POINTS)
async def test_a_score_cancelled_at_each_point_leaks_nothing_and_the_producer_keeps_working(
    redis_url, namespace, point, monkeypatch
) -> None:
    cfg = ProducerConfig(namespace=namespace)
    with loop_noise() as heard:
        async with RolloutProducer(redis_url, cfg) as p, RewardAggregator(redis_url, namespace=namespace) as agg:
            await p.open_batch("c", 20, 8)
            t = traj("c", 0)
            async with contextlib.AsyncExitStack() as stack:
                if point == "in_submit":
                    p._groups_ready = False  # the push asks Redis first (an await inside _submit)
                    task = asyncio.ensure_future(p.score(t, timeout_s=5))
                    await asyncio.sleep(0)
                    assert p._coalescer is None or not p._coalescer._pending
                    task.cancel()
                elif point == "queued_not_taken":
                    await p.push(traj("c", 19))  # coalescer and groups ready
                    task = asyncio.ensure_future(p.score(t, timeout_s=5))
                    await asyncio.sleep(0)
                    assert p._coalescer is not None and len(p._coalescer._pending) == 1
                    task.cancel()
                elif point == "flush_in_flight":
                    gate = Gate(p)
                    task = asyncio.ensure_future(p.score(t, timeout_s=5))
                    await asyncio.wait_for(gate.started.wait(), 5)
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    gate.opened.set()
                    await asyncio.wait_for(gate.done.wait(), 5)
                    await asyncio.sleep(0.05)
                    gate.restore()
                elif point == "as_verdict_lands":
                    # Cancelled in the very loop turn its verdict is set (the callback runs in
                    # the flush task, with the caller's cancel pending).
                    gate = Gate(p)
                    task = asyncio.ensure_future(p.score(t, timeout_s=5))
                    gate.on_return = task.cancel
                    await asyncio.wait_for(gate.started.wait(), 5)
                    gate.opened.set()
                    await asyncio.wait_for(gate.done.wait(), 5)
                    await asyncio.gather(task, return_exceptions=True)
                    gate.restore()
                elif point == "after_verdict":
                    task = asyncio.ensure_future(p.score(t, timeout_s=5))  # no worker yet
                    await wait_until(lambda: _is_queued(redis_url, p, t), 5, 0.01)
                    await asyncio.sleep(0.05)
                    assert not task.done()
                    task.cancel()
                elif point == "as_result_lands":
                    await stack.enter_async_context(worker(redis_url, namespace))
                    holder: list[asyncio.Task] = []
                    real_land = listener_mod._Reader._land

                    def land(name, followed, entries):
                        real_land(name, followed, entries)
                        if holder and not holder[0].done():
                            holder[0].cancel()

                    monkeypatch.setattr(listener_mod._Reader, "_land", staticmethod(land))
                    task = asyncio.ensure_future(p.score(t, timeout_s=5))
                    holder.append(task)
                elif point == "result_before_verdict":
                    await stack.enter_async_context(worker(redis_url, namespace))
                    first = await p.score(t, timeout_s=10)
                    kept = await agg.result("c", t.uid, timeout_s=10)  # the shared listener keeps it
                    assert kept.score == first.score
                    async with RolloutProducer(redis_url, cfg) as p2:
                        gate = Gate(p2)
                        task = asyncio.ensure_future(p2.score(t, timeout_s=5))
                        await asyncio.wait_for(gate.started.wait(), 5)
                        await asyncio.sleep(0.02)
                        assert not task.done()
                        task.cancel()
                        got = await outcome(task)
                        assert isinstance(got, asyncio.CancelledError), got
                        gate.opened.set()
                        await asyncio.wait_for(gate.done.wait(), 5)
                        await asyncio.sleep(0.05)
                        gate.restore()
                        no_waiters(p2)
                        assert t.uid not in p2._uids("c")  # given up before its verdict: free
                        again = await asyncio.wait_for(p2.score(t, timeout_s=10), 15)
                        assert again.score == first.score
                        fresh = traj("c", 5)
                        assert (await asyncio.wait_for(p2.score(fresh, timeout_s=10), 15)).score == expected(fresh)
                        no_waiters(p2)
                    no_waiters(p)
                else:  # pragma: no cover
                    raise AssertionError(point)
                if point != "result_before_verdict":
                    got = await asyncio.wait_for(outcome(task), 10)
                    if point == "as_result_lands":
                        assert isinstance(got, (asyncio.CancelledError, ScoreResult)), got
                        monkeypatch.undo()
                    else:
                        assert isinstance(got, asyncio.CancelledError), got
                    await asyncio.sleep(0.05)
                    no_waiters(p)
                    assert p._backlog >= 0
                    if point in ("in_submit", "queued_not_taken"):
                        assert await queued(redis_url, p.keys) in ([], [("c", "c/19", 19)])
                        assert t.uid not in p._uids("c")
                    if point != "as_result_lands":
                        await stack.enter_async_context(worker(redis_url, namespace))
                    await uid_invariant(redis_url, p, t)
                    # The producer keeps working.
                    fresh = [traj("c", i) for i in range(1, 6)]
                    rs = await asyncio.wait_for(asyncio.gather(*(p.score(f, timeout_s=10) for f in fresh)), 15)
                    assert [r.score for r in rs] == [expected(f) for f in fresh]
                    no_waiters(p)
                del task
    assert heard == [], heard


async def test_chaos_cancels_failures_refusals_and_results_keep_every_invariant(redis_url, namespace) -> None:
    """Flushes that fail now and then, callers cancelled at random turns, refusals and fresh
    samples mixed, two flushes in flight: each caller ends with an allowed outcome and
    nothing is left behind."""
    import random

    rng = random.Random(7)
    cfg = ProducerConfig(namespace=namespace, coalesce_in_flight=2, coalesce_max_entries=7)
    n = 150
    with loop_noise() as heard:
        async with (
            worker(redis_url, namespace, delay=0.001),
            RolloutProducer(redis_url, cfg) as a,
            RolloutProducer(redis_url, cfg) as p,
        ):
            await a.open_batch("ch", 2 * n, 8)
            await a.push_many(traj("ch", i, uid=f"t{i}") for i in range(0, n, 5))  # every fifth index taken
            await p.push(traj("ch", 2 * n - 1))
            real = p._flush
            count = 0

            async def flaky(entries: list) -> list[int]:
                nonlocal count
                count += 1
                await asyncio.sleep(rng.random() * 0.01)
                if count % 3 == 0:
                    raise BrokerError(f"flaky flush {count}")
                return await real(entries)

            p._coalescer, p._flush = None, flaky  # type: ignore[method-assign]
            samples = [traj("ch", i) for i in range(n)]
            tasks = [asyncio.ensure_future(p.score(t, timeout_s=10)) for t in samples]
            for _ in range(40):
                await asyncio.sleep(rng.random() * 0.003)
                rng.choice(tasks).cancel()
            got = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 20)
            p._coalescer, p._flush = None, real  # type: ignore[method-assign]
            bad = []
            for t, g in zip(samples, got):
                if isinstance(g, ScoreResult):
                    ok = g.uid == t.uid and g.score == expected(t) and t.index % 5 != 0
                elif isinstance(g, PushConflictError):
                    ok = t.index % 5 == 0
                else:
                    ok = isinstance(g, (BrokerError, asyncio.CancelledError)) and not isinstance(g, ResultTimeoutError)
                if not ok:
                    bad.append((t.uid, g))
            assert not bad, bad[:5]
            await asyncio.sleep(0.1)
            no_waiters(p)
            in_redis = set(await queued(redis_url, p.keys))
            for t, g in zip(samples, got):
                if t.uid in p._uids("ch"):
                    assert ("ch", t.uid, t.index) in in_redis, (t.uid, g)
                if isinstance(g, (BrokerError, PushConflictError)):
                    assert t.uid not in p._uids("ch"), (t.uid, g)
            assert p._backlog >= 0
            del tasks, got
    assert heard == [], heard


async def test_cancels_sprayed_over_many_loop_turns_leave_nothing_behind(redis_url, namespace) -> None:
    """Many score() calls, each cancelled after its own number of loop turns (some before the
    flush is taken, some with the flush in flight, some after their verdict or result)."""
    cfg = ProducerConfig(namespace=namespace, coalesce_in_flight=1, coalesce_max_entries=8)
    n = 120
    with loop_noise() as heard:
        async with worker(redis_url, namespace), RolloutProducer(redis_url, cfg) as p:
            await p.open_batch("s", 2 * n, 8)
            await p.score(traj("s", 2 * n - 1), timeout_s=10)  # warm
            samples = [traj("s", i) for i in range(n)]
            tasks = [asyncio.ensure_future(p.score(t, timeout_s=10)) for t in samples]
            for turn in range(n):
                tasks[turn].cancel()
                await asyncio.sleep(0 if turn % 3 else 0.002)
            got = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 20)
            assert all(isinstance(g, (asyncio.CancelledError, ScoreResult)) for g in got), [
                g for g in got if not isinstance(g, (asyncio.CancelledError, ScoreResult))
            ]
            await asyncio.sleep(0.2)
            no_waiters(p)
            cases = [await uid_invariant(redis_url, p, t) for t in samples]
            assert "free" in cases  # some were cancelled before their verdict
            no_waiters(p)
            del tasks, got
    assert heard == [], heard


async def test_a_score_whose_pending_verdict_the_runner_cancels_still_ends(redis_url, namespace) -> None:
    """The coalescer runner cancelled (the producer closing under its callers, as at loop
    teardown) cancels verdicts not yet flushed: score() must end (at the latest at its
    timeout), not wait for a result of a sample that was never queued."""
    cfg = ProducerConfig(namespace=namespace, coalesce_in_flight=1, coalesce_max_entries=5)
    async with RolloutProducer(redis_url, cfg) as p:
        await p.open_batch("k", 40, 8)
        gate = Gate(p)
        tasks = [asyncio.ensure_future(p.score(traj("k", i), timeout_s=0.5)) for i in range(20)]
        await asyncio.wait_for(gate.started.wait(), 5)
        assert p._coalescer is not None and p._coalescer._pending
        p._coalescer._runner.cancel()
        done, pending = await asyncio.wait(tasks, timeout=4)
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        gate.restore()
        assert not pending, f"{len(pending)} of 20 score(timeout_s=0.5) calls still pending 4 s after the cancel"
        in_redis = await queued(redis_url, p.keys)
        leaked = [i for i in range(20) if f"k/{i}" in p._uids("k") and ("k", f"k/{i}", i) not in in_redis]
        assert not leaked, leaked


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


# Refusals and failed flushes


async def test_a_result_before_a_failing_verdict_raises_the_flush_error(redis_url, namespace) -> None:
    """The listener already holds the uid's result (result() asked for it), so score()'s
    result future resolves at once; its own push then fails. score() must raise the flush's
    error (its sample was not queued by it), promptly, and free its uid."""
    cfg = ProducerConfig(namespace=namespace)
    with loop_noise() as heard:
        async with (
            worker(redis_url, namespace),
            RolloutProducer(redis_url, cfg) as p,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await p.open_batch("rb", 10, 8)
            t = traj("rb", 0)
            await p.score(t, timeout_s=10)
            await agg.result("rb", t.uid, timeout_s=10)
            async with RolloutProducer(redis_url, cfg) as p2:
                await p2.push(traj("rb", 9))
                injected = BrokerError("failed after the result was known")
                gate = Gate(p2, fail=injected, delay=0.2)
                got = await asyncio.wait_for(outcome(p2.score(t)), 5)
                assert got is injected, got
                assert t.uid not in p2._uids("rb")
                no_waiters(p2)
                gate.restore()
    assert heard == [], heard


async def test_a_refused_score_raises_promptly_not_at_its_timeout(redis_url, namespace) -> None:
    cfg = ProducerConfig(namespace=namespace)
    async with RolloutProducer(redis_url, cfg) as a, RolloutProducer(redis_url, cfg) as b:
        await a.open_batch("r", 8, 8)
        await a.push_many([traj("r", 0, uid="taken"), traj("r", 1, uid="content")])
        for timeout in (None, 30.0, math.inf, math.nan, 0.0):
            for bad, reason in (
                (traj("r", 0, uid=f"other-{timeout}"), "another uid"),
                (traj("r", 1, uid="content", response="changed"), "other content"),
            ):
                start = time.monotonic()
                async with LoopLag() as lag:
                    with pytest.raises(PushConflictError, match=reason):
                        await asyncio.wait_for(b.score(bad, timeout_s=timeout), 3)
                # A round trip, not a timeout: a second, plus however long the loop stalled.
                assert time.monotonic() - start < 1.0 + lag.worst_s
                assert bad.uid not in b._uids("r")
        no_waiters(b)


async def test_refused_and_accepted_scores_in_one_flush_each_get_their_own_outcome(redis_url, namespace) -> None:
    cfg = ProducerConfig(namespace=namespace, coalesce_max_entries=4096)
    with loop_noise() as heard:
        async with (
            worker(redis_url, namespace),
            RolloutProducer(redis_url, cfg) as a,
            RolloutProducer(redis_url, cfg) as b,
        ):
            await a.open_batch("m", 400, 8)
            base = [traj("m", i, uid=f"u{i}") for i in range(40)]
            await a.push_many(base)
            await b.push(traj("m", 399))  # b's groups ready: no await before the coalescer
            gate = Gate(b)
            plan: list[tuple[Trajectory, str]] = []
            for i in range(40):
                k = i % 4
                if k == 0:
                    plan.append((traj("m", i, uid=f"u{i}", response="other"), "conflict"))  # other content
                elif k == 1:
                    plan.append((traj("m", i, uid=f"v{i}"), "conflict"))  # index taken
                elif k == 2:
                    plan.append((base[i], "ok"))  # DUPLICATE of a's push
                else:
                    plan.append((traj("m", 100 + i, uid=f"w{i}"), "ok"))  # fresh
            # Two fresh uids racing for one fresh index in the same flush: one wins.
            pairs = [(traj("m", 300 + j, uid=f"x{j}"), traj("m", 300 + j, uid=f"y{j}")) for j in range(10)]
            for x, y in pairs:
                plan.append((x, "ok"))
                plan.append((y, "conflict"))
            tasks = [asyncio.ensure_future(b.score(t, timeout_s=20)) for t, _ in plan]
            await asyncio.wait_for(gate.started.wait(), 5)
            await asyncio.sleep(0.05)
            gate.opened.set()
            got = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 25)
            assert gate.calls == [len(plan)], gate.calls  # all in one flush
            for (t, want), g in zip(plan, got):
                if want == "ok":
                    assert isinstance(g, ScoreResult) and (g.uid, g.score) == (t.uid, expected(t)), (t.uid, g)
                else:
                    assert isinstance(g, PushConflictError) and g.uid == t.uid, (t.uid, g)
                    assert t.uid not in b._uids("m") or t.uid.startswith("u"), t.uid
            no_waiters(b)
            assert b._backlog >= 0
            gate.restore()
            del tasks, got
    assert heard == [], heard


@pytest.mark.parametrize("kind", ["broker", "runtime", "redis_down"])
async def test_a_failing_flush_fails_each_of_its_scores_promptly_and_later_scores_work(
    redis_url, namespace, kind
) -> None:
    cfg = ProducerConfig(namespace=namespace, coalesce_max_entries=4096)
    n = 30
    with loop_noise() as heard:
        async with RolloutProducer(redis_url, cfg) as p:
            await p.open_batch("f", 2 * n, 8)
            await p.push(traj("f", 2 * n - 1))  # script loaded, groups ready
            samples = [traj("f", i) for i in range(n)]
            injected: BaseException | None = None
            gate = None
            real_client = None
            if kind == "broker":
                injected = BrokerError("injected broker error")
                gate = Gate(p, fail=injected, delay=0.1)
            elif kind == "runtime":
                injected = RuntimeError("injected bug")
                gate = Gate(p, fail=injected, delay=0.1)
            else:
                real_client, p._client = p._client, connect("redis://127.0.0.1:1")
            start = time.monotonic()
            got = await asyncio.wait_for(
                asyncio.gather(*(p.score(t, timeout_s=None) for t in samples), return_exceptions=True), 10
            )
            took = time.monotonic() - start
            if injected is not None:
                assert all(g is injected for g in got), got
            else:
                assert all(isinstance(g, BrokerError) for g in got), got
            assert took < 5, took
            no_waiters(p)
            assert not any(t.uid in p._uids("f") for t in samples)
            if gate is not None:
                gate.restore()
            else:
                bad, p._client = p._client, real_client
                await bad.aclose()
            async with worker(redis_url, namespace):
                rs = await asyncio.wait_for(asyncio.gather(*(p.score(t, timeout_s=10) for t in samples)), 20)
            assert [r.score for r in rs] == [expected(t) for t in samples]
            no_waiters(p)
            del got
    assert heard == [], heard


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


@pytest.mark.parametrize("path", ["score", "push_many"])
@pytest.mark.parametrize("kind", list(BAD))
async def test_a_sample_that_fails_to_encode_reserves_nothing_and_counts_nothing(
    redis_url, namespace, kind, path
) -> None:
    """_entry (encode before reserve) in score() and in push_many's _submit: a
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
            async with worker_score_call(redis_url, namespace):
                r = await asyncio.wait_for(p.score(good[1], timeout_s=10), 15)
            assert (r.uid, r.score) == (good[1].uid, expected(good[1]))
            clean(p._listener)


# Timeouts


async def test_the_timeout_counts_from_the_queueing_never_before(redis_url, namespace) -> None:
    cfg = ProducerConfig(namespace=namespace, coalesce_max_entries=4096)
    async with RolloutProducer(redis_url, cfg) as p:
        await p.open_batch("t", 40, 8)
        gate = Gate(p, delay=0.4)
        start = time.monotonic()
        async with LoopLag() as lag:
            got = await asyncio.wait_for(
                asyncio.gather(*(p.score(traj("t", i), timeout_s=0.25) for i in range(20)), return_exceptions=True), 10
            )
        end = time.monotonic()
        assert all(isinstance(g, ResultTimeoutError) for g in got), got
        assert gate.ended_at is not None
        assert end - gate.ended_at >= 0.25 - 0.01, end - gate.ended_at  # never early
        # and not much late: a second, plus however long the loop itself did not run
        assert end - start < 0.4 + 0.25 + 1.0 + lag.worst_s, (end - start, lag.worst_s)
        assert len(await queued(redis_url, p.keys)) == 20  # still queued
        no_waiters(p)
        gate.restore()


@pytest.mark.parametrize("timeout", [0.0, -1.0, -math.inf])
async def test_a_zero_or_negative_timeout_raises_timeout_once_queued(redis_url, namespace, timeout) -> None:
    cfg = ProducerConfig(namespace=namespace)
    with loop_noise() as heard:
        async with RolloutProducer(redis_url, cfg) as p:
            await p.open_batch("z", 40, 8)
            gate = Gate(p, delay=0.2)
            start = time.monotonic()
            got = await asyncio.wait_for(
                asyncio.gather(*(p.score(traj("z", i), timeout_s=timeout) for i in range(10)), return_exceptions=True),
                5,
            )
            assert all(isinstance(g, ResultTimeoutError) for g in got), got
            assert time.monotonic() - start >= 0.2 - 0.01  # after the queueing, not before
            assert len(await queued(redis_url, p.keys)) == 10
            no_waiters(p)
            gate.restore()
            del got
    assert heard == [], heard


@pytest.mark.parametrize("timeout", [math.inf, math.nan, 1e300])
async def test_an_infinite_or_nan_timeout_never_fires_and_the_result_still_comes(redis_url, namespace, timeout) -> None:
    cfg = ProducerConfig(namespace=namespace)
    with loop_noise() as heard:
        async with RolloutProducer(redis_url, cfg) as p:
            await p.open_batch("i", 10, 8)
            samples = [traj("i", i) for i in range(5)]
            tasks = [asyncio.ensure_future(p.score(t, timeout_s=timeout)) for t in samples]
            await asyncio.sleep(0.5)
            assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
            async with worker(redis_url, namespace):
                rs = await asyncio.wait_for(asyncio.gather(*tasks), 15)
            assert [r.score for r in rs] == [expected(t) for t in samples]
            no_waiters(p)
    assert heard == [], heard


@pytest.mark.parametrize("timeout", [0.0, -1.0, 0.01])
async def test_never_a_timeout_when_the_push_failed_or_was_refused(redis_url, namespace, timeout) -> None:
    cfg = ProducerConfig(namespace=namespace)
    async with RolloutProducer(redis_url, cfg) as a, RolloutProducer(redis_url, cfg) as p:
        await a.open_batch("n", 40, 8)
        await a.push(traj("n", 0, uid="taken"))
        refused = await outcome(asyncio.wait_for(p.score(traj("n", 0, uid="mine"), timeout_s=timeout), 5))
        assert isinstance(refused, PushConflictError), refused
        gate = Gate(p, fail=BrokerError("down"), delay=0.1)
        got = await asyncio.wait_for(
            asyncio.gather(*(p.score(traj("n", i), timeout_s=timeout) for i in range(1, 11)), return_exceptions=True), 5
        )
        assert all(isinstance(g, BrokerError) and not isinstance(g, ResultTimeoutError) for g in got), got
        no_waiters(p)
        gate.restore()


# Closing, duplicates, known results


async def test_closing_under_many_pending_scores_ends_every_caller_and_logs_nothing(redis_url, namespace) -> None:
    cfg = ProducerConfig(namespace=namespace, coalesce_in_flight=1, coalesce_max_entries=50)
    with loop_noise() as heard:
        p = RolloutProducer(redis_url, cfg)
        await p.open_batch("x", 400, 8)
        await p.push(traj("x", 399))
        waiting = [asyncio.ensure_future(p.score(traj("x", i))) for i in range(50)]  # queued: await results
        await asyncio.sleep(0.2)
        gate = Gate(p, delay=0.3)
        in_flight = [asyncio.ensure_future(p.score(traj("x", i), timeout_s=30)) for i in range(50, 100)]
        await asyncio.wait_for(gate.started.wait(), 5)
        behind = [asyncio.ensure_future(p.score(traj("x", i), timeout_s=30)) for i in range(100, 250)]  # next flushes
        await asyncio.sleep(0)
        closing = asyncio.ensure_future(p.aclose())
        late = [asyncio.ensure_future(p.score(traj("x", i))) for i in range(250, 260)]  # called during the close
        everyone = waiting + in_flight + behind + late
        done, pending = await asyncio.wait(everyone + [closing], timeout=8)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await p.aclose()
        assert not pending, f"{len(pending)} callers still pending 8 s after aclose()"
        bad = [
            t.exception() for t in everyone if t.exception() is not None and not isinstance(t.exception(), BrokerError)
        ]
        assert not bad, bad[:5]
        del waiting, in_flight, behind, late, everyone, done, pending, closing
    assert heard == [], heard


async def test_async_with_exit_with_results_landing_and_flushes_in_flight(redis_url, namespace) -> None:
    cfg = ProducerConfig(namespace=namespace, coalesce_in_flight=1, coalesce_max_entries=20)
    with loop_noise() as heard:
        async with worker(redis_url, namespace, delay=0.01):
            tasks: list[asyncio.Task] = []
            async with RolloutProducer(redis_url, cfg) as p:
                await p.open_batch("y", 300, 8)
                Gate(p, delay=0.05)
                tasks = [asyncio.ensure_future(p.score(traj("y", i), timeout_s=20)) for i in range(200)]
                await asyncio.sleep(0.15)
            done, pending = await asyncio.wait(tasks, timeout=8)
            for t in pending:
                t.cancel()
            assert not pending, f"{len(pending)} of {len(tasks)} score() calls hang after the producer closed"
            for t in tasks:
                exc = t.exception()
                assert exc is None or isinstance(exc, BrokerError), exc
                if exc is None:
                    assert t.result().score == expected(traj("y", tasks.index(t)))
            del tasks, done, pending
    assert heard == [], heard


async def test_duplicates_scored_concurrently_with_new_samples_get_their_results(redis_url, namespace) -> None:
    cfg = ProducerConfig(namespace=namespace, partitions=2, coalesce_max_entries=4096)
    with loop_noise() as heard:
        async with (
            worker(redis_url, namespace, delay=0.002, partitions=2) as _w,
            RolloutProducer(redis_url, cfg) as a,
            RolloutProducer(redis_url, cfg) as b,
        ):
            await a.open_batch("d", 200, 8)
            old = [traj("d", i) for i in range(40)]
            first = await asyncio.wait_for(asyncio.gather(*(a.score(t, timeout_s=10) for t in old)), 15)
            new = [traj("d", i) for i in range(40, 120)]
            mixed = [x for pair in zip(old, new) for x in pair] + new[len(old) :]
            got = await asyncio.wait_for(
                asyncio.gather(*(b.score(t, timeout_s=5) for t in mixed), return_exceptions=True), 20
            )
            wrong = [
                (t.uid, g) for t, g in zip(mixed, got) if not (isinstance(g, ScoreResult) and g.score == expected(t))
            ]
            assert not wrong, wrong[:5]
            assert [r.score for r in first] == [expected(t) for t in old]
            no_waiters(b)
            del got
    assert heard == [], heard


async def test_duplicates_of_a_fresh_producer_in_one_flush_with_fresh_ones(redis_url, namespace) -> None:
    cfg = ProducerConfig(namespace=namespace, coalesce_max_entries=4096)
    async with worker(redis_url, namespace), RolloutProducer(redis_url, cfg) as a:
        await a.open_batch("e", 200, 8)
        old = [traj("e", i) for i in range(30)]
        await asyncio.wait_for(asyncio.gather(*(a.score(t, timeout_s=10) for t in old)), 15)
        for round_ in range(3):
            async with RolloutProducer(redis_url, cfg) as b:
                await b.push(traj("e", 199 - round_))  # b's groups ready: no await before the coalescer
                gate = Gate(b)
                new = [traj("e", 30 + 30 * round_ + i) for i in range(30)]
                tasks = [asyncio.ensure_future(b.score(t, timeout_s=5)) for t in old + new]
                await asyncio.wait_for(gate.started.wait(), 5)
                gate.opened.set()
                got = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 15)
                assert gate.calls == [60], gate.calls
                wrong = [
                    (t.uid, g)
                    for t, g in zip(old + new, got)
                    if not isinstance(g, ScoreResult) or g.score != expected(t)
                ]
                assert not wrong, wrong[:5]
                no_waiters(b)
                gate.restore()


@pytest.mark.parametrize("how", ["kept_by_result", "landed_before_push"])
async def test_score_of_a_uid_whose_result_is_known_returns_it_at_once(redis_url, namespace, how) -> None:
    """watch()'s landed path and the DUPLICATE reread: a second producer's score() of
    a sample already scored gets that result with no worker_score_call running, promptly, through a
    single or a multi-sample flush, and leaves no waiter or timeout behind."""
    cfg = ProducerConfig(namespace=namespace, partitions=2)
    samples = [traj("k", i, group=f"g{i % 3}") for i in range(12)]
    async with RolloutProducer(redis_url, cfg) as p1, RewardAggregator(redis_url, namespace=namespace) as agg:
        await p1.open_batch("k", 20, 8)
        async with worker_score_call(redis_url, namespace, partitions=2):
            if how == "kept_by_result":
                await asyncio.wait_for(asyncio.gather(*(p1.score(t, timeout_s=10) for t in samples)), 15)
                for t in samples:  # the shared listener now keeps both done streams
                    assert (await agg.result("k", t.uid, timeout_s=5)).score == expected(t)
            else:
                await p1.push_many(samples)
                await asyncio.wait_for(asyncio.gather(*(_landed(redis_url, p1, t) for t in samples)), 15)
        # No worker_score_call from here: only what landed can answer.
        async with RolloutProducer(redis_url, cfg) as p2:
            loop = asyncio.get_running_loop()
            start = loop.time()
            alone = await asyncio.wait_for(p2.score(samples[0], timeout_s=None), 3)
            together = await asyncio.wait_for(asyncio.gather(*(p2.score(t, timeout_s=5) for t in samples[1:])), 4)
            assert loop.time() - start < 3
            assert [r.score for r in [alone, *together]] == [expected(t) for t in samples]
            await asyncio.sleep(0.02)
            clean(p2._listener)


# No garbage left per sample


async def test_finished_score_calls_leave_no_garbage_cycles(redis_url, namespace, spawn_workers) -> None:
    spawn_workers(1, "--scorer", SCORER)
    n = 300
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
        await producer.open_batch("gc", 2 * n, 4)
        warm = [Trajectory("gc", i, "test/exact", response="1", ground_truth="1") for i in range(n, 2 * n)]
        await asyncio.gather(*(producer.score(t, timeout_s=60) for t in warm))  # connections, scripts, listener
        gc.collect()
        gc.disable()
        try:
            samples = [Trajectory("gc", i, "test/exact", response="1", ground_truth="1") for i in range(n)]
            results = await asyncio.gather(*(producer.score(t, timeout_s=60) for t in samples))
            del samples
            cyclic = gc.collect()
        finally:
            gc.enable()
    assert [r.status for r in results] == ["ok"] * n
    # Whatever the client libraries leave now and then, not a cycle per sample.
    assert cyclic < n // 4, cyclic


@pytest.mark.parametrize("kind", ["refused", "failed_flush", "timed_out", "cancelled_queued", "cancelled_in_flight"])
async def test_score_calls_that_end_without_a_result_leave_no_garbage_cycles(redis_url, namespace, kind) -> None:
    n = 200
    cfg = ProducerConfig(namespace=namespace, coalesce_max_entries=4096)
    async with RolloutProducer(redis_url, cfg) as a, RolloutProducer(redis_url, cfg) as p:
        await a.open_batch("g", 3 * n, 8)
        await a.push_many(traj("g", i, uid=f"taken{i}") for i in range(n))
        # warm: connections, scripts, the listener
        await outcome(p.score(traj("g", 3 * n - 1), timeout_s=0))
        await outcome(p.score(traj("g", 0, uid="warm"), timeout_s=0))
        gate = None
        if kind == "failed_flush":
            gate = Gate(p, fail=BrokerError("x"))
            gate.opened.set()
        elif kind == "cancelled_in_flight":
            gate = Gate(p)
        gc.collect()
        gc.disable()
        try:
            if kind == "refused":
                coros = [p.score(traj("g", i, uid=f"mine{i}"), timeout_s=10) for i in range(1, n)]
            else:
                coros = [p.score(traj("g", n + i), timeout_s=0 if kind == "timed_out" else 10) for i in range(n)]
            tasks = [asyncio.ensure_future(c) for c in coros]
            del coros
            if kind == "cancelled_queued":
                await asyncio.sleep(0)
                for t in tasks:
                    t.cancel()
            elif kind == "cancelled_in_flight":
                assert gate is not None
                await asyncio.wait_for(gate.started.wait(), 5)
                for t in tasks:
                    t.cancel()
            got = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 15)
            kinds = {type(g).__name__ for g in got}
            if gate is not None:
                gate.opened.set()
                await asyncio.wait_for(gate.done.wait(), 5)
            await asyncio.sleep(0.05)
            del tasks, got
            cyclic = gc.collect()
        finally:
            gc.enable()
        if gate is not None:
            gate.restore()
        no_waiters(p)
    assert len(kinds) == 1, kinds
    assert cyclic < n // 4, (kind, kinds, cyclic)


async def test_a_kept_refusal_does_not_keep_the_rest_of_its_flush_alive(redis_url, namespace) -> None:
    """A trainer that keeps the PushConflictError of a refused score() (logs it, collects
    failures) must not keep the other samples of that coalesced flush alive with it: their
    payloads are megabytes. The refusal is raised and caught while the verdict callback runs;
    its traceback's frames must not lead back to the flush's own frame (which holds every
    entry of the flush)."""
    import tracemalloc

    cfg = ProducerConfig(namespace=namespace, coalesce_max_entries=4096)
    big = "z" * 200_000
    async with RolloutProducer(redis_url, cfg) as a, RolloutProducer(redis_url, cfg) as p:
        await a.open_batch("kr", 100, 8)
        await a.push(traj("kr", 0, uid="taken"))
        await p.push(traj("kr", 99))  # groups ready, script loaded
        await outcome(p.score(traj("kr", 98), timeout_s=0))  # listener started
        gc.collect()
        tracemalloc.start()
        try:
            samples = [Trajectory("kr", i, "test/exact", response=big + str(i), ground_truth="1") for i in range(1, 41)]
            refused = traj("kr", 0, uid="mine")
            got = await asyncio.wait_for(
                asyncio.gather(
                    p.score(refused, timeout_s=0), *(p.score(t, timeout_s=0) for t in samples), return_exceptions=True
                ),
                10,
            )
            kept = got[0]
            assert isinstance(kept, PushConflictError), kept
            assert all(isinstance(g, ResultTimeoutError) for g in got[1:]), got[1:3]
            del got, samples
            await asyncio.sleep(0.05)
            gc.collect()
            holding, _ = tracemalloc.get_traced_memory()
            del kept
            gc.collect()
            released, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        no_waiters(p)
    retained = holding - released
    assert retained < 1_000_000, f"holding one refusal keeps {retained / 1e6:.1f} MB of its flush alive"


def unretrieved_errors() -> list[str]:
    """What asyncio reports of the futures collected now (an error nobody retrieved)."""
    loop = asyncio.get_running_loop()
    seen: list[str] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(
        lambda _loop, context: seen.append(f"{context.get('message')}: {context.get('exception')!r}")
    )
    try:
        gc.collect()
    finally:
        loop.set_exception_handler(previous)
    return seen


async def test_a_refused_score_never_returns_the_kept_result_of_its_uid(redis_url, namespace) -> None:
    """A conflicting sample (same uid, other content) pushed by a second producer must raise
    PushConflictError. If the shared listener already keeps the uid's result (a result()
    call asked for it), the future is resolved at expect() and score() returns it before
    the verdict arrives, for a sample that was refused."""
    cfg = ProducerConfig(namespace=namespace)
    async with (
        # No periodic trim: the check at the end reads the stream, and on a slow machine a
        # trim (every 2 s by default) had removed the acked first entry (CI's lowest job).
        identity_worker(redis_url, namespace, trim_interval_s=3600),
        RolloutProducer(redis_url, cfg) as p1,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await p1.open_batch("b", 2, 8)
        first = await p1.score(sample_traj("b", 0, uid="x"), timeout_s=20)
        kept = await agg.result("b", "x", timeout_s=20)
        assert kept.score == first.score
        async with RolloutProducer(redis_url, cfg) as p2:
            other = sample_traj("b", 0, uid="x", response="other")
            outcome: object
            try:
                outcome = await p2.score(other, timeout_s=5)
            except PushConflictError as exc:
                outcome = exc
            assert isinstance(outcome, PushConflictError), f"refused sample returned a result: {outcome!r}"
            no_waiters(p2)
    assert [u for _, u, _ in await queued(redis_url, p1.keys)] == ["x"]


async def test_a_refused_score_on_a_fresh_listener_raises_the_conflict(redis_url, namespace) -> None:
    """Same as above without result(): a new listener reads the done stream from its start
    and may find the uid's earlier result before the push's verdict comes back."""
    cfg = ProducerConfig(namespace=namespace)
    async with identity_worker(redis_url, namespace):
        async with RolloutProducer(redis_url, cfg) as p1:
            await p1.open_batch("f", 8, 8)
            for i in range(5):
                await p1.score(sample_traj("f", i, uid=f"u{i}"), timeout_s=20)
        wrong = []
        for i in range(5):  # each in a new producer: its listener is new (refs dropped to 0)
            async with RolloutProducer(redis_url, cfg) as p:
                try:
                    r = await p.score(sample_traj("f", i, uid=f"u{i}", response="changed"), timeout_s=5)
                    wrong.append((i, r.score))
                except PushConflictError:
                    pass
        assert wrong == [], f"refused samples returned the stored result of their uid: {wrong}"


async def test_an_identical_re_push_by_a_second_producer_still_gets_its_result(redis_url, namespace) -> None:
    """A restarted/second producer re-scores a sample already scored (DUPLICATE verdict): the
    result exists once in the done stream. On the shared listener that already read past it
    the waiter registered with landed=False never sees it."""
    cfg = ProducerConfig(namespace=namespace)
    async with (
        identity_worker(redis_url, namespace),
        RolloutProducer(redis_url, cfg) as p1,
        RolloutProducer(redis_url, cfg) as p2,
    ):
        await p1.open_batch("d", 2, 8)
        first = await p1.score(sample_traj("d", 0), timeout_s=20)
        try:
            again = await p2.score(sample_traj("d", 0), timeout_s=3)
        except ResultTimeoutError as exc:
            pytest.fail(f"duplicate score never got its (existing) result: {exc!r}")
        assert (again.uid, again.score) == (first.uid, first.score)
        no_waiters(p2)


async def test_score_racing_collect_both_see_every_sample_once(redis_url, namespace) -> None:
    n = 60
    cfg = ProducerConfig(namespace=namespace, partitions=2)
    async with (
        identity_worker(redis_url, namespace, IdentityScorer(jitter=0.01), partitions=2, concurrency=8),
        RolloutProducer(redis_url, cfg) as p,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await p.open_batch("c", n, 8)
        samples = [sample_traj("c", i, group=f"g{i % 7}") for i in range(n)]
        collecting = asyncio.ensure_future(agg.collect("c", timeout_s=30))
        scores = await asyncio.wait_for(asyncio.gather(*(p.score(t, timeout_s=30) for t in samples)), 40)
        rewards = await asyncio.wait_for(collecting, 40)
        no_waiters(p)
    assert [r.score for r in scores] == [expected(t) for t in samples]
    assert rewards.status == ["ok"] * n
    assert [r.score for r in rewards.results] == [expected(t) for t in samples]
    assert sorted(i for _, _, i in await queued(redis_url, p.keys)) == list(range(n))


async def test_a_custom_uid_score_gets_its_own_result(redis_url, namespace) -> None:
    cfg = ProducerConfig(namespace=namespace, partitions=2)
    async with identity_worker(redis_url, namespace, partitions=2), RolloutProducer(redis_url, cfg) as p:
        await p.open_batch("cu", 6, 8)
        samples = [sample_traj("cu", i, uid=f"custom-{i}-{'x' * i}", group=f"g{i % 2}") for i in range(6)]
        got = await asyncio.wait_for(asyncio.gather(*(p.score(t, timeout_s=20) for t in samples)), 30)
        for t, r in zip(samples, got):
            assert (r.uid, r.index, r.score) == (t.uid, t.index, expected(t))
        no_waiters(p)


async def test_synchronous_errors_in_submit_propagate_and_leak_nothing(redis_url, namespace) -> None:
    cfg = ProducerConfig(namespace=namespace, max_message_bytes=4096)
    async with RolloutProducer(redis_url, cfg) as p:
        await p.open_batch("s", 8, 8)
        # A custom uid that is the default uid of another index.
        with pytest.raises(PushConflictError, match="default uid of index 3"):
            await p.score(sample_traj("s", 0, uid="s/3"), timeout_s=5)
        # Too large a payload.
        big = Trajectory("s", 1, "test/exact", response="y" * 10_000, ground_truth="1", uid="big")
        with pytest.raises(Exception) as info:
            await p.score(big, timeout_s=5)
        assert not isinstance(info.value, (ResultTimeoutError, asyncio.CancelledError)), info.value
        # pushed twice
        await p.push(sample_traj("s", 2))
        with pytest.raises(ConfigError, match="pushed twice"):
            await p.score(sample_traj("s", 2), timeout_s=5)
        no_waiters(p)
        assert p._backlog >= 0
        # The uids of what failed are free: pushed right, they are queued.
        await p.push(Trajectory("s", 1, "test/exact", response="small", ground_truth="1", uid="big"))
        await p.push(sample_traj("s", 3))
        assert sorted(i for _, _, i in await queued(redis_url, p.keys)) == [1, 2, 3]


async def test_backpressure_raise_from_score_leaks_no_waiter_and_no_uid(redis_url, namespace) -> None:
    cfg = ProducerConfig(namespace=namespace, max_backlog=4, on_backlog="raise", backlog_poll_s=0.0)
    async with RolloutProducer(redis_url, cfg) as p:
        await p.open_batch("bp", 20, 8)
        await p.push_many(sample_traj("bp", i) for i in range(4))
        for i in range(4, 10):
            with pytest.raises(BackpressureError):
                await p.score(sample_traj("bp", i), timeout_s=0.01)
        no_waiters(p)
        assert len(await queued(redis_url, p.keys)) == 4
        # Room made (entries consumed and acked): the refused samples' uids are free.
        client = connect(redis_url)
        try:
            got = await client.xreadgroup("scorers", "eater", {p.keys.stream(): ">"}, count=10)
            ids = [eid for eid, _ in got[0][1]]
            await client.xack(p.keys.stream(), "scorers", *ids)
        finally:
            await client.aclose()
        with pytest.raises(ResultTimeoutError):
            await p.score(sample_traj("bp", 4), timeout_s=0.05)
        assert len(await queued(redis_url, p.keys)) == 5
        no_waiters(p)


async def test_cancelled_scores_waiting_for_room_leak_nothing(redis_url, namespace) -> None:
    cfg = ProducerConfig(namespace=namespace, max_backlog=3, on_backlog="wait", backlog_poll_s=0.02)
    async with RolloutProducer(redis_url, cfg) as p:
        await p.open_batch("w", 20, 8)
        await p.push_many(sample_traj("w", i) for i in range(3))
        tasks = [asyncio.ensure_future(p.score(sample_traj("w", i), timeout_s=0.05)) for i in range(3, 10)]
        await asyncio.sleep(0.15)
        assert not any(t.done() for t in tasks), [t for t in tasks if t.done()]
        for t in tasks:
            t.cancel()
        got = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(g, asyncio.CancelledError) for g in got), got
        no_waiters(p)
        assert len(await queued(redis_url, p.keys)) == 3
        assert not ({f"w/{i}" for i in range(3, 10)} & p._uids("w"))


async def test_scores_cancelled_mid_flush_do_not_let_the_producer_pass_max_backlog(redis_url, namespace) -> None:
    """Scores cancelled after their entries were taken into a flush: the samples are queued
    all the same, so they must stay in the backlog estimate. _unreserve drops their count,
    and the next pushes pass max_backlog (no consumers: the backlog is exact)."""
    cfg = ProducerConfig(namespace=namespace, max_backlog=10, on_backlog="raise", backlog_poll_s=5.0)
    async with RolloutProducer(redis_url, cfg) as p:
        await p.open_batch("mb", 40, 8)
        await p.push(sample_traj("mb", 39))  # groups ready, first backlog reading taken
        await asyncio.sleep(0.05)
        flush = p._flush
        taken = asyncio.Event()

        async def slow(entries: list) -> list[int]:
            taken.set()
            await asyncio.sleep(0.2)
            return await flush(entries)

        p._coalescer, p._flush = None, slow  # type: ignore[method-assign]
        tasks = [asyncio.ensure_future(p.score(sample_traj("mb", i), timeout_s=60)) for i in range(9)]
        await asyncio.wait_for(taken.wait(), 5)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.4)  # the flush under way lands
        p._coalescer, p._flush = None, flush  # type: ignore[method-assign]
        in_redis = len(await queued(redis_url, p.keys))
        assert in_redis == 10  # 9 cancelled-but-flushed + 1
        try:
            await p.push_many(sample_traj("mb", i) for i in range(10, 15))
        except BackpressureError:
            pass
        total = len(await queued(redis_url, p.keys))
        assert total <= 10, f"{total} queued with max_backlog=10 (estimate was {p._backlog})"
        no_waiters(p)


async def test_a_push_waiting_between_backlog_readings_at_aclose_gets_an_error(redis_url, namespace) -> None:
    """A push waiting for room sleeps between readings (backlog_poll_s). An aclose() then
    ended no reading it awaited: it woke, read the backlog again through a client made
    anew after the close, found no room, and waited on for ever. The full suite's run of
    the test below caught it once: one of its two waiters was between readings."""
    cfg = ProducerConfig(namespace=namespace, max_backlog=2, on_backlog="wait", backlog_poll_s=0.5)
    p = RolloutProducer(redis_url, cfg)
    await p.open_batch("rs", 10, 8)
    await p.push_many(sample_traj("rs", i) for i in range(2))
    waiter = asyncio.ensure_future(p.push(sample_traj("rs", 5)))
    try:

        async def asleep() -> bool:  # its reading is over: no room, it sleeps
            return p._backlog_reading is not None and p._backlog_reading.done()

        await wait_until(asleep, timeout_s=5)
        assert not waiter.done()
        await asyncio.wait_for(p.aclose(), 5)
        done, _ = await asyncio.wait([waiter], timeout=5)
        assert done, "the push still waits for room 5 s after the close"
        assert isinstance(waiter.exception(), BrokerError), waiter.exception()
        assert p._client is None, "the waiting push made a new client after the close"
    finally:
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        await p.aclose()


async def test_a_push_waiting_on_a_backlog_reading_that_aclose_ends_gets_an_error_not_a_cancel(
    redis_url, namespace
) -> None:
    """score() and push() wait for room on a backlog reading; aclose() ends that reading (so
    it cannot reach for a client after the close). The waiters were not cancelled: each must
    end with an error it can handle, not a CancelledError nobody asked for."""
    cfg = ProducerConfig(namespace=namespace, max_backlog=2, on_backlog="wait", backlog_poll_s=0.02)
    p = RolloutProducer(redis_url, cfg)
    await p.open_batch("rc", 10, 8)
    await p.push_many(sample_traj("rc", i) for i in range(2))
    reading_started = asyncio.Event()
    real_read = p._read_counts

    async def slow_read() -> tuple[int, dict[int, int]]:  # the reading's round trips, slowed
        reading_started.set()
        await asyncio.sleep(5)
        return await real_read()

    p._read_counts = slow_read  # type: ignore[method-assign]
    waiters = [
        asyncio.ensure_future(p.score(sample_traj("rc", 5), timeout_s=30)),
        asyncio.ensure_future(p.push(sample_traj("rc", 6))),
    ]
    try:
        await asyncio.wait_for(reading_started.wait(), 5)
        assert not any(w.done() for w in waiters)
        await asyncio.wait_for(p.aclose(), 5)
        done, _ = await asyncio.wait(waiters, timeout=5)
        assert len(done) == 2, "a waiter still pending after the close"
        for w in waiters:
            assert not w.cancelled(), "a waiter the caller never cancelled ended cancelled"
            assert isinstance(w.exception(), BrokerError), w.exception()
    finally:
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        await p.aclose()


async def test_score_pending_when_the_producer_closes_does_not_hang_past_its_timeout(redis_url, namespace) -> None:
    """score() waiting for room when aclose() runs; then room appears. Its timeout must still
    hold: the callback arms it only if ``self._listener`` is set, which aclose cleared."""
    cfg = ProducerConfig(namespace=namespace, max_backlog=2, on_backlog="wait", backlog_poll_s=0.02)
    p = RolloutProducer(redis_url, cfg)
    await p.open_batch("ac", 10, 8)
    await p.push_many(sample_traj("ac", i) for i in range(2))
    task = asyncio.ensure_future(p.score(sample_traj("ac", 5), timeout_s=0.3))
    await asyncio.sleep(0.1)
    assert not task.done()
    await p.aclose()
    client = connect(redis_url)
    try:  # room appears
        got = await client.xreadgroup("scorers", "eater", {p.keys.stream(): ">"}, count=10)
        await client.xack(p.keys.stream(), "scorers", *[eid for eid, _ in got[0][1]])
    finally:
        await client.aclose()
    done, _ = await asyncio.wait({task}, timeout=5)
    try:
        assert done, "score(timeout_s=0.3) still pending 5 s after room appeared (producer closed mid-flight)"
        exc = task.exception()
        assert exc is None or isinstance(exc, Exception), exc
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await p.aclose()
    # The listener failed score()'s result future when it closed; score() ended without
    # awaiting it. That error must count as seen, or asyncio reports it when the future is
    # collected ("exception was never retrieved"), in whatever code runs then (CI, lowest).
    del task
    assert unretrieved_errors() == []


async def test_score_that_ends_without_its_result_leaves_no_unretrieved_error(redis_url, namespace) -> None:
    """score() waiting for backlog room when aclose() fails its result future, then cancelled:
    it never awaits that future, and its error must not surface later as "Future exception
    was never retrieved" in whatever code the garbage collector interrupts."""
    cfg = ProducerConfig(namespace=namespace, max_backlog=2, on_backlog="wait", backlog_poll_s=0.02)
    p = RolloutProducer(redis_url, cfg)
    await p.open_batch("ur", 10, 8)
    await p.push_many(sample_traj("ur", i) for i in range(2))
    task = asyncio.ensure_future(p.score(sample_traj("ur", 5), timeout_s=0.3))
    await asyncio.sleep(0.1)
    assert not task.done()
    await p.aclose()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    del task
    assert unretrieved_errors() == []


async def test_score_in_flight_when_the_producer_closes_ends(redis_url, namespace) -> None:
    """aclose() with a score() (no timeout) awaiting its result: the listener is closed under
    it and nothing ever resolves or fails the waiter."""
    cfg = ProducerConfig(namespace=namespace)
    p = RolloutProducer(redis_url, cfg)
    await p.open_batch("ic", 4, 8)
    task = asyncio.ensure_future(p.score(sample_traj("ic", 0)))
    await asyncio.sleep(0.2)
    assert not task.done()
    await p.aclose()
    async with identity_worker(redis_url, namespace):
        done, _ = await asyncio.wait({task}, timeout=5)
    if not done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert done, "score() hangs forever after its producer closed (scored by a worker meanwhile)"
    # It ends with a clear error (nothing reads its result any more), not a raw traceback.
    assert isinstance(task.exception(), BrokerError) and "closed" in str(task.exception())


async def test_a_slow_push_that_fails_raises_broker_error_not_timeout(redis_url, namespace) -> None:
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as p:
        await p.open_batch("e", 10, 8)

        async def slow_broken(entries: list) -> list[int]:
            await asyncio.sleep(0.3)
            raise BrokerError("injected")

        flush = p._flush
        p._coalescer, p._flush = None, slow_broken  # type: ignore[method-assign]
        got = await asyncio.gather(
            *(p.score(sample_traj("e", i), timeout_s=0.01) for i in range(5)), return_exceptions=True
        )
        assert all(isinstance(g, BrokerError) for g in got), got
        no_waiters(p)
        p._coalescer, p._flush = None, flush  # type: ignore[method-assign]
        await p.push_many(sample_traj("e", i) for i in range(5))  # uids released
        assert sorted(i for _, _, i in await queued(redis_url, p.keys)) == list(range(5))


def test_sync_score_from_threads_each_gets_its_own_outcome(redis_url, namespace, spawn_workers) -> None:
    from concurrent.futures import ThreadPoolExecutor

    spawn_workers(1, "--scorer", SCORER)
    with SyncRolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
        producer.open_batch("th", 60, 4)
        producer.push(Trajectory("th", 0, "test/exact", response="1", ground_truth="1", uid="taken"))

        def one(i: int):
            if i % 5 == 0:  # refused: index 0 is taken by another uid
                t = Trajectory("th", 0, "test/exact", response="1", ground_truth="1", uid=f"other{i}")
            else:
                t = Trajectory("th", i, "test/exact", response=str(i % 2), ground_truth="1")
            try:
                return producer.score(t, timeout_s=60)
            except Exception as exc:  # noqa: BLE001
                return exc

        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(one, range(1, 60)))
    for i, g in zip(range(1, 60), got):
        if i % 5 == 0:
            assert isinstance(g, PushConflictError), (i, g)
        else:
            assert not isinstance(g, Exception), (i, g)
            assert (g.index, g.score) == (i, float(i % 2)), (i, g)
