"""An event-loop watchdog: finds an ``async`` scorer that blocks the loop.

An ``async def`` scorer that calls blocking code (``time.sleep``, a sync HTTP
client, a long computation) freezes the whole worker: no other sample runs, no
heartbeat goes out, and its own timeout cannot fire, because timeouts are
callbacks of the very loop it blocks.

A thread watches a tick the loop advances every ``tick_s``. When the tick is
older than ``warn_after_s`` it signals the main thread; the signal handler runs
inside the blocking code (Python runs handlers between bytecodes, and a blocking
``sleep`` or ``read`` returns early for them), so it can read which sample the
scorer is on from a context variable the consumer sets around each scorer call.
It logs the scorer and the sample once per stall, and past the scorer's timeout
raises ScorerTimeoutError right there: the sample fails as `timeout`, as it would
have had the scorer awaited. Outside a scorer call the handler only logs.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import signal
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

from stream_reward.errors import ScorerTimeoutError

__all__ = ["LoopWatchdog", "SampleInfo", "scoring"]

log = logging.getLogger(__name__)

# Not used by the worker otherwise; the handler is installed in the main thread only.
_SIGNAL = signal.SIGUSR2


@dataclass(frozen=True)
class SampleInfo:
    scorer: str
    uid: str
    batch_id: str
    index: int


# Set by the consumer around each scorer call (tasks the scorer starts inherit it): the
# scorer's name and the trajectory, as a plain tuple. It is set once per sample, and a
# SampleInfo (a frozen dataclass) cost 1.5 us to build there; the handler builds it.
scoring: contextvars.ContextVar[tuple[str, Any] | None] = contextvars.ContextVar("scoring", default=None)


def _sample_info(current: tuple[str, Any] | None) -> SampleInfo | None:
    if current is None:
        return None
    scorer, traj = current
    return SampleInfo(scorer, traj.uid, traj.batch_id, traj.index)


class LoopWatchdog:
    """``LoopWatchdog(warn_after_s, timeout_s).start(loop)`` from the loop's thread; ``stop()``."""

    def __init__(self, warn_after_s: float = 1.0, timeout_s: float | None = None, tick_s: float = 0.1) -> None:
        self.warn_after_s = warn_after_s
        self.timeout_s = timeout_s
        self.tick_s = tick_s
        self.stalls = 0
        self._tick = time.monotonic()
        self._stop = threading.Event()
        self._main_id: int | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._reported: float | None = None  # the tick of the stall already logged
        self._previous_handler: object = None

    def start(self) -> LoopWatchdog:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers live in the main thread only: no watchdog elsewhere
        self._main_id = threading.get_ident()
        self._previous_handler = signal.signal(_SIGNAL, self._on_signal)
        self._tick = time.monotonic()
        self._ticker = asyncio.get_running_loop().create_task(self._beat())
        self._thread = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.cancel()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        if self._main_id is not None and self._previous_handler is not None:
            signal.signal(_SIGNAL, self._previous_handler)  # type: ignore[arg-type]

    async def _beat(self) -> None:
        while True:
            self._tick = time.monotonic()
            await asyncio.sleep(self.tick_s)

    def _watch(self) -> None:
        assert self._main_id is not None
        while not self._stop.wait(self.tick_s):
            stalled_s = time.monotonic() - self._tick
            if stalled_s < self.warn_after_s:
                continue
            due_timeout = self.timeout_s is not None and stalled_s >= self.timeout_s
            if self._reported == self._tick and not due_timeout:
                continue
            signal.pthread_kill(self._main_id, _SIGNAL)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        stalled_s = time.monotonic() - self._tick
        if stalled_s < self.warn_after_s:
            return  # the loop moved on meanwhile
        sample = _sample_info(scoring.get())
        if self._reported != self._tick:
            self._reported = self._tick
            self.stalls += 1
            where = f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}" if frame else "?"
            if sample is not None:
                log.warning(
                    "async scorer %r is blocking the event loop (%.1fs so far, at %s) on sample %r "
                    "(batch %r, index %d): no other sample runs meanwhile; make it a plain `def` "
                    "(it then runs in scorer processes) or await instead of blocking",
                    sample.scorer,
                    stalled_s,
                    where,
                    sample.uid,
                    sample.batch_id,
                    sample.index,
                )
            else:
                log.warning("the event loop is blocked (%.1fs so far, at %s)", stalled_s, where)
        if sample is not None and self.timeout_s is not None and stalled_s >= self.timeout_s:
            # Raised inside the blocking scorer code: the sample fails as `timeout`.
            raise ScorerTimeoutError(
                f"async scorer {sample.scorer!r} blocked the event loop past its {self.timeout_s:g}s timeout"
            )
