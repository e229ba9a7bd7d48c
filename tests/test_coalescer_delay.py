"""The coalescer's delay (``coalesce_delay_s``): it waits for more pushes only while
pushes come faster than the delay (one less than the delay after the one before), and
a push after a quiet spell is never held back by it.

A pure protocol test: the flush is a recording coroutine, not Redis (the pushes that go
through Redis are tested in test_per_sample.py and the attack files)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from stream_reward import ProducerConfig
from stream_reward.trainer.coalescer import Coalescer

pytestmark = pytest.mark.anyio

DELAY_S = 0.4  # long against this VM's loop turns (under 10 ms even with the suite running)


class Recorder:
    """A flush that records what it got and when, and answers each entry with itself."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.sent_at: list[float] = []

    async def __call__(self, entries: list[int]) -> list[int]:
        self.batches.append(list(entries))
        self.sent_at.append(time.monotonic())
        await asyncio.sleep(0)
        return list(entries)


async def just_flushed(**options: Any) -> tuple[Recorder, Coalescer[int, int]]:
    """A coalescer (delay DELAY_S) whose first push, [0], has just been flushed: the
    pushes a test makes next come less than the delay after it."""
    flush = Recorder()
    coalescer: Coalescer[int, int] = Coalescer(flush, max_delay_s=DELAY_S, **options)
    assert await coalescer.submit([0]) == [0]
    return flush, coalescer


async def test_a_lone_push_is_sent_at_once_not_after_the_delay() -> None:
    flush = Recorder()
    coalescer: Coalescer[int, int] = Coalescer(flush, max_delay_s=DELAY_S)
    t0 = time.monotonic()
    assert await coalescer.submit([1]) == [1]
    assert time.monotonic() - t0 < DELAY_S / 4
    # Quiet again once a delay has passed since the last push: the next one is not held either.
    await asyncio.sleep(DELAY_S * 1.1)
    t1 = time.monotonic()
    assert await coalescer.submit([2]) == [2]
    assert time.monotonic() - t1 < DELAY_S / 4
    assert flush.batches == [[1], [2]]


async def test_pushes_that_come_within_the_delay_of_the_one_before_wait_and_go_together() -> None:
    flush, coalescer = await just_flushed()  # [0] went at once: nothing came before it
    # Three more, each from a later loop turn than the one before and within the delay of
    # it: pushes are coming faster than the delay, so they wait and share one flush.
    calls = []
    for i in (1, 2, 3):
        calls.append(asyncio.ensure_future(coalescer.submit([i])))
        await asyncio.sleep(0.01)
    assert await asyncio.gather(*calls) == [[1], [2], [3]]
    assert flush.batches == [[0], [1, 2, 3]]
    # Held for the delay at most (not the delay again for each one that joined).
    assert flush.sent_at[1] - flush.sent_at[0] < DELAY_S * 1.5


async def test_without_a_delay_the_same_pushes_go_one_flush_each() -> None:
    """The control for the test above: what the delay changes."""
    flush = Recorder()
    coalescer: Coalescer[int, int] = Coalescer(flush, max_delay_s=0.0)
    await coalescer.submit([0])
    calls = []
    for i in (1, 2, 3):
        calls.append(asyncio.ensure_future(coalescer.submit([i])))
        await asyncio.sleep(0.01)
    await asyncio.gather(*calls)
    assert flush.batches == [[0], [1], [2], [3]]


async def test_a_full_group_does_not_wait_out_the_delay() -> None:
    flush, coalescer = await just_flushed(max_entries=4)
    t0 = time.monotonic()
    first = asyncio.ensure_future(coalescer.submit([1]))
    await asyncio.sleep(0.01)  # the runner is waiting for more now
    rest = [asyncio.ensure_future(coalescer.submit([i])) for i in (2, 3, 4)]
    assert await asyncio.gather(first, *rest) == [[1], [2], [3], [4]]
    assert time.monotonic() - t0 < DELAY_S / 2
    assert flush.batches == [[0], [1, 2, 3, 4]]


async def test_a_push_cancelled_while_it_waits_out_the_delay_is_not_sent() -> None:
    flush, coalescer = await just_flushed()
    gone = asyncio.ensure_future(coalescer.submit([1]))
    await asyncio.sleep(0.01)
    kept = asyncio.ensure_future(coalescer.submit([2]))
    await asyncio.sleep(0.01)
    gone.cancel()
    assert await kept == [2]
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert flush.batches == [[0], [2]]
    await coalescer.aclose()


async def test_closing_while_pushes_wait_out_the_delay_cancels_them() -> None:
    """The producer's close cancels the runner: whoever waits hears it, nothing hangs."""
    flush, coalescer = await just_flushed()
    waiting = asyncio.ensure_future(coalescer.submit([1]))
    await asyncio.sleep(0.01)
    assert coalescer._runner is not None
    coalescer._runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(waiting, 5)
    assert flush.batches == [[0]]


def test_the_producer_default_delay_is_one_millisecond() -> None:
    """The default the issue-16 measurements chose (see benchmarks/README.md)."""
    assert ProducerConfig().coalesce_delay_s == 0.001
