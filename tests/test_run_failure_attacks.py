"""Attacks on Worker.run failing (an exception out of run()), the consumer-name guard at its
start, and a shutdown bounded while Redis hangs (ninth attack round)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from redis.exceptions import ResponseError

from stream_reward.errors import ProtocolMismatchError
from stream_reward.scoring.scorer import Scored
from stream_reward.wire.connection import connect
from stream_reward.wire.heartbeat import decode_heartbeat
from stream_reward.wire.keys import Keys
from stream_reward.wire.ledger import LedgerWriter
from stream_reward.worker.consumer import Worker
from tests.helpers import Counting, identity_score, pending_samples, push_exact, stop_config, wait_until

pytestmark = pytest.mark.anyio


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


# ======================================================================================
# (1) run() failing


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


# ======================================================================================
# (3) a stop while Redis hangs


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


# ======================================================================================
# (2) the consumer-name guard


async def test_the_supervisor_restarts_a_killed_child_under_its_name(redis_url, namespace, spawn_workers) -> None:
    """``worker --processes 2 --consumer sup``: children sup-0 and sup-1. A SIGKILLed child
    leaves its heartbeat; the restarted one must take its name after ~2 intervals, not exit 2."""
    c = connect(redis_url)
    key = Keys(namespace, 1).workers()
    (sup,) = spawn_workers(1, "--processes", "2", "--consumer", "sup")
    try:

        async def beat(name):
            raw = await c.hget(key, name)
            return decode_heartbeat(raw) if raw else None

        async def both():
            return await beat("sup-0") and await beat("sup-1")

        await wait_until(both, 10)
        old = (await beat("sup-0"))["pid"]
        os.kill(old, signal.SIGKILL)

        async def back():
            b = await beat("sup-0")
            return b and b["pid"] != old

        t0 = time.monotonic()
        await wait_until(back, 9)
        assert sup.poll() is None
        assert time.monotonic() - t0 < 8
    finally:
        await c.aclose()
