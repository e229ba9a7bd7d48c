"""The worker as a whole (stream_reward.worker.consumer): ``Worker.run``.

A worker refuses a consumer name a live worker heartbeats under, and takes a name a dead
one left; run() fails with the real error (a BaseException out of a scorer, a writer that
dies, a namespace of another protocol, a Redis error creating its group) and returns within
its bounds while Redis hangs; a Worker whose run() ended runs again, with no state of the
last stop sticking; its reads and result flushes go on connections of their own, which
survive kills, a server restart and a database other than 0; a failed sample keeps the
extra its ScoringError carries; whatever lands on the stream
is scored or dead-lettered, and workers killed at random lose and repeat nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time
import uuid
from typing import Any

import msgpack
import pytest
import redis.asyncio as aredis
from helpers import (
    Counting,
    assert_each_once,
    done_results,
    exact_traj,
    identity_score,
    pending_samples,
    push_exact,
    running_worker,
    score_batch,
    started,
    stop_config,
    unsettled,
    wait_until,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.exceptions import ResponseError
from worker_support import (
    SLOW,
    Delays,
    N,
    _async,
    _no_pending,
    _xlen_at_least,
    cfg,
    collect,
    ghost_holds,
    one_result_each,
    peer_finishes_with_letters,
    pending_count,
    pending_of_stream,
    push,
    slow_traj,
    trajs,
)

from stream_reward import ProducerConfig, RewardAggregator, RolloutProducer, Trajectory
from stream_reward.config import ConsumerConfig
from stream_reward.errors import ConfigError, ProtocolMismatchError, ScoringError
from stream_reward.ops.deadletters import list_dead_letters
from stream_reward.ops.embedded import EmbeddedServer
from stream_reward.scoring.registry import RuleScorer
from stream_reward.scoring.scorer import Scored
from stream_reward.wire.codec import decode_trajectory, encode_trajectory
from stream_reward.wire.connection import connect
from stream_reward.wire.entries import entry_fields
from stream_reward.wire.heartbeat import encode_heartbeat
from stream_reward.wire.keys import Keys
from stream_reward.wire.ledger import LedgerWriter
from stream_reward.worker.consumer import Worker

pytestmark = pytest.mark.anyio


async def _run_burst(redis_url: str, namespace: str, name: str, **kw) -> float:
    w = Worker(redis_url, Counting(first=0.0), stop_config(namespace, name, **kw))
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(w.run(asyncio.Event(), burst=True), 8)
    finally:
        await w.aclose()
    return time.monotonic() - t0


class Boom(BaseException):
    """Not an Exception: what a scorer's own cancellation or a KeyboardInterrupt-like error looks like."""


def faulty(url: str, fault):
    """A client whose commands go through ``fault(name, orig, args, kwargs)``."""
    wc = connect(url)
    orig = wc.execute_command

    async def execute_command(*args, **kwargs):
        return await fault(str(args[0]).upper(), orig, args, kwargs)

    wc.execute_command = execute_command
    return wc


async def forever() -> None:
    await asyncio.Event().wait()


async def finish_the_rest(redis_url: str, namespace: str, name: str = "peer") -> Counting:
    scorer = Counting(first=0.0)
    peer = Worker(redis_url, scorer, stop_config(namespace, name, reclaim_idle_ms=200))
    await asyncio.sleep(0.25)
    await asyncio.wait_for(peer.run(asyncio.Event(), burst=True), 10)
    await peer.aclose()
    return scorer


async def pending_deliveries(redis_url: str, namespace: str) -> list[int]:
    c = connect(redis_url)
    try:
        rows = await c.xpending_range(Keys(namespace, 1).streams()[0], "scorers", min="-", max="+", count=100)
        return sorted(int(r["times_delivered"]) for r in rows)
    finally:
        await c.aclose()


def scoring_tasks() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if not t.done() and "_score" in repr(t.get_coro())]


async def returns_after_stop(w: Worker, run: asyncio.Future, stop: asyncio.Event, what: str) -> None:
    """Set ``stop``; ``run`` (w.run) must be back within the drain deadline (0.3 s) + 5.5 s."""
    stop.set()
    t0 = time.monotonic()
    done, _ = await asyncio.wait([run], timeout=0.3 + 5.5)
    try:
        assert done, f"run() not back {time.monotonic() - t0:.1f} s after {what}"
    finally:
        run.cancel()
        await asyncio.wait([run], timeout=2)
        await w.aclose()


scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=True)
    | st.text(max_size=30)
    | st.binary(max_size=30)
)


def _containers(children):
    return st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)


values = st.recursive(scalars, _containers, max_leaves=8)


record = st.fixed_dictionaries(
    {"v": st.sampled_from([1, 1, 1, 2, "1"])},
    optional={
        "u": st.text(max_size=12) | st.integers(-5, 5),
        "b": st.just("B"),
        "i": st.integers(-2, 5) | st.text(max_size=2),
        "ds": st.sampled_from(["openai/gsm8k", "math_dapo", "lighteval/MATH", "nope", ""]) | values,
        "r": st.text(max_size=200) | values,
        "gt": values,
        "ids": st.binary(max_size=16) | values,
        "vl": st.integers(-3, 50) | values,
        "x": st.dictionaries(st.text(max_size=5), values, max_size=3) | values,
        "rm": st.floats() | values,
    },
)


good = st.builds(
    lambda i, r, gt: Trajectory("B", i, "openai/gsm8k", response=r, ground_truth=gt, uid=f"good-{i}"),
    st.integers(0, 5),
    st.text(max_size=80),
    st.text(max_size=6),
)


payload = st.one_of(
    st.binary(max_size=200),
    record.map(lambda obj: msgpack.packb(obj, use_bin_type=True)),
    good.map(encode_trajectory),
)


entry = st.tuples(payload, st.booleans())  # (payload, with plain b/i/u fields)


async def _run(url: str, entries: list[tuple[bytes, bool]]) -> None:
    namespace = f"fz{uuid.uuid4().hex[:8]}"
    keys = Keys(namespace)
    client = connect(url)
    try:
        ids = []
        for n, (data, plain_fields) in enumerate(entries):
            fields = entry_fields(data, "B", n, f"e{n}") if plain_fields else {"d": data}
            ids.append((await client.xadd(keys.stream(), fields), plain_fields, n))
        worker = Worker(url, RuleScorer(), ConsumerConfig(namespace=namespace, block_ms=20))
        await asyncio.wait_for(worker.run(burst=True), 30)
        await worker.aclose()
        assert (
            worker.stats.scored + worker.stats.failed + worker.stats.duplicates
            >= len(entries) - worker.stats.dead_letters
        )
        pending = await client.xpending(keys.stream(), "scorers")
        assert pending["pending"] == 0
        dead = {
            msgpack.unpackb(f[b"e"], raw=False, strict_map_key=False)["entry_id"]: msgpack.unpackb(
                f[b"e"], raw=False, strict_map_key=False
            )
            for _, f in await client.xrange(keys.dead_letters())
        }
        assert all(d["reason"] and d["error"] for d in dead.values())
        ledger = {r.uid: r for r in await done_results(client, keys.done("B"))}
        assert sorted(ledger) == sorted(k.decode() for k in await client.hkeys(keys.results("B")))
        for (entry_id, plain_fields, n), (data, _) in zip(ids, entries):
            if entry_id in dead:
                if plain_fields:  # its batch is known from the plain fields: resolved as failed
                    assert ledger[f"e{n}"].status == "failed"
                continue
            traj = decode_trajectory(data)  # not dead-lettered, so it must decode...
            assert traj.uid in ledger  # ...and has its one result (ok, or failed with a reason)
            result = ledger[traj.uid]
            assert result.status == "ok" or result.reason
        assert worker.stats.dead_letters == len(dead)
    finally:
        await client.aclose()


# --- the consumer-name guard at the start of a run


@pytest.mark.parametrize(
    "garbage",
    [
        pytest.param(encode_heartbeat({"host": "h", "pid": 1, "started": 0.0, "seen": float("nan")}), id="nan-seen"),
        pytest.param(b"\x81\xa1x" + b"\x91" * 1000 + b"\xc0", id="deep-nesting"),
    ],
)
async def test_garbage_in_the_heartbeat_hash_does_not_stop_the_worker(redis_url, namespace, garbage) -> None:
    """A value under the worker's name that is no live worker's heartbeat: the worker runs
    (at worst after the dead-worker patience), no ConfigError, no crash."""
    client = connect(redis_url)
    try:
        await client.hset(Keys(namespace).workers(), "w1", garbage)
        await push_exact(redis_url, namespace, "N", 1)
        await _run_burst(redis_url, namespace, "w1", heartbeat_interval_s=0.2)
    finally:
        await client.aclose()


async def test_a_live_twin_with_a_longer_heartbeat_interval_is_refused(redis_url, namespace) -> None:
    """Twin A beats every 3 s; B (0.2 s) waited only 2*0.2+0.5 s for A's `seen` to change,
    saw none, and took the live name. B must wait on A's interval (in its heartbeat)."""
    await push_exact(redis_url, namespace, "N", 1)
    a_scorer = Counting(first=8.0)
    a = Worker(redis_url, a_scorer, stop_config(namespace, "w1", heartbeat_interval_s=3.0))
    a_stop = asyncio.Event()
    a_run = asyncio.ensure_future(a.run(a_stop))
    client = connect(redis_url)
    try:
        await asyncio.wait_for(a_scorer.started.wait(), 5)
        # A's first heartbeat is written beside its first read, not before it: on a loaded
        # machine its scorer can start first (CI saw no "w1" yet once).
        await wait_until(lambda: client.hexists(Keys(namespace).workers(), "w1"), timeout_s=5)
        b = Worker(redis_url, Counting(first=0.0), stop_config(namespace, "w1", heartbeat_interval_s=0.2))
        b_stop = asyncio.Event()
        try:
            with pytest.raises(ConfigError, match="in use by a live worker"):
                b_run = asyncio.ensure_future(b.run(b_stop))
                # A live worker shows itself by its next beat: up to one of A's intervals.
                done, _ = await asyncio.wait({b_run}, timeout=7.0)
                if not done:  # B took the name: it is running next to live A
                    b_stop.set()
                    await asyncio.wait_for(b_run, 10)
                    pytest.fail("B took the consumer name of live twin A (A beats every 3 s)")
                b_run.result()
        finally:
            await b.aclose()
    finally:
        a_stop.set()
        await asyncio.wait_for(a_run, 15)
        await a.aclose()
        await client.aclose()


async def test_a_live_worker_of_another_group_does_not_hold_the_name(redis_url, namespace) -> None:
    """Consumer names are per group in Redis: a live worker named w1 in group g1 holds no
    pending list of g2's. A g2 worker named w1 starts and scores beside it, not refused
    as its twin (a refusal that depended on whether g1's heartbeat moved meanwhile)."""
    await push_exact(redis_url, namespace, "N", 1)
    a_scorer = Counting(first=8.0)
    a = Worker(redis_url, a_scorer, stop_config(namespace, "w1", group="g1", heartbeat_interval_s=0.2))
    a_stop = asyncio.Event()
    a_run = asyncio.ensure_future(a.run(a_stop))
    client = connect(redis_url)
    try:
        await asyncio.wait_for(a_scorer.started.wait(), 30)
        await wait_until(lambda: client.hexists(Keys(namespace).workers(), "w1"), timeout_s=30)
        b_scorer = Counting(first=0.0)
        async with started(Worker(redis_url, b_scorer, stop_config(namespace, "w1", group="g2"))) as b:
            await wait_until(lambda: _settled(b), timeout_s=30)
        assert not a_run.done()
    finally:
        a_stop.set()
        await asyncio.wait_for(a_run, 30)
        await a.aclose()
        await client.aclose()


async def _settled(worker: Worker) -> bool:
    return worker.stats.scored == 1


async def test_a_restart_after_a_graceful_stop_is_not_delayed(redis_url, namespace) -> None:
    """Same name, default heartbeat interval (2 s): a restart after a graceful stop starts
    at once (the farewell removed the heartbeat), and a Worker object's second run() too."""
    await push_exact(redis_url, namespace, "N", 1)
    w = Worker(redis_url, Counting(first=0.0), stop_config(namespace, "w1"))
    try:
        await asyncio.wait_for(w.run(asyncio.Event(), burst=True), 8)
        await push_exact(redis_url, namespace, "M", 1)
        t0 = time.monotonic()
        await asyncio.wait_for(w.run(asyncio.Event(), burst=True), 8)
        second = time.monotonic() - t0
    finally:
        await w.aclose()
    third = await _run_burst(redis_url, namespace, "w1")
    assert second < 2.0 and third < 2.0, f"restart delayed: second run {second:.1f} s, new worker {third:.1f} s"


async def test_a_worker_refuses_a_consumer_name_a_live_worker_beats_under(redis_url, namespace) -> None:
    """The guard behind the test above: B, started under the name of live worker A (which
    refreshes its heartbeat), raises a ConfigError naming the clash rather than run; A's
    heartbeat stays. A name whose worker died (heartbeat no longer refreshed) is taken."""
    from stream_reward.errors import ConfigError

    keys = Keys(namespace)
    client = connect(redis_url)
    await push_exact(redis_url, namespace, "N", 1)
    a_scorer = Counting(first=3.0)
    a = Worker(redis_url, a_scorer, stop_config(namespace, "w1", heartbeat_interval_s=0.2))
    a_stop = asyncio.Event()
    a_run = asyncio.ensure_future(a.run(a_stop))
    try:
        await asyncio.wait_for(a_scorer.started.wait(), 5)
        b = Worker(redis_url, Counting(first=0.0), stop_config(namespace, "w1", heartbeat_interval_s=0.2))
        with pytest.raises(ConfigError, match="in use by a live worker"):
            await asyncio.wait_for(b.run(asyncio.Event()), 5)
        await b.aclose()
        assert await client.hexists(keys.workers(), "w1")
    finally:
        a_stop.set()
        await asyncio.wait_for(a_run, 10)
        await a.aclose()
    # A heartbeat left behind (a worker that died): taken after it stops changing.
    from stream_reward.wire.heartbeat import encode_heartbeat

    await client.hset(keys.workers(), "w2", encode_heartbeat({"host": "gone", "pid": 1, "started": 0.0, "seen": 1.0}))
    c = Worker(redis_url, Counting(first=0.0), stop_config(namespace, "w2", heartbeat_interval_s=0.2))
    await asyncio.wait_for(c.run(asyncio.Event(), burst=True), 10)
    await c.aclose()
    await client.aclose()


async def test_a_stop_during_the_name_check_returns_while_redis_hangs(redis_url, namespace) -> None:
    """Redis stops answering (every command blocks) as the worker checks its name; the stop
    must still end run() within drain_timeout_s + ~5 s."""

    async def fault(name, orig, args, kwargs):
        if name == "HGET":
            await forever()
        return await orig(*args, **kwargs)

    w = Worker(redis_url, Counting(first=0.0), stop_config(namespace, "w1"), client=faulty(redis_url, fault))
    stop = asyncio.Event()
    run = asyncio.ensure_future(w.run(stop))
    await asyncio.sleep(0.5)
    await returns_after_stop(w, run, stop, "a stop during the name check (HGET hangs)")


# --- run() failing: raised as itself, nothing stranded


async def test_an_inline_scorer_raising_a_base_exception_fails_run_cleanly(redis_url, namespace) -> None:
    class Inline:
        inline = True

        async def score(self, t):
            if t.index == 2:
                raise Boom("scorer went down")
            return Scored(identity_score(t))

    await push_exact(redis_url, namespace, "a", 4)
    w = Worker(redis_url, Inline(), stop_config(namespace, "w1"))
    with pytest.raises(Boom) as info:
        await asyncio.wait_for(w.run(asyncio.Event()), 5)
    assert str(info.value) == "scorer went down"
    assert not scoring_tasks()
    left = await pending_deliveries(redis_url, namespace)
    assert left and all(d >= 1 for d in left), f"entries of the failed run: {left}"
    await w.aclose()
    await finish_the_rest(redis_url, namespace)
    assert await pending_samples(redis_url, namespace) == 0


async def test_a_task_scorer_raising_a_base_exception_does_not_strand_its_sample(redis_url, namespace) -> None:
    """A scorer in a task (inline = False) raising a BaseException: the task dies, the
    sample is never queued. Either run() fails (and a peer reclaims) or the sample settles;
    it must not stay held (renewed) by a live worker for ever."""

    class Tasked:
        inline = False

        async def score(self, t):
            if t.index == 0:
                raise Boom("scorer task went down")
            return Scored(identity_score(t))

    await push_exact(redis_url, namespace, "a", 4)
    w = Worker(redis_url, Tasked(), stop_config(namespace, "w1", reclaim_idle_ms=300))
    stop = asyncio.Event()
    run = asyncio.ensure_future(w.run(stop))
    try:
        await asyncio.sleep(1.0)
        peer = Counting(first=0.0)
        pw = Worker(redis_url, peer, stop_config(namespace, "peer", reclaim_idle_ms=300))
        await asyncio.wait_for(pw.run(asyncio.Event(), burst=True), 10)
        await pw.aclose()
        left = await pending_samples(redis_url, namespace)
        assert run.done() or left == 0, (
            f"worker alive (in_flight {w.stats.in_flight}) holding {left} sample(s) its dead scoring "
            f"task never settled; a peer could not take it (peer scored {peer.calls})"
        )
    finally:
        stop.set()
        await asyncio.wait([run], timeout=10)
        await w.aclose()


async def test_a_writer_failure_fails_run_with_the_real_error(redis_url, namespace, monkeypatch) -> None:
    """The ledger write raising an unexpected (non-Redis) error kills the writer task. run()
    must fail with it (or its entries go to a peer), not go on with nothing settling."""
    armed = asyncio.Event()
    real_write = LedgerWriter.write_partitions  # the flushes, on the worker's lane or through redis-py

    async def write_partitions(self, batch):
        if armed.is_set():
            armed.clear()
            raise RuntimeError("ledger write broke")
        return await real_write(self, batch)

    monkeypatch.setattr(LedgerWriter, "write_partitions", write_partitions)
    await push_exact(redis_url, namespace, "a", 4)
    scorer = Counting(first=0.3, on_first=armed.set)
    w = Worker(redis_url, scorer, stop_config(namespace, "w1", reclaim_idle_ms=300))
    stop = asyncio.Event()
    run = asyncio.ensure_future(w.run(stop))
    try:
        await asyncio.wait([run], timeout=4)
        left = await pending_samples(redis_url, namespace)
        assert run.done(), (
            f"run() still going 4 s after its writer died: in_flight {w.stats.in_flight}, "
            f"{left} samples pending and renewed, nothing settles"
        )
        exc = run.exception()
        assert isinstance(exc, RuntimeError) and "ledger write broke" in str(exc), repr(exc)
    finally:
        stop.set()
        await asyncio.wait([run], timeout=10)
        await w.aclose()


async def test_a_namespace_of_another_protocol_fails_run_before_anything(redis_url, namespace) -> None:
    c = connect(redis_url)
    keys = Keys(namespace, 1)
    await c.hset(keys.namespace_info(), mapping={"protocol": "999", "epoch": "x"})
    w = Worker(redis_url, Counting(first=0.0), stop_config(namespace, "w1"))
    try:
        with pytest.raises(ProtocolMismatchError):
            await asyncio.wait_for(w.run(asyncio.Event()), 5)
        assert not await c.hget(keys.workers(), "w1"), "a refused worker left a heartbeat"
        assert not scoring_tasks()
    finally:
        await w.aclose()
        await c.aclose()


async def test_a_redis_error_creating_the_group_is_raised_as_itself(redis_url, namespace) -> None:
    async def fault(name, orig, args, kwargs):
        if name.startswith("XGROUP"):
            raise ResponseError("ERR create refused")
        return await orig(*args, **kwargs)

    w = Worker(redis_url, Counting(first=0.0), stop_config(namespace, "w1"), client=faulty(redis_url, fault))
    try:
        with pytest.raises(ResponseError, match="create refused"):
            await asyncio.wait_for(w.run(asyncio.Event()), 5)
    finally:
        await w.aclose()


async def test_a_stop_mid_run_returns_while_redis_hangs(redis_url, namespace) -> None:
    hang = asyncio.Event()

    async def fault(name, orig, args, kwargs):
        if hang.is_set():
            await forever()
        return await orig(*args, **kwargs)

    await push_exact(redis_url, namespace, "a", 4)
    scorer = Counting(first=5.0)
    w = Worker(redis_url, scorer, stop_config(namespace, "w1"), client=faulty(redis_url, fault))
    stop = asyncio.Event()
    run = asyncio.ensure_future(w.run(stop))
    await asyncio.wait_for(scorer.started.wait(), 5)
    await asyncio.sleep(0.1)
    hang.set()
    await asyncio.sleep(0.2)
    await returns_after_stop(w, run, stop, "a stop with Redis hanging")


# --- a sample's scorer fails


class FailsWithColumns:
    """Fails every sample with a ScoringError that carries the sample's columns."""

    inline = True

    async def score(self, t: Trajectory) -> Scored:
        raise ScoringError("judge down", reason="judge:failed", extra={"judge": None, "judge_status": "failed"})


async def test_a_failed_sample_keeps_the_extra_its_scoring_error_carries(redis_url, namespace) -> None:
    async with running_worker(redis_url, namespace, FailsWithColumns()):
        rewards = await score_batch(redis_url, namespace, [exact_traj("fx", 0), exact_traj("fx", 1)])
    assert rewards.status == ["failed", "failed"] and rewards.results[0].reason == "judge:failed"
    assert rewards.reward_extra_info == {"judge": [None, None], "judge_status": ["failed", "failed"]}
    assert rewards.valid.tolist() == [False, False]


# --- a Worker run again


async def test_a_worker_run_again_after_a_graceful_stop_scores_new_samples(redis_url, namespace) -> None:
    """run() stopped gracefully, then run() again with a new stop event: the worker must
    score what is pushed afterwards (no state of the first stop may stick)."""
    scorer = Counting(first=0.0)
    w = Worker(redis_url, scorer, stop_config(namespace, "w1"))
    stop1 = asyncio.Event()
    first = asyncio.ensure_future(w.run(stop1))
    await asyncio.sleep(0.3)
    stop1.set()
    await asyncio.wait_for(first, 10)
    stop2 = asyncio.Event()
    second = asyncio.ensure_future(w.run(stop2))
    try:
        await push_exact(redis_url, namespace, "a", 6)
        async with RewardAggregator(redis_url, namespace=namespace) as agg:
            rewards = await agg.collect("a", timeout_s=4, on_timeout="resolve")
    finally:
        stop2.set()
        await asyncio.wait_for(second, 10)
        await w.aclose()
    assert unsettled(rewards) == [], (
        f"the second run() left samples unscored: {unsettled(rewards)}; scorer saw {scorer.calls}; "
        f"pending {await pending_of_stream(redis_url, namespace)}"
    )


async def test_a_worker_run_again_after_a_burst_still_renews_its_slow_samples(redis_url, namespace) -> None:
    """A burst run ends (its drain sets _renewals_over); the same Worker runs again and scores
    a sample slower than reclaim_idle_ms. Without renewals its own sweep XAUTOCLAIMs the held
    entry every reclaim_idle_ms, bumping its delivery count; a stop then releases it with
    that count, and the peer dead-letters an innocent, slow sample as max_deliveries."""
    scorer = Counting(first=0.0)
    w = Worker(redis_url, scorer, stop_config(namespace, "w1", reclaim_idle_ms=200, max_deliveries=5))
    await asyncio.wait_for(w.run(asyncio.Event(), burst=True), 10)  # nothing to do: ends at once
    scorer.first = 5.0
    await push_exact(redis_url, namespace, "a", 1)
    stop = asyncio.Event()
    second = asyncio.ensure_future(w.run(stop))
    try:
        await asyncio.wait_for(scorer.started.wait(), 5)
        await asyncio.sleep(1.6)
        during = await pending_of_stream(redis_url, namespace)
        stop.set()
        await asyncio.wait_for(second, 10)
    finally:
        await w.aclose()
    _, rewards, left, letters = await peer_finishes_with_letters(redis_url, namespace, "a", max_deliveries=5)
    assert not letters, (
        f"a slow sample of a re-run worker dead-lettered: {[(d.reason, d.error) for d in letters]}; "
        f"pending while scored (id, consumer, idle ms, delivered): {during}"
    )
    assert unsettled(rewards) == [] and not left, (unsettled(rewards), left)


async def test_a_worker_run_again_after_a_graceful_stop_hunts_suspects(redis_url, namespace) -> None:
    """run() stopped gracefully, then run() again: a suspect a dead consumer left (delivered
    twice) must be scored alone and settled. _stopping/_stopped stay set from the first
    stop, so the hunt returns at once and the entry stays held (and renewed) for ever."""
    scorer = Counting(first=0.0)
    w = Worker(redis_url, scorer, stop_config(namespace, "w1", reclaim_idle_ms=60_000, reclaim_interval_s=0.05))
    stop1 = asyncio.Event()
    first = asyncio.ensure_future(w.run(stop1))
    await asyncio.sleep(0.3)
    stop1.set()
    await asyncio.wait_for(first, 10)
    await push_exact(redis_url, namespace, "a", 1)
    await ghost_holds(redis_url, namespace, [2])  # its sweep makes it 3 > 2: a suspect
    stop2 = asyncio.Event()
    second = asyncio.ensure_future(w.run(stop2))
    try:
        async with RewardAggregator(redis_url, namespace=namespace) as agg:
            rewards = await agg.collect("a", timeout_s=3, on_timeout="resolve")
        during = await pending_of_stream(redis_url, namespace)
    finally:
        stop2.set()
        await asyncio.wait_for(second, 10)
        await w.aclose()
    assert unsettled(rewards) == [], (
        f"the second run() never hunted the suspect: {unsettled(rewards)}; scorer saw {scorer.calls}; pending {during}"
    )


async def test_a_worker_run_twice_finishes_what_its_first_run_handed_back_and_released(redis_url, namespace) -> None:
    """First run: an entry of 4 (one started, 3 handed back) and a single-sample entry are
    in hand when it stops (the started samples cancelled). Second run of the same Worker
    object: every sample gets one result, nothing is dead-lettered, nothing stays pending."""
    keys = Keys(namespace)
    client = connect(redis_url)
    try:
        await push(redis_url, namespace, [exact_traj("T", i) for i in range(4)], k=4)
        await push(redis_url, namespace, [exact_traj("U", 0)], k=1)
        scorer = Delays(default=5.0, later=0.02)
        worker = Worker(redis_url, scorer, cfg(namespace, "same", concurrency=2, reclaim_idle_ms=300))
        stop = asyncio.Event()
        run = asyncio.create_task(worker.run(stop))
        await wait_until(lambda: _async(sum(scorer.calls.values()) >= 2), timeout_s=5, every_s=0.01)
        stop.set()
        await asyncio.wait_for(run, 10)
        assert worker.stats.spilled, "no hand-back in the first run"
        scorer.default = 0.02
        await asyncio.wait_for(worker.run(burst=True), 10)
        await worker.aclose()
        for batch, n in (("T", 4), ("U", 1)):
            got = await one_result_each(client, keys, batch, n)
            assert all(r.status == "ok" for r in got), got
        assert await pending_count(client, keys) == 0
        assert not await list_dead_letters(redis_url, namespace=namespace)
    finally:
        await client.aclose()


# --- its connections (reads and flushes on lanes of their own)


class PacedByKills:
    """Scores by identity, sample ``i`` only once more than ``i // 25`` connections were
    killed: the kills land while the batch is in flight however fast or slow the machine
    is, not only as many as a timer fits into the scoring."""

    inline = False

    def __init__(self) -> None:
        self.kills = 0
        self.killed = asyncio.Condition()

    async def add_kills(self, n: int) -> None:
        async with self.killed:
            self.kills += n
            self.killed.notify_all()

    async def score(self, t: Any) -> Scored:
        async with self.killed:
            await self.killed.wait_for(lambda: self.kills > t.index // 25)
        return Scored(identity_score(t))


async def test_the_worker_scores_each_sample_once_while_its_connections_are_killed_again_and_again(
    own_url, namespace
) -> None:
    admin = connect(own_url)
    scorer = PacedByKills()
    calm = asyncio.Event()

    async def storm() -> None:
        while not calm.is_set():
            await asyncio.sleep(0.03)
            await scorer.add_kills(await admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"))

    try:
        async with running_worker(own_url, namespace, scorer, concurrency=8, read_count=4):
            killer = asyncio.ensure_future(storm())
            try:
                # A collect well under reclaim_idle_ms: a read whose reply a kill cut must not
                # leave its entries to the reclaimer.
                rewards = await score_batch(own_url, namespace, trajs("k", 300), timeout_s=20)
            finally:
                # Stopped by a flag, not a cancel: redis-py under Python 3.11 can swallow a
                # cancel that lands inside a command (asyncio.wait_for returns the command's
                # result instead), and the gather below would wait for ever.
                calm.set()
                await asyncio.wait_for(asyncio.gather(killer, return_exceptions=True), 10)
        assert scorer.kills > 10, f"only {scorer.kills} connections killed: nothing tested"
        await assert_each_once(own_url, namespace, "k", rewards, 300)
    finally:
        await admin.aclose()


async def test_a_worker_on_database_3_reads_and_writes_there(own_url, namespace) -> None:
    """A lane that forgot the database would read an empty stream and write the results
    where the trainer never looks: the collect would time out."""
    url = f"{own_url}?db=3"
    rewards = None
    async with running_worker(url, namespace, Counting(first=0.0)):
        rewards = await score_batch(url, namespace, trajs("d"), timeout_s=20)
    await assert_each_once(url, namespace, "d", rewards, N)
    db0 = connect(own_url)
    try:
        assert [k async for k in db0.scan_iter(match=f"*{namespace}*")] == []
    finally:
        await db0.aclose()


@pytest.mark.parametrize("kind", ["connect", "plain redis-py"])
async def test_a_worker_given_a_client_on_database_5_uses_it_for_reads_and_flushes(own_url, namespace, kind) -> None:
    """The worker's client= is on database 5 (one from ``connect``, whose url says nothing of
    a database for the worker itself, or a plain redis-py client): the trainer on database 5
    must get every result."""
    url5 = f"{own_url}?db=5"
    if kind == "connect":
        client, worker_url = connect(url5), own_url
    else:
        client, worker_url = aredis.Redis(unix_socket_path=own_url[len("unix://") :], db=5), url5
    try:
        async with running_worker(worker_url, namespace, Counting(first=0.0), client=client):
            rewards = await collect(url5, namespace, f"c5{kind[0]}", 40, timeout_s=20)
        await assert_each_once(url5, namespace, f"c5{kind[0]}", rewards, 40)
    finally:
        await client.aclose()


async def test_a_server_restart_mid_run_loses_and_doubles_nothing(namespace) -> None:
    """SHUTDOWN SAVE, then the same server again on the same socket: the lanes reconnect to
    an empty script cache (NOSCRIPT), reads resume."""
    with EmbeddedServer() as server:
        url = server.url
        async with running_worker(url, namespace, Counting(first=0.01, later=0.0), concurrency=8, reclaim_idle_ms=500):
            async with RolloutProducer(url, ProducerConfig(namespace=namespace)) as producer:
                async with RewardAggregator(url, namespace=namespace) as agg:
                    await producer.open_batch("rs", 200, 8)
                    await producer.push_many([exact_traj("rs", i) for i in range(200)])
                    admin = connect(url)
                    await wait_until(lambda: _xlen_at_least(admin, Keys(namespace).done("rs"), 3))
                    with contextlib.suppress(Exception):
                        await admin.execute_command("SHUTDOWN", "SAVE")
                    await admin.aclose()
                    assert server._proc is not None
                    server._proc.wait(10)
                    server._proc = None
                    await asyncio.sleep(0.3)
                    server.start()
                    rewards = await agg.collect("rs", timeout_s=60)
            admin = connect(url)
            await wait_until(lambda: _no_pending(admin, Keys(namespace).stream()))
            await admin.aclose()
        await assert_each_once(url, namespace, "rs", rewards, 200)


# --- whatever lands on the stream, and workers killed at random


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(st.lists(entry, min_size=1, max_size=12))
def test_every_entry_is_scored_or_dead_lettered(redis_url, entries):
    asyncio.run(_run(redis_url, entries))


@pytest.mark.parametrize("seed", [7, 8])
async def test_workers_sigkilled_at_random_moments_lose_and_repeat_nothing(
    redis_url, namespace, spawn_workers, seed
) -> None:
    """Entries of 16, a slow scorer, concurrency 3 (hand-back on every entry): a steady
    worker and a victim SIGKILLed at random moments three times (replaced each time)."""

    from helpers import done_results, wait_until

    from stream_reward.ops.deadletters import list_dead_letters

    rnd = random.Random(seed)
    keys = Keys(namespace)
    n = 96
    args = ("--scorer", SLOW, "--reclaim-idle-ms", "500", "--concurrency", "3")
    client = connect(redis_url)
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await producer.open_batch("r", n, 4)
            await producer.push_many(slow_traj("r", i, 0.05) for i in range(n))
            spawn_workers(1, *args)
            for _ in range(3):
                (victim,) = spawn_workers(1, *args)
                await asyncio.sleep(rnd.uniform(0.6, 1.6))
                victim.send_signal(signal.SIGKILL)
                victim.wait()
            rewards = await agg.collect("r", timeout_s=90, on_timeout="resolve")
            bad = [(r.index, r.status, r.reason) for r in rewards.results if r.status != "ok"]
            assert not bad, bad
            assert await client.hlen(keys.results("r")) == n
            uids = [r.uid for r in await done_results(client, keys.done("r"))]
            assert len(uids) == len(set(uids)) == n

            async def nothing_pending() -> bool:
                return (await client.xpending(keys.stream(), "scorers"))["pending"] == 0

            await wait_until(nothing_pending, timeout_s=20)
            assert await list_dead_letters(redis_url, namespace=namespace) == []
    finally:
        await client.aclose()
