"""score() waiting once per sample for its result (the push's verdict by a callback), and a
producer's pushes and backlog readings at aclose: a refused score never returns another
sample's result, cancelled or failed scores leak no waiter, no uid and no unretrieved error,
and a push pending at aclose gets an error, not a hang or a cancel.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random

import pytest
from helpers import no_waiters, queued, wait_until

from stream_reward import ProducerConfig, RewardAggregator, RolloutProducer, SyncRolloutProducer, Trajectory
from stream_reward.config import ConsumerConfig
from stream_reward.errors import (
    BackpressureError,
    BrokerError,
    ConfigError,
    PushConflictError,
    ResultTimeoutError,
)
from stream_reward.scoring.scorer import Scored
from stream_reward.wire.connection import connect
from stream_reward.worker.consumer import Worker

pytestmark = pytest.mark.anyio


SCORER = "python:tests/data/scorers.py:exact"


def sample_traj(batch: str, i: int, *, uid: str = "", response: str = "r", group: str | None = None) -> Trajectory:
    return Trajectory(batch, i, "test/exact", response=f"{response}{i}", ground_truth="1", uid=uid, group=group)


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


class IdentityScorer:
    """Scores a sample by its identity: index + len(response)/1000 (a wrong sample's result shows)."""

    def __init__(self, delay: float = 0.0, jitter: float = 0.0) -> None:
        self.delay, self.jitter = delay, jitter
        self.seen: list[str] = []

    async def score(self, t: Trajectory) -> Scored:
        self.seen.append(t.uid)
        d = self.delay + random.random() * self.jitter
        if d:
            await asyncio.sleep(d)
        return Scored(t.index + len(t.response) / 1000)


def expected(t: Trajectory) -> float:
    return t.index + len(t.response) / 1000


@contextlib.asynccontextmanager
async def identity_worker(url: str, ns: str, scorer=None, **cfg):
    stop = asyncio.Event()
    w = Worker(url, scorer or IdentityScorer(), ConsumerConfig(namespace=ns, block_ms=50, **cfg))
    task = asyncio.ensure_future(w.run(stop))
    try:
        yield w
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await w.aclose()


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
