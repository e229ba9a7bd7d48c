"""Group commit for pushes: concurrent ``push()`` calls share one round trip.

An agent loop pushes one trajectory at a time from many tasks. Each call hands
its entries to the coalescer and awaits its own verdict; one runner task takes
everything submitted during the current event-loop turn (and, with
``max_delay_s`` > 0, a little longer, up to ``max_entries``) and sends it in
one flush. While a flush is in flight new calls gather for the next one, so
under load the batches grow by themselves and at low load a lone push waits
one loop turn, not a timer. ``max_delay_s`` applies only while pushes come
faster than it (a group's first push came less than the delay after the push
before it): a push after a quiet spell goes at once. A caller's await returns
only after its flush came back from Redis: the sample is durably queued (or
refused) by then.

A submitter that only needs a callback (``score()``, one sample each) passes a
``Verdict`` instead of taking a future: the flush hands it the verdicts at once.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar, Union, cast

__all__ = ["Coalescer", "Verdict"]

E = TypeVar("E")
R = TypeVar("R")


# A Verdict's states (plain ints: an Enum member lookup costs a descriptor call on 3.11).
_PENDING, _DONE, _FAILED, _CANCELLED = 0, 1, 2, 3
_STATE_NAMES = ("pending", "done", "failed", "cancelled")


class Verdict(Generic[R]):
    """One submission's verdicts, handed to ``then(arg)`` the moment they are set.

    The part of a future the coalescer and ``score()`` use, without the loop in
    between: a future's callback is a Handle run on a later loop turn (and the
    future itself one more object per sample), which on the per-sample path was
    about a twentieth of the trainer's CPU per sample. ``then`` runs in whoever
    sets the verdict (the flush's task, the runner at a close, or a caller that
    cancels): it must not block and should not raise; if it does, the loop's
    exception handler hears it and the other submissions of the flush still get
    theirs.
    """

    __slots__ = ("_state", "_value", "_then", "_arg", "_waiter")

    def __init__(self, then: Callable[[Any], None], arg: Any) -> None:
        self._state = _PENDING
        self._value: Any = None
        self._then: Callable[[Any], None] | None = then
        self._arg = arg
        self._waiter: asyncio.Future[None] | None = None

    def done(self) -> bool:
        return self._state != _PENDING

    def cancelled(self) -> bool:
        return self._state == _CANCELLED

    def result(self) -> R:
        if self._state == _DONE:
            return self._value  # type: ignore[no-any-return]
        raise self._error()

    def exception(self) -> BaseException | None:
        if self._state == _DONE:
            return None
        if self._state == _FAILED:
            return self._value  # type: ignore[no-any-return]
        raise self._error()

    def _error(self) -> BaseException:
        if self._state == _FAILED:
            return self._value  # type: ignore[no-any-return]
        if self._state == _CANCELLED:
            return asyncio.CancelledError()
        return asyncio.InvalidStateError("verdict is not set yet")

    def set_result(self, value: R) -> None:
        self._finish(_DONE, value)

    def set_exception(self, exc: BaseException) -> None:
        self._finish(_FAILED, exc)

    def cancel(self) -> bool:
        if self._state != _PENDING:
            return False
        self._finish(_CANCELLED, None)
        return True

    async def wait(self) -> None:
        """Until the verdict is set (set, failed or cancelled: this never raises for it)."""
        if self._state == _PENDING:
            if self._waiter is None or self._waiter.done():  # (done: cancelled with an earlier waiting caller)
                self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter

    def _finish(self, state: int, value: Any) -> None:
        if self._state != _PENDING:
            raise asyncio.InvalidStateError(f"verdict already {_STATE_NAMES[self._state]}")
        self._state, self._value = state, value
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        try:
            self._settled()
        except Exception as exc:  # as a future's callback would: reported, and the flush goes on
            asyncio.get_running_loop().call_exception_handler(
                {"message": "exception in a verdict callback", "exception": exc}
            )

    def _settled(self) -> None:
        """The verdict is set: call ``then(arg)``. A subclass that is itself what a verdict
        decides about overrides this instead (score()'s call: one object per sample)."""
        # Dropped once called: the argument (score()'s push) holds this verdict, and a cycle
        # would leave every sample's objects to the garbage collector.
        then, arg, self._then, self._arg = self._then, self._arg, None, None
        if then is not None:
            then(arg)


# What a submission's verdicts go to: a future of the coalescer's, or the submitter's Verdict.
_Slot = Union["asyncio.Future[list[R]]", Verdict[list[R]]]


class Coalescer(Generic[E, R]):
    """``await coalescer.submit(entries) -> verdicts``; ``flush(all entries) -> verdicts`` in order."""

    def __init__(
        self,
        flush: Callable[[list[E]], Awaitable[list[R]]],
        *,
        max_entries: int = 1024,
        max_delay_s: float = 0.0,
        max_in_flight: int = 1,
    ) -> None:
        self._flush = flush
        self.max_in_flight = max_in_flight
        self.max_entries = max_entries
        self.max_delay_s = max_delay_s
        self._pending: deque[tuple[list[E], _Slot[R]]] = deque()
        self._count = 0
        self._runner: asyncio.Task[None] | None = None
        self._filled: asyncio.Future[None] | None = None  # set while the runner waits out the delay
        self._flushes: set[asyncio.Task[None]] = set()
        self._taken: dict[int, list[E]] = {}  # taken into a flush whose task has not called flush yet
        self._last_submit = -math.inf  # loop.time() of the last submission
        self._gap = math.inf  # how long after the submission before it the group's first came

    async def submit(self, entries: list[E]) -> list[R]:
        # Not shielded: a cancelled caller whose entries are already in a flush still
        # has them sent (the flush is the runner's); one not yet taken is skipped.
        return await cast("asyncio.Future[list[R]]", self.submit_nowait(entries))

    def submit_nowait(self, entries: list[E], verdict: Verdict[list[R]] | None = None) -> _Slot[R]:
        """Queue ``entries`` for the next flush; the returned future (or ``verdict``, when
        given) gets their verdicts. Cancelling it skips entries not yet taken into a flush."""
        # The loop's clock, the one the delay's timer runs on: one clock a test can control.
        loop = asyncio.get_running_loop()
        now = loop.time()
        if not self._pending:  # the first of a group: the group waits only if it came close behind
            self._gap = now - self._last_submit
        self._last_submit = now
        fut: _Slot[R] = verdict if verdict is not None else loop.create_future()
        self._pending.append((entries, fut))
        self._count += len(entries)
        if self._runner is None or self._runner.done():
            self._runner = asyncio.ensure_future(self._run())
        elif self._count >= self.max_entries and self._filled is not None:
            _resolve(self._filled)
        return fut

    async def _run(self) -> None:
        flushes = self._flushes  # the runner ends when nothing is pending; flushes finish on their own
        try:
            while self._pending:
                # Waiting pays only while more are coming: at 2,000-5,000 pushes a second,
                # 1 ms made flushes of 3-8 samples 6-18, and every process spent 15-25% less
                # CPU a sample. A group whose first push came after a quiet spell (the push
                # before it over a delay ago) goes at once, with whatever joined it in the
                # same loop turn (a lone push, a GRPO group's pushes from one gather).
                if self.max_delay_s > 0 and self._count < self.max_entries and self._gap < self.max_delay_s:
                    await self._wait_for_more()
                else:
                    await asyncio.sleep(0)  # let the callers of this loop turn join
                while self._pending:
                    if len(flushes) >= self.max_in_flight:
                        await asyncio.wait(flushes, return_when=asyncio.FIRST_COMPLETED)
                        continue
                    taken = self._take()
                    if taken:
                        batch = [e for entries, _ in taken for e in entries]
                        self._taken[id(batch)] = batch
                        task = asyncio.ensure_future(self._send(taken, batch))
                        flushes.add(task)
                        task.add_done_callback(functools.partial(self._sent, taken, batch))
        except asyncio.CancelledError:  # the producer is closing under its callers
            for task in flushes:
                task.cancel()
            # One by one, counted out: a slot whose cancel submits again (a retry) adds to
            # the queue meanwhile, and that one is cancelled too, not left behind.
            while self._pending:
                entries, fut = self._pending.popleft()
                self._count -= len(entries)
                fut.cancel()
            raise

    async def _wait_for_more(self) -> None:
        """Until ``max_delay_s`` is up or the group is full (``submit_nowait`` resolves the
        future). A future and a timer, not ``wait_for(event.wait())``: that costs a task
        per flush, and on Python 3.11 it drops a cancel that comes in the loop turn the
        wait ends (the producer closing as a group fills), so the runner would go on."""
        loop = asyncio.get_running_loop()
        self._filled = filled = loop.create_future()
        timer = loop.call_later(self.max_delay_s, _resolve, filled)
        try:
            await filled
        finally:
            timer.cancel()
            self._filled = None

    def _take(self) -> list[tuple[list[E], _Slot[R]]]:
        taken: list[tuple[list[E], _Slot[R]]] = []
        size = 0
        while self._pending and (not taken or size + len(self._pending[0][0]) <= self.max_entries):
            entries, fut = self._pending.popleft()
            self._count -= len(entries)
            if fut.cancelled():
                continue
            taken.append((entries, fut))
            size += len(entries)
        return taken

    async def _send(self, taken: list[tuple[list[E], _Slot[R]]], batch: list[E]) -> None:
        self._taken.pop(id(batch), None)  # flush has it from here
        try:
            verdicts = await self._flush(batch)
        except asyncio.CancelledError:
            for _, fut in taken:
                fut.cancel()
            raise
        except Exception as exc:  # each caller hears its flush's error; the runner goes on
            for _, fut in taken:
                if not fut.done():
                    fut.set_exception(exc)
            return
        at = 0
        for entries, fut in taken:
            if not fut.done():
                fut.set_result(verdicts[at : at + len(entries)])
            at += len(entries)

    def _sent(self, taken: list[tuple[list[E], _Slot[R]]], batch: list[E], task: asyncio.Task[None]) -> None:
        """A flush task ended. One cancelled before it first ran (its loop closing) never
        reached its own cancel handling: its callers' verdicts are cancelled here, or they
        would wait for ever."""
        self._flushes.discard(task)
        if self._taken.get(id(batch)) is batch:
            del self._taken[id(batch)]
        for _, fut in taken:
            if not fut.done():
                fut.cancel()

    def unsent(self) -> int:
        """Entries submitted and not yet handed to ``flush`` (not counting those whose
        submitter gave up before their flush took them)."""
        pending = sum(len(entries) for entries, fut in self._pending if not fut.cancelled())
        return pending + sum(len(batch) for batch in self._taken.values())

    async def aclose(self) -> None:
        """Wait for what was submitted to be flushed, and for what that submits in turn
        (a verdict's callback that submits again starts a new runner meanwhile)."""
        while True:
            await asyncio.sleep(0)  # the callbacks of verdicts already set run first
            busy = [t for t in (self._runner, *self._flushes) if t is not None and not t.done()]
            if not busy:
                return  # nothing pending either: a submission always has a runner
            await asyncio.gather(*busy, return_exceptions=True)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
