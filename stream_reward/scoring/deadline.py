"""A timeout that holds even for a coroutine that ignores its cancellation.

``asyncio.wait_for`` cancels the awaited coroutine at the timeout and then waits for it
to end: a user's ``async def compute_score`` that catches ``CancelledError`` (a broad
``except BaseException``, a retry loop around ``await``) and keeps going would hold the
sample, and a composite's whole sample, long past its ``timeout``. ``within`` stops
waiting at the timeout plus a short grace for the cancellation to land, and leaves a
coroutine that is still running to finish on its own (logged once per scorer).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["CANCEL_GRACE_S", "within"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long a cancelled coroutine gets to end (its finally blocks, a session's close).
CANCEL_GRACE_S = 0.25

_abandoned: set[asyncio.Task[Any]] = set()  # strong references until each ends on its own
_warned: set[str] = set()


async def within(coro: Coroutine[Any, Any, T], timeout_s: float, *, what: str) -> T:
    """``await coro``, or ``asyncio.TimeoutError`` after at most ``timeout_s + CANCEL_GRACE_S``."""
    task = asyncio.ensure_future(coro)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()  # our caller gave up: so does the call (not waited for, as above)
        _abandon(task)
        raise
    if done:
        return task.result()
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
    if not done:
        _abandon(task)
        if what not in _warned:
            _warned.add(what)
            log.warning(
                "%s kept running after its %gs timeout was cancelled; it is no longer waited for", what, timeout_s
            )
    elif not task.cancelled():
        task.exception()  # retrieved: a late error of a timed-out call is not "never retrieved"
    raise asyncio.TimeoutError


def _abandon(task: asyncio.Task[Any]) -> None:
    if task.done():
        if not task.cancelled():
            task.exception()
        return
    _abandoned.add(task)
    task.add_done_callback(_forget)


def _forget(task: asyncio.Task[Any]) -> None:
    _abandoned.discard(task)
    if not task.cancelled():
        task.exception()
