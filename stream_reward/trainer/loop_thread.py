"""A private event loop in a thread: how blocking callers use the async trainer side.

``SyncRolloutProducer`` and the verl integration are called from plain threads (a
trainer that is not async, verl's sync reward function). Each owns one of these:
every Redis client lives on its loop, and ``run`` hands a coroutine to it and waits.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (its exception is raised here)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    @property
    def running(self) -> bool:
        return self.loop.is_running()

    def stop(self) -> None:
        """Stop the loop and join its thread; idempotent. Close what runs on it first."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
