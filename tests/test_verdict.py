"""score()'s push verdict is handed over by a callback at once (trainer/coalescer.Verdict),
not through a future and a loop turn. What that must not break: every other submission
of a flush gets its verdict when one callback fails; a wait ends however the verdict
ends; and a finished score() leaves nothing for the garbage collector (a verdict that
kept its push alive made a reference cycle per sample)."""

from __future__ import annotations

import asyncio
import gc

import pytest

from stream_reward import ProducerConfig, RolloutProducer, Trajectory
from stream_reward.trainer.coalescer import Coalescer, Verdict

pytestmark = pytest.mark.anyio

SCORER = "python:tests/data/scorers.py:exact"


async def test_a_failing_verdict_callback_does_not_keep_the_flush_from_the_others() -> None:
    loop = asyncio.get_running_loop()
    reported: list[BaseException] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context["exception"]))
    try:

        async def flush(batch: list[int]) -> list[int]:
            await asyncio.sleep(0)
            return [10 * e for e in batch]

        got: list[tuple[int, list[int]]] = []

        def then(k: int) -> None:
            if k == 1:
                raise RuntimeError("a bug in one callback")
            got.append((k, verdicts[k].result()))

        co: Coalescer[int, int] = Coalescer(flush, max_entries=100)
        verdicts = [Verdict(then, k) for k in range(3)]
        for k, v in enumerate(verdicts):
            co.submit_nowait([k], v)
        plain = co.submit_nowait([7])  # a future in the same flush
        assert await asyncio.wait_for(plain, 5) == [70]
        await co.aclose()
    finally:
        loop.set_exception_handler(None)
    assert got == [(0, [0]), (2, [20])]
    assert [str(e) for e in reported] == ["a bug in one callback"]
    assert all(v.done() for v in verdicts)


async def test_a_wait_ends_however_the_verdict_ends_and_a_cancelled_waiter_does_not_break_the_next() -> None:
    calls: list[str] = []
    for end in ("result", "exception", "cancel"):
        v: Verdict[list[int]] = Verdict(calls.append, end)
        first = asyncio.ensure_future(v.wait())
        await asyncio.sleep(0)
        first.cancel()  # a caller that gave up waiting
        await asyncio.gather(first, return_exceptions=True)
        second = asyncio.ensure_future(v.wait())
        await asyncio.sleep(0)
        assert not second.done()
        if end == "result":
            v.set_result([1])
            assert v.result() == [1] and v.exception() is None
        elif end == "exception":
            v.set_exception(ValueError("refused"))
            assert isinstance(v.exception(), ValueError)
            with pytest.raises(ValueError):
                v.result()
        else:
            assert v.cancel() and v.cancelled() and not v.cancel()
            with pytest.raises(asyncio.CancelledError):
                v.result()
        await asyncio.wait_for(second, 2)  # never raises for the verdict itself
        with pytest.raises(asyncio.InvalidStateError):
            v.set_result([2])  # set once
    assert calls == ["result", "exception", "cancel"]  # each callback once


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
