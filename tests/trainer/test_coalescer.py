"""The coalescer (trainer/coalescer.py) gathers concurrent submissions into one flush.

It promises: nothing is lost or sent twice, and every caller gets exactly its own
verdicts, in order, whatever the interleaving of submissions, cancels, failing or slow
flushes, ``max_entries`` and ``max_in_flight``; it waits up to ``max_delay_s`` for more
only while submissions come faster than the delay, so a push after a quiet spell is
never held back; closing it or cancelling its runner ends every caller; a ``Verdict``
handed over by callback ends every wait however it ends. The flush here is a recording
coroutine, not Redis: the pushes that go through Redis are in test_producer.py and
test_samples.py. The tests run on a virtual clock (a sleep moves it, a loaded machine does
not), so every gap and bound is exact: timing checks use delays of 0.3-0.4 s and a slack of
0.2 s for the loop turns between two readings of the clock; the randomized interleavings use
fixed seeds and a short delay.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

import pytest
from helpers import VirtualClockLoop

from stream_reward import ProducerConfig
from stream_reward.trainer.coalescer import Coalescer, Verdict

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return "asyncio", {"loop_factory": VirtualClockLoop}


def now() -> float:
    return asyncio.get_running_loop().time()


DELAY_S = 0.4


class Recorder:
    """A flush that records what it got and when, and answers each entry with itself."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.sent_at: list[float] = []

    async def __call__(self, entries: list[int]) -> list[int]:
        self.batches.append(list(entries))
        self.sent_at.append(now())
        await asyncio.sleep(0)
        return list(entries)


async def just_flushed(**options: Any) -> tuple[Recorder, Coalescer[int, int]]:
    """A coalescer (delay DELAY_S) whose first push, [0], has just been flushed: the
    pushes a test makes next come less than the delay after it."""
    flush = Recorder()
    coalescer: Coalescer[int, int] = Coalescer(flush, max_delay_s=DELAY_S, **options)
    assert await coalescer.submit([0]) == [0]
    return flush, coalescer


SLACK_S = 0.2


class Boom(Exception):
    """A flush that failed; carries the index of the flush call."""

    def __init__(self, n: int) -> None:
        super().__init__(f"flush {n} failed")
        self.n = n


class Flush:
    """A flush that records each call (entries, start, end) and answers ``("ok", e)`` per
    entry; ``hold(n)`` seconds it takes, ``fail(n)`` whether it raises ``Boom(n)``."""

    def __init__(self, *, hold: Any = None, fail: Any = None) -> None:
        self.batches: list[list[Any]] = []
        self.started: list[float] = []
        self.ended: list[float | None] = []
        self.failed: list[bool] = []
        self.cancelled: list[bool] = []
        self._hold = hold or (lambda n: 0.0)
        self._fail = fail or (lambda n: False)

    async def __call__(self, entries: list[Any]) -> list[Any]:
        n = len(self.batches)
        self.batches.append(list(entries))
        self.started.append(now())
        self.ended.append(None)
        self.failed.append(False)
        self.cancelled.append(False)
        try:
            hold = self._hold(n)
            await asyncio.sleep(hold if hold else 0)
            if self._fail(n):
                self.failed[n] = True
                raise Boom(n)
            return [("ok", e) for e in entries]
        except asyncio.CancelledError:
            self.cancelled[n] = True
            raise
        finally:
            self.ended[n] = now()

    def sent_at(self, entry: Any) -> float:
        for batch, at in zip(self.batches, self.started):
            if entry in batch:
                return at
        raise AssertionError(f"entry {entry!r} was never flushed; batches {self.batches}")

    def max_concurrency(self) -> int:
        events = []
        for s, e in zip(self.started, self.ended):
            events.append((s, 1))
            events.append((e if e is not None else float("inf"), -1))
        events.sort(key=lambda x: (x[0], x[1]))  # an end at the same instant as a start first
        now = peak = 0
        for _, d in events:
            now += d
            peak = max(peak, now)
        return peak


def assert_drained(coalescer: Coalescer[Any, Any]) -> None:
    assert coalescer._count == 0, f"_count leaked: {coalescer._count} with nothing pending"
    assert not coalescer._pending, f"_pending not empty: {list(coalescer._pending)}"
    assert coalescer._runner is None or coalescer._runner.done()
    assert not coalescer._flushes


def _could_send_at(flush: Flush, at: float, max_in_flight: int) -> float:
    """The first moment at or after ``at`` with fewer than max_in_flight flushes in flight."""
    t = at
    while True:
        busy = [e for s, e in zip(flush.started, flush.ended) if s <= t and (e is None or e > t)]
        if len(busy) < max_in_flight:
            return t
        t = min(e if e is not None else float("inf") for e in busy)


def record_order(coalescer: Coalescer[Any, Any]) -> list[list[Any]]:
    """Record the entries lists in the order they reach submit_nowait (submit() goes
    through it too: the instance attribute shadows the method)."""
    order: list[list[Any]] = []
    real = coalescer.submit_nowait

    def submit_nowait(entries: list[Any], verdict: Any = None) -> Any:
        order.append(entries)
        return real(entries, verdict)

    coalescer.submit_nowait = submit_nowait  # type: ignore[method-assign]
    return order


def in_pending(coalescer: Coalescer[Any, Any], entries: list[Any]) -> bool:
    return any(e is entries for e, _ in coalescer._pending)


async def settle(coalescer: Coalescer[Any, Any], timeout: float = 5.0) -> None:
    """Until nothing is pending and no runner or flush is left (or the timeout)."""
    deadline = now() + timeout
    while now() < deadline:
        runner = coalescer._runner
        if not coalescer._pending and (runner is None or runner.done()) and not coalescer._flushes:
            return
        await asyncio.sleep(0.01)


@dataclass(eq=False)
class Sub:
    entries: list[int]
    kind: str  # "task" (await submit()), "future" (submit_nowait) or "verdict" (submit_nowait(verdict=))
    task: asyncio.Task[Any] | None = None
    slot: Any = None
    calls: list[int] = field(default_factory=list)  # the Verdict's then() calls
    cancel_phase: str | None = None  # "unsubmitted", "pending" or "taken" when we cancelled it
    submitted_at: float = 0.0

    def cancel(self) -> None:
        if self.kind == "task":
            assert self.task is not None
            self.task.cancel()
        else:
            self.slot.cancel()

    def done(self) -> bool:
        return self.task.done() if self.kind == "task" else self.slot.done()  # type: ignore[union-attr]

    def outcome(self) -> tuple[str, Any]:
        """("result", verdicts), ("error", exc) or ("cancelled", None)."""
        src = self.task if self.kind == "task" else self.slot
        assert src is not None and src.done(), f"{self} never ended"
        if src.cancelled():
            return ("cancelled", None)
        exc = src.exception()
        if exc is not None:
            return ("error", exc)
        return ("result", src.result())


async def random_scenario(
    seed: int, *, max_in_flight: int, max_entries: int, delay: float, ops: int, coverage: dict[str, int]
) -> None:
    rng = random.Random(seed)
    frng = random.Random(seed * 7919 + 1)  # the flush's own choices
    flush = Flush(
        hold=lambda n: frng.choice([0.0, 0.0, 0.0, delay / 3, delay * 1.5]),
        fail=lambda n: frng.random() < 0.2,
    )
    co: Coalescer[int, Any] = Coalescer(flush, max_entries=max_entries, max_delay_s=delay, max_in_flight=max_in_flight)
    order = record_order(co)
    subs: list[Sub] = []
    next_entry = 0
    sizes = [0, 1, 1, 1, 2, 3, max_entries - 1, max_entries, max_entries + 1, 2 * max_entries + 1]

    def cancel(sub: Sub) -> None:
        if sub.done():
            return
        if sub.kind == "task" and not any(e is sub.entries for e in order):
            sub.cancel_phase = "unsubmitted"
        elif in_pending(co, sub.entries):
            sub.cancel_phase = "pending"
        else:
            sub.cancel_phase = "taken"
        coverage["cancel_" + sub.cancel_phase] += 1
        sub.cancel()

    for _ in range(ops):
        k = rng.choice(sizes)
        entries = list(range(next_entry, next_entry + k))
        next_entry += k
        sub = Sub(entries, rng.choice(["task", "future", "verdict"]), submitted_at=now())
        if k > max_entries:
            coverage["oversized"] += 1
        if k == max_entries:
            coverage["exactly_max"] += 1
        if sub.kind == "task":
            sub.task = asyncio.ensure_future(co.submit(entries))
        elif sub.kind == "future":
            sub.slot = co.submit_nowait(entries)
        else:
            sub.slot = co.submit_nowait(entries, Verdict(lambda calls: calls.append(1), sub.calls))
        subs.append(sub)
        if rng.random() < 0.07:
            cancel(sub)  # in the loop turn it was submitted in: before the runner looked at it
        pause = rng.choice([None, None, 0.0, delay / 5, delay / 2, delay * 1.3])
        if pause is not None:
            await asyncio.sleep(pause)
        if rng.random() < 0.3:
            cancel(rng.choice(subs[-4:]))  # a recent one: more likely pending or in a flush
        if rng.random() < 0.15:
            in_flush = [
                x for x in subs if not x.done() and any(e is x.entries for e in order) and not in_pending(co, x.entries)
            ]
            if in_flush:
                cancel(rng.choice(in_flush))  # one taken into a flush that has not come back yet

    await asyncio.wait_for(co.aclose(), 10)
    # aclose() returned: every caller must have its outcome by now (a task's wakeup may take a turn).
    tasks = [s.task for s in subs if s.task is not None]
    if tasks:
        _, hung = await asyncio.wait(tasks, timeout=5)
        assert not hung, f"seed {seed}: {len(hung)} submit() calls still waiting after aclose()"
    coverage["flushes"] += len(flush.batches)
    coverage["failed_flushes"] += sum(flush.failed)

    # Every flushed entry once, in the order of submission, in whole submissions.
    flushed = [e for batch in flush.batches for e in batch]
    assert len(flushed) == len(set(flushed)), f"seed {seed}: an entry was flushed twice: {flush.batches}"
    where: dict[int, tuple[int, int]] = {}
    for b, batch in enumerate(flush.batches):
        for i, e in enumerate(batch):
            where[e] = (b, i)
    by_entries = {id(s.entries): s for s in subs}
    sent_subs = []
    for entries in order:
        s = by_entries[id(entries)]
        if not entries:
            continue
        spots = [where.get(e) for e in entries]
        if all(p is None for p in spots):
            continue
        assert None not in spots, f"seed {seed}: submission {entries} flushed in part: {spots}"
        b0, i0 = spots[0]  # type: ignore[misc]
        assert spots == [(b0, i0 + j) for j in range(len(entries))], f"seed {seed}: {entries} split: {spots}"
        sent_subs.append(s)
    assert flushed == [e for s in sent_subs for e in s.entries], f"seed {seed}: batches out of submission order"
    for b, batch in enumerate(flush.batches):
        if len(batch) > max_entries:
            whole = [s for s in sent_subs if s.entries and where[s.entries[0]][0] == b]
            assert len(whole) == 1, f"seed {seed}: batch {b} of {len(batch)} > max_entries {max_entries}: {whole}"
    assert flush.max_concurrency() <= max_in_flight, f"seed {seed}: more than {max_in_flight} flushes at once"

    for s in subs:
        kind, value = s.outcome()
        spot = where.get(s.entries[0]) if s.entries else None
        if s.kind == "verdict":
            assert s.calls == [1], f"seed {seed}: a Verdict's then() ran {len(s.calls)} times"
        if s.cancel_phase in ("unsubmitted", "pending"):
            assert spot is None, f"seed {seed}: {s.entries} cancelled while {s.cancel_phase} yet flushed"
        if kind == "cancelled":
            # Cancelled by us (or a task cancelled after its verdict was set): sent at most once (checked above).
            assert s.cancel_phase is not None, f"seed {seed}: {s.entries} ({s.kind}) cancelled by nobody"
            continue
        if s.entries:
            assert spot is not None, f"seed {seed}: {s.entries} ({s.kind}) got {kind} but was never flushed"
        if kind == "error":
            assert isinstance(value, Boom), value
            assert flush.failed[value.n]
            if s.entries:  # (an empty submission cannot be told apart in the batches)
                assert spot is not None and value.n == spot[0], f"seed {seed}: {s.entries} got flush {value.n}'s error"
        else:
            assert value == [("ok", e) for e in s.entries], f"seed {seed}: {s.entries} got {value}"
            if spot is not None:
                assert not flush.failed[spot[0]]
    assert_drained(co)


async def _until(cond: Any) -> None:
    while not cond():
        await asyncio.sleep(0.005)


class Resubmit(Verdict[Any]):
    """A Verdict whose settling submits again (``left`` more times), from the flush's task."""

    def __init__(
        self, co: Coalescer[Any, Any], tag: str, left: int, log: list[Resubmit], on_cancel: bool = False
    ) -> None:
        super().__init__(lambda _: None, None)
        self.co, self.tag, self.left, self.log, self.on_cancel = co, tag, left, log, on_cancel
        log.append(self)

    def _settled(self) -> None:
        if self.left > 0 and (self._state == 1 or self.on_cancel):
            nxt = Resubmit(self.co, f"{self.tag}+", self.left - 1, self.log, self.on_cancel)
            self.co.submit_nowait([nxt.tag], nxt)


async def _runner_cancel_setup(moment: str) -> tuple[Coalescer[str, Any], Flush, dict[str, Any]]:
    """Callers of every kind in every state, then the runner cancelled: ``moment`` is
    "delay" (the runner waits out the delay) or "gated" (it waits for a flush slot)."""
    flush = Flush(hold=lambda n: 3.0 if n == 0 else 0.0)
    co: Coalescer[str, Any] = Coalescer(flush, max_delay_s=DELAY_S, max_in_flight=1, max_entries=100)
    calls: list[int] = []
    slots: dict[str, Any] = {}
    slots["t-inflight"] = asyncio.ensure_future(co.submit(["t-inflight"]))
    await asyncio.sleep(0)
    slots["v-inflight"] = co.submit_nowait(["v-inflight"], Verdict(lambda c: c.append(1), calls))
    await asyncio.wait_for(_until(lambda: bool(flush.batches)), 3)  # flush 0 holds 3 s
    await asyncio.sleep(0.05)
    slots["t-wait"] = asyncio.ensure_future(co.submit(["t-wait"]))
    slots["f-wait"] = co.submit_nowait(["f-wait"])
    slots["v-wait"] = co.submit_nowait(["v-wait"], Verdict(lambda c: c.append(1), calls))
    await asyncio.sleep(0.1 if moment == "delay" else DELAY_S + 0.2)
    slots["f-late"] = co.submit_nowait(["f-late"])
    await asyncio.sleep(0)
    slots["calls"] = calls
    assert co._runner is not None and not co._runner.done()
    co._runner.cancel()
    return co, flush, slots


# The delay: who waits, and for how long


async def test_a_lone_push_is_sent_at_once_not_after_the_delay() -> None:
    flush = Recorder()
    coalescer: Coalescer[int, int] = Coalescer(flush, max_delay_s=DELAY_S)
    t0 = now()
    assert await coalescer.submit([1]) == [1]
    assert now() - t0 < DELAY_S / 4
    # Quiet again once a delay has passed since the last push: the next one is not held either.
    await asyncio.sleep(DELAY_S * 1.1)
    t1 = now()
    assert await coalescer.submit([2]) == [2]
    assert now() - t1 < DELAY_S / 4
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
    t0 = now()
    first = asyncio.ensure_future(coalescer.submit([1]))
    await asyncio.sleep(0.01)  # the runner is waiting for more now
    rest = [asyncio.ensure_future(coalescer.submit([i])) for i in (2, 3, 4)]
    assert await asyncio.gather(first, *rest) == [[1], [2], [3], [4]]
    assert now() - t0 < DELAY_S / 2
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
    """The default the measurements in benchmarks/README.md chose."""
    assert ProducerConfig().coalesce_delay_s == 0.001


async def test_a_submission_larger_than_max_entries_goes_alone_whole_and_at_once() -> None:
    flush = Flush()
    co: Coalescer[int, Any] = Coalescer(flush, max_delay_s=DELAY_S, max_entries=4)
    await co.submit([0])
    small = asyncio.ensure_future(co.submit([1, 2]))
    await asyncio.sleep(0.05)  # small is waiting out the delay
    t0 = now()
    big = asyncio.ensure_future(co.submit(list(range(10, 19))))  # 9 > max_entries 4
    await asyncio.sleep(0.05)
    after = asyncio.ensure_future(co.submit([20]))
    assert await asyncio.wait_for(small, 3) == [("ok", 1), ("ok", 2)]
    assert await asyncio.wait_for(big, 3) == [("ok", e) for e in range(10, 19)]
    assert flush.sent_at(10) - t0 < SLACK_S, "a full group waited out the delay"
    assert await asyncio.wait_for(after, 3) == [("ok", 20)]
    assert flush.batches[:3] == [[0], [1, 2], list(range(10, 19))]
    assert flush.batches[3] == [20]
    await co.aclose()
    assert_drained(co)


async def test_exactly_max_entries_in_one_submission_goes_at_once_even_when_pushes_come_fast() -> None:
    flush = Flush()
    co: Coalescer[int, Any] = Coalescer(flush, max_delay_s=DELAY_S, max_entries=4)
    await co.submit([0])
    t0 = now()
    assert await co.submit([1, 2, 3, 4]) == [("ok", e) for e in (1, 2, 3, 4)]  # 1 ms after the one before
    assert now() - t0 < SLACK_S
    # Next: one entry within the delay of the full group still waits, and gathers what comes.
    first = asyncio.ensure_future(co.submit([5]))
    await asyncio.sleep(0.1)
    second = asyncio.ensure_future(co.submit([6]))
    assert await asyncio.gather(first, second) == [[("ok", 5)], [("ok", 6)]]
    assert flush.batches == [[0], [1, 2, 3, 4], [5, 6]]
    await co.aclose()
    assert_drained(co)


@pytest.mark.parametrize("max_in_flight", [1, 2])
async def test_the_count_crossing_max_entries_during_the_wait_ends_it(max_in_flight: int) -> None:
    flush = Flush()
    co: Coalescer[int, Any] = Coalescer(flush, max_delay_s=DELAY_S, max_entries=5, max_in_flight=max_in_flight)
    await co.submit([0])
    a = asyncio.ensure_future(co.submit([1, 2, 3]))
    await asyncio.sleep(0.1)
    t0 = now()
    b = asyncio.ensure_future(co.submit([4, 5, 6]))  # 6 pending > 5
    assert await asyncio.wait_for(asyncio.gather(a, b), 3) == [
        [("ok", e) for e in (1, 2, 3)],
        [("ok", e) for e in (4, 5, 6)],
    ]
    assert flush.sent_at(4) - t0 < SLACK_S, "the rest after a full group waited out the delay"
    assert flush.batches == [[0], [1, 2, 3], [4, 5, 6]]
    await co.aclose()
    assert_drained(co)


async def test_a_steady_stream_faster_than_the_delay_does_not_starve_anyone() -> None:
    """Submissions every delay/4 for 2.4 s: each goes within the delay (+ slack) of its
    submission, the stream is still gathered (fewer flushes than submissions)."""
    flush = Flush()
    co: Coalescer[int, Any] = Coalescer(flush, max_delay_s=DELAY_S, max_entries=1000)
    calls = []
    submitted_at = []
    for i in range(24):
        submitted_at.append(now())
        calls.append(asyncio.ensure_future(co.submit([i])))
        await asyncio.sleep(DELAY_S / 4)
        if i == 7:
            # The first of the stream (submitted at 0.1 s, after the lone first one) must be out by 0.8 s.
            assert 1 in [e for b in flush.batches for e in b], f"starved: batches {flush.batches}"
    assert await asyncio.wait_for(asyncio.gather(*calls), 5) == [[("ok", i)] for i in range(24)]
    late = [(i, round(flush.sent_at(i) - submitted_at[i], 3)) for i in range(24)]
    assert all(d <= DELAY_S + SLACK_S for _, d in late), f"held beyond the delay: {late}"
    assert late[0][1] < SLACK_S, "the first ever submission was delayed"
    assert len(flush.batches) < 24 / 2, f"the stream was not gathered: {flush.batches}"
    await co.aclose()
    assert_drained(co)


@pytest.mark.parametrize("max_in_flight", [1, 2])
async def test_with_slow_flushes_nobody_waits_the_delay_beyond_a_free_flush_slot(max_in_flight: int) -> None:
    flush = Flush(hold=lambda n: 0.3)
    co: Coalescer[int, Any] = Coalescer(flush, max_delay_s=0.3, max_entries=1000, max_in_flight=max_in_flight)
    rng = random.Random(5)
    calls = []
    submitted_at = []
    for i in range(15):
        submitted_at.append(now())
        calls.append(asyncio.ensure_future(co.submit([i])))
        await asyncio.sleep(rng.choice([0.0, 0.02, 0.07, 0.15, 0.4]))
    assert await asyncio.wait_for(asyncio.gather(*calls), 20) == [[("ok", i)] for i in range(15)]
    late = []
    for i in range(15):
        free = _could_send_at(flush, submitted_at[i], max_in_flight)
        sent = flush.sent_at(i)
        if sent - free > 0.3 + SLACK_S:
            late.append((i, round(sent - submitted_at[i], 3), round(sent - free, 3)))
    assert not late, f"(entry, after submit, after a free slot) held beyond the delay: {late}"
    assert flush.max_concurrency() <= max_in_flight
    await co.aclose()
    assert_drained(co)


async def test_the_first_ever_submission_is_not_delayed() -> None:
    flush = Flush()
    co: Coalescer[int, Any] = Coalescer(flush, max_delay_s=DELAY_S)
    t0 = now()
    assert await co.submit([1]) == [("ok", 1)]
    assert now() - t0 < SLACK_S
    v_calls: list[int] = []
    co2: Coalescer[int, Any] = Coalescer(flush, max_delay_s=DELAY_S)
    t0 = now()
    v = co2.submit_nowait([2], Verdict(lambda c: c.append(1), v_calls))
    await asyncio.wait_for(v.wait(), 3)
    assert now() - t0 < SLACK_S and v.result() == [("ok", 2)] and v_calls == [1]


async def test_a_lone_submission_after_a_quiet_spell_is_not_delayed_whatever_came_before() -> None:
    flush = Flush()
    co: Coalescer[int, Any] = Coalescer(flush, max_delay_s=DELAY_S, max_in_flight=2)
    # After a stream that made the runner wait.
    calls = [asyncio.ensure_future(co.submit([0]))]
    for i in (1, 2, 3):
        await asyncio.sleep(0.05)
        calls.append(asyncio.ensure_future(co.submit([i])))
    await asyncio.gather(*calls)
    await asyncio.sleep(DELAY_S * 1.3)
    t0 = now()
    assert await co.submit([4]) == [("ok", 4)]
    assert now() - t0 < SLACK_S, "a lone push after a stream and a quiet spell was delayed"
    # After one that was cancelled while it waited.
    await asyncio.sleep(0.05)
    gone = co.submit_nowait([5])
    await asyncio.sleep(0.05)
    gone.cancel()
    await asyncio.sleep(DELAY_S * 1.3)
    t0 = now()
    assert await co.submit([6]) == [("ok", 6)]
    assert now() - t0 < SLACK_S, "a lone push after a cancelled one and a quiet spell was delayed"
    await co.aclose()
    assert [e for b in flush.batches for e in b] == [0, 1, 2, 3, 4, 6]
    assert_drained(co)


async def test_a_lone_submission_while_a_slow_flush_is_in_flight_on_a_free_slot_is_not_delayed() -> None:
    flush = Flush(hold=lambda n: 1.0 if n == 0 else 0.0)
    co: Coalescer[int, Any] = Coalescer(flush, max_delay_s=DELAY_S, max_in_flight=2)
    slow = asyncio.ensure_future(co.submit([0]))
    await asyncio.sleep(DELAY_S * 1.3)
    t0 = now()
    assert await co.submit([1]) == [("ok", 1)]
    assert now() - t0 < SLACK_S
    assert await slow == [("ok", 0)]
    await co.aclose()
    assert_drained(co)


async def test_a_burst_in_one_loop_turn_after_a_quiet_spell_is_not_delayed() -> None:
    flush = Flush()
    co: Coalescer[int, Any] = Coalescer(flush, max_delay_s=DELAY_S)
    await co.submit([0])
    await asyncio.sleep(DELAY_S * 1.3)
    t0 = now()
    futs = [co.submit_nowait([i]) for i in (1, 2, 3)]  # one loop turn, the first after a quiet spell
    await asyncio.wait_for(asyncio.gather(*futs), 3)
    took = now() - t0
    await co.aclose()
    assert flush.batches == [[0], [1, 2, 3]]
    assert took < SLACK_S, f"a burst after a quiet spell waited {took:.3f} s (delay {DELAY_S} s)"


# Every submission sent once, every caller answered with its own verdicts


@pytest.mark.parametrize("max_in_flight", [1, 2])
async def test_random_interleavings_lose_nothing_send_nothing_twice_and_answer_each_caller(max_in_flight: int) -> None:
    coverage: dict[str, int] = {
        k: 0
        for k in (
            "cancel_unsubmitted",
            "cancel_pending",
            "cancel_taken",
            "oversized",
            "exactly_max",
            "flushes",
            "failed_flushes",
        )
    }
    for seed in (11, 12, 13):
        await random_scenario(
            seed * 10 + max_in_flight, max_in_flight=max_in_flight, max_entries=5, delay=0.03, ops=45, coverage=coverage
        )
    # The interleavings did reach what they are meant to attack.
    assert coverage["cancel_pending"] and coverage["cancel_taken"], coverage
    assert coverage["oversized"] and coverage["exactly_max"] and coverage["failed_flushes"], coverage


async def test_cancelled_before_during_and_after_the_wait_of_every_kind() -> None:
    """One deterministic round of each cancellation moment, for a future, a Verdict and a
    task awaiting submit(): before the runner looked, during its delay, while in a flush."""
    flush = Flush(hold=lambda n: 0.3 if n in (1, 2) else 0.0)
    co: Coalescer[str, Any] = Coalescer(flush, max_delay_s=DELAY_S, max_in_flight=2)
    assert await co.submit(["lone"]) == [("ok", "lone")]
    calls: list[int] = []
    # Before the wait: cancelled in the loop turn they were submitted in.
    f_before = co.submit_nowait(["f-before"])
    v_before = co.submit_nowait(["v-before"], Verdict(lambda c: c.append(1), calls))
    t_before = asyncio.ensure_future(co.submit(["t-before"]))
    f_before.cancel()
    v_before.cancel()
    await asyncio.sleep(0)  # the task submits
    t_before.cancel()
    keep1 = co.submit_nowait(["keep1"])
    # During the wait.
    await asyncio.sleep(0.05)
    f_during = co.submit_nowait(["f-during"])
    v_during = co.submit_nowait(["v-during"], Verdict(lambda c: c.append(1), calls))
    t_during = asyncio.ensure_future(co.submit(["t-during"]))
    await asyncio.sleep(0.05)
    assert co._runner is not None and not co._runner.done() and not flush.batches[1:]
    f_during.cancel()
    v_during.cancel()
    t_during.cancel()
    keep2 = asyncio.ensure_future(co.submit(["keep2"]))
    # After being taken (flush 1 holds 0.3 s): cancel all three while it is in flight.
    await asyncio.wait_for(_until(lambda: len(flush.batches) >= 2), 3)
    assert flush.batches[1] == ["keep1", "keep2"]
    f_after = co.submit_nowait(["f-after"])
    v_after = co.submit_nowait(["v-after"], Verdict(lambda c: c.append(1), calls))
    t_after = asyncio.ensure_future(co.submit(["t-after"]))
    await asyncio.wait_for(_until(lambda: len(flush.batches) >= 3), 3)
    assert flush.batches[2] == ["f-after", "v-after", "t-after"]
    f_after.cancel()
    v_after.cancel()
    t_after.cancel()
    await asyncio.wait_for(co.aclose(), 5)
    assert await keep1 == [("ok", "keep1")]
    assert await keep2 == [("ok", "keep2")]
    for t in (t_before, t_during, t_after):
        with pytest.raises(asyncio.CancelledError):
            await t
    for f in (f_before, f_during, f_after, v_before, v_during, v_after):
        assert f.cancelled()
    assert calls == [1] * 3
    assert flush.batches == [["lone"], ["keep1", "keep2"], ["f-after", "v-after", "t-after"]]
    assert_drained(co)


async def test_a_failed_flush_fails_only_its_own_callers_and_the_next_goes_on() -> None:
    flush = Flush(fail=lambda n: n == 1)
    co: Coalescer[int, Any] = Coalescer(flush, max_delay_s=0.2, max_entries=4)
    assert await co.submit([0]) == [("ok", 0)]
    a = asyncio.ensure_future(co.submit([1]))
    await asyncio.sleep(0)  # a submits
    calls: list[int] = []
    v = co.submit_nowait([2], Verdict(lambda c: c.append(1), calls))
    await asyncio.sleep(0.02)
    b = asyncio.ensure_future(co.submit([3, 4, 5]))  # crosses max_entries: flush [1, 2] now, then [3, 4, 5]
    res = await asyncio.wait_for(asyncio.gather(a, b, return_exceptions=True), 3)
    assert isinstance(res[0], Boom) and res[0].n == 1
    assert v.done() and isinstance(v.exception(), Boom) and v.exception() is res[0] and calls == [1]
    assert res[1] == [("ok", 3), ("ok", 4), ("ok", 5)]
    assert flush.batches == [[0], [1, 2], [3, 4, 5]]
    assert await co.submit([5]) == [("ok", 5)]
    await co.aclose()
    assert_drained(co)


async def test_the_runner_ends_and_restarts_with_a_fresh_consistent_state() -> None:
    flush = Flush()
    co: Coalescer[int, Any] = Coalescer(flush, max_delay_s=0.2, max_entries=3)
    runners = []
    n = 0
    for round_ in range(4):
        # A lone one, then fast ones that fill a group (round 0, 2) or not (1, 3).
        group = [co.submit_nowait([n])]
        n += 1
        runners.append(co._runner)
        for _ in range(3 if round_ % 2 == 0 else 1):
            await asyncio.sleep(0.02)
            group.append(co.submit_nowait([n]))
            n += 1
        await asyncio.wait_for(asyncio.gather(*group), 3)
        await settle(co)
        assert co._runner is not None and co._runner.done()
        assert co._filled is None, f"round {round_}: the runner's wait left behind"
        assert_drained(co)
        await asyncio.sleep(0.25)  # quiet: the next round's first goes at once
    assert len({id(r) for r in runners}) == 4
    assert sorted(e for b in flush.batches for e in b) == list(range(n))
    # Each round: the lone one alone, the others together (the full rounds in max_entries chunks).
    assert flush.batches == [[0], [1, 2, 3], [4], [5], [6], [7, 8, 9], [10], [11]]


@pytest.mark.parametrize("max_in_flight", [1, 2])
async def test_submissions_from_a_verdict_callback_are_all_sent_once(max_in_flight: int) -> None:
    flush = Flush(hold=lambda n: 0.02)
    co: Coalescer[str, Any] = Coalescer(flush, max_delay_s=0.1, max_in_flight=max_in_flight)
    log: list[Resubmit] = []
    for tag in ("a", "b", "c"):
        v = Resubmit(co, tag, 4, log)
        co.submit_nowait([tag], v)
        await asyncio.sleep(0.01)
    await asyncio.wait_for(_until(lambda: len(log) == 15 and all(v.done() for v in log)), 10)
    for v in log:
        assert v.result() == [("ok", v.tag)]
    flushed = [e for b in flush.batches for e in b]
    assert sorted(flushed) == sorted(v.tag for v in log) and len(flushed) == 15
    await settle(co)
    assert_drained(co)


async def test_aclose_waits_for_submissions_made_from_a_verdict_callback() -> None:
    """A verdict callback submits again from the flush's task (the runner has ended by
    then, so a new one starts). aclose() must not return before those are sent."""
    flush = Flush(hold=lambda n: 0.02)
    co: Coalescer[str, Any] = Coalescer(flush, max_delay_s=0.1)
    log: list[Resubmit] = []
    co.submit_nowait(["a"], Resubmit(co, "a", 3, log))
    await asyncio.wait_for(co.aclose(), 5)
    unsent = [v.tag for v in log if not v.done()]
    assert not unsent, f"aclose() returned with {unsent} not flushed (batches {flush.batches})"
    assert_drained(co)


async def test_aclose_waits_for_submissions_made_from_a_done_callback() -> None:
    flush = Flush(hold=lambda n: 0.02)
    co: Coalescer[int, Any] = Coalescer(flush, max_delay_s=0.1)
    futs: list[asyncio.Future[Any]] = []

    def again(f: asyncio.Future[Any]) -> None:
        if len(futs) < 4:
            nxt = co.submit_nowait([len(futs)])
            futs.append(nxt)  # type: ignore[arg-type]
            nxt.add_done_callback(again)  # type: ignore[union-attr]

    first = co.submit_nowait([0])
    futs.append(first)  # type: ignore[arg-type]
    first.add_done_callback(again)  # type: ignore[union-attr]
    await asyncio.wait_for(co.aclose(), 5)
    unsent = [i for i, f in enumerate(futs) if not f.done()]
    assert not unsent, f"aclose() returned with submissions {unsent} not flushed (batches {flush.batches})"
    assert_drained(co)


async def test_submissions_from_a_done_callback_are_all_sent_once() -> None:
    flush = Flush(hold=lambda n: 0.02)
    co: Coalescer[int, Any] = Coalescer(flush, max_delay_s=0.1)
    futs: list[Any] = []

    def again(f: Any) -> None:
        if len(futs) < 6:
            nxt = co.submit_nowait([len(futs)])
            futs.append(nxt)
            nxt.add_done_callback(again)

    first = co.submit_nowait([0])
    futs.append(first)
    first.add_done_callback(again)
    await asyncio.wait_for(_until(lambda: len(futs) == 6 and all(f.done() for f in futs)), 10)
    assert [f.result() for f in futs] == [[("ok", i)] for i in range(6)]
    assert [e for b in flush.batches for e in b] == list(range(6))
    await settle(co)
    assert_drained(co)


# Cancelling the runner


@pytest.mark.parametrize("moment", ["delay", "gated"])
async def test_cancelling_the_runner_ends_every_caller_and_nothing_hangs(moment: str) -> None:
    co, flush, slots = await _runner_cancel_setup(moment)
    calls = slots.pop("calls")
    tasks = [s for k, s in slots.items() if k.startswith("t-")]
    _, hung = await asyncio.wait(tasks, timeout=2)
    assert not hung, f"{len(hung)} submit() callers still wait after the runner was cancelled"
    for name, s in slots.items():
        assert s.done() and s.cancelled(), f"{name}: {s}"
    assert calls == [1, 1]
    await asyncio.wait_for(co.aclose(), 2)
    assert flush.batches == [["t-inflight", "v-inflight"]]
    assert flush.cancelled[0]
    assert not co._pending
    # The coalescer still works afterwards (the loop may go on: score() after a cancelled runner).
    assert await asyncio.wait_for(co.submit(["after"]), 3) == [("ok", "after")]


@pytest.mark.parametrize("moment", ["delay", "gated"])
async def test_count_is_zero_after_the_runner_was_cancelled(moment: str) -> None:
    co, _, slots = await _runner_cancel_setup(moment)
    await asyncio.wait([s for k, s in slots.items() if k.startswith("t-")], timeout=2)
    await asyncio.wait_for(co.aclose(), 2)
    assert_drained(co)


async def test_after_a_runner_cancel_fast_pushes_still_wait_and_share_a_flush() -> None:
    """What a leaked _count does: with max_entries 4 and 3 entries pending at the cancel,
    each later submission brings the count to max_entries: the delay never applies again."""
    flush = Flush()
    co: Coalescer[int, Any] = Coalescer(flush, max_delay_s=DELAY_S, max_entries=4)
    await co.submit([0])
    waiting = co.submit_nowait([1, 2])
    waiting2 = co.submit_nowait([3])
    await asyncio.sleep(0.05)
    assert co._runner is not None
    co._runner.cancel()
    await asyncio.sleep(0.05)
    assert waiting.cancelled() and waiting2.cancelled()
    await asyncio.sleep(DELAY_S * 1.3)
    await co.submit([10])  # lone: at once
    a = co.submit_nowait([11])
    await asyncio.sleep(0.05)
    b = co.submit_nowait([12])
    await asyncio.wait_for(asyncio.gather(a, b), 3)
    await co.aclose()
    assert flush.batches == [[0], [10], [11, 12]], f"_count {co._count}: {flush.batches}"


async def test_a_verdict_that_submits_when_the_runner_cancels_it_does_not_strand_the_others() -> None:
    """The runner's cancel path cancels each pending slot while iterating _pending; a
    Verdict whose _settled submits again (a retry) appends to it mid-iteration."""
    flush = Flush()
    co: Coalescer[str, Any] = Coalescer(flush, max_delay_s=DELAY_S)
    await co.submit(["lone"])
    log: list[Resubmit] = []
    retrying = Resubmit(co, "r", 1, log, on_cancel=True)
    co.submit_nowait(["r"], retrying)
    other = asyncio.ensure_future(co.submit(["other"]))
    await asyncio.sleep(0.05)
    runner = co._runner
    assert runner is not None and not runner.done()
    runner.cancel()
    done, _ = await asyncio.wait([runner, other], timeout=2)
    assert runner in done
    errors = [runner.exception()] if not runner.cancelled() else []
    assert not errors, f"the runner's cancel path raised {errors[0]!r} instead of ending cancelled"
    assert other in done, "a caller pending beside the retrying Verdict hangs after the runner was cancelled"
    assert other.cancelled()
    await asyncio.wait_for(co.aclose(), 2)
    # The retry itself is either sent (a new runner) or cancelled: never left pending.
    await asyncio.wait_for(_until(lambda: all(v.done() for v in log)), 2)
    assert_drained(co)


async def test_cancelling_the_runner_in_the_turn_a_group_fills_still_cancels_its_callers() -> None:
    """The runner waits out the delay; a submission fills the group (ending the wait) and
    the producer closes (cancels the runner) in the same loop turn. On Python 3.11 wait_for returns the inner result when the inner wait finished as
    it was cancelled, so the runner's cancel would be swallowed: it goes on and flushes."""
    flush = Flush()
    co: Coalescer[int, Any] = Coalescer(flush, max_delay_s=DELAY_S, max_entries=3)
    await co.submit([0])
    a = co.submit_nowait([1])
    await asyncio.sleep(0.05)  # the runner waits out the delay
    b = co.submit_nowait([2, 3])  # the group is full: the wait ends ...
    runner = co._runner
    assert runner is not None and not runner.done()
    runner.cancel()  # ... and the runner cancelled in the same turn
    done, _ = await asyncio.wait([a, b, runner], timeout=2)  # type: ignore[list-item]
    assert len(done) == 3, "something hangs after the runner was cancelled"
    await asyncio.wait_for(co.aclose(), 2)
    assert runner.cancelled(), f"the runner's cancel was swallowed: it flushed {flush.batches[1:]} instead"
    assert a.cancelled() and b.cancelled()
    assert flush.batches == [[0]]


# Verdicts handed over by callback


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
