"""The process's one TRL runtime: a private event loop, the embedded server, worker pools.

TRL runs async reward functions on a loop of its own (``GRPOTrainer.async_loop``, a
daemon thread); a user may call them from ``asyncio.run`` in a script, or from two
threads at once. Redis clients belong to the loop they were made on, so none of those
loops is ours: every client lives on one private loop thread (``LoopThread``), and
each call hands its coroutine over and awaits the answer from whatever loop it is on.

Without a Redis URL the first call starts one embedded server for the process and a
worker pool per distinct worker configuration (scorer, config file, processes), each
in a namespace of its own on that server: two reward functions with different
scorers (accuracy and format, say) never score each other's samples. Everything is
started once, under a lock, and stopped at interpreter exit.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import hashlib
import logging
import os
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from stream_reward.config import ProducerConfig
from stream_reward.ops.embedded import EmbeddedServer
from stream_reward.ops.pipeline import LocalPipeline
from stream_reward.trainer.loop_thread import LoopThread

__all__ = ["PoolKey", "Pool", "pool", "shutdown", "run_on_loop"]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class PoolKey:
    """What makes two reward functions share a pool: the same place and the same workers."""

    redis_url: str | None
    namespace: str
    scorer: str | None
    config: str | None
    processes: int

    def worker_args(self) -> list[str]:
        # One process per worker whatever the config file says (the pool is the
        # processes); no drain on stop: the server goes with us, nobody takes samples back.
        out = ["--processes", "1", "--drain-timeout-s", "0"]
        if self.config is not None:
            out += ["--config", self.config]
        if self.scorer is not None:
            out += ["--scorer", self.scorer]
        return out

    def private_namespace(self) -> str:
        """On the embedded server, one namespace per worker configuration."""
        digest = hashlib.sha256("\0".join([self.scorer or "", self.config or ""]).encode()).hexdigest()[:8]
        return f"{self.namespace}-{digest}"


@dataclass
class Pool:
    """A place to score: its URL and namespace, local workers (if any), and the clients
    (made on the runtime's loop, on first use)."""

    url: str
    namespace: str
    pipeline: LocalPipeline | None
    producer: Any = field(default=None, repr=False)
    aggregator: Any = field(default=None, repr=False)

    def clients(self) -> tuple[Any, Any]:
        """On the runtime's loop: the producer and aggregator of this pool."""
        if self.producer is None:
            from stream_reward.trainer.aggregator import RewardAggregator
            from stream_reward.trainer.producer import RolloutProducer

            self.producer = RolloutProducer(self.url, ProducerConfig(namespace=self.namespace))
            self.aggregator = RewardAggregator(self.url, namespace=self.namespace)
        return self.producer, self.aggregator

    async def guard(self, coro: Coroutine[Any, Any, T]) -> T:
        """``coro``, failing as soon as every local worker has exited (a scorer that
        does not load) instead of at the batch deadline."""
        if self.pipeline is None:
            return await coro
        result: T = await self.pipeline.guard(coro)
        return result

    async def aclose(self) -> None:
        if self.producer is not None:
            await self.producer.aclose()
        if self.aggregator is not None:
            await self.aggregator.aclose()
        self.producer = self.aggregator = None


class _Runtime:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.loop_thread: LoopThread | None = None
        self.server: EmbeddedServer | None = None
        self.pools: dict[PoolKey, Pool] = {}

    def loop(self) -> asyncio.AbstractEventLoop:
        with self.lock:
            if self.loop_thread is None:
                self.loop_thread = LoopThread("stream-reward-trl")
            return self.loop_thread.loop

    def pool(self, key: PoolKey) -> Pool:
        with self.lock:
            found = self.pools.get(key)
            if found is not None:
                return found
            if key.redis_url is not None:
                # Only produce and collect; the workers run elsewhere (stream-reward worker).
                made = Pool(key.redis_url, key.namespace, None)
            else:
                if self.server is None:
                    self.server = EmbeddedServer().start()
                    log.info("stream-reward: embedded server for TRL reward functions at %s", self.server.url)
                    # atexit runs last-registered first: ours must run before the server's
                    # own stop, or the workers lose their server while still reading.
                    atexit.unregister(shutdown)
                    atexit.register(shutdown)
                namespace = key.private_namespace()
                pipeline = LocalPipeline(
                    self.server.url, processes=key.processes, namespace=namespace, worker_args=key.worker_args()
                ).start()
                made = Pool(self.server.url, namespace, pipeline)
            self.pools[key] = made
            return made

    def shutdown(self) -> None:
        """Close the clients, stop the workers, the server and the loop. Idempotent."""
        with self.lock:
            pools, self.pools = list(self.pools.values()), {}
            loop_thread, self.loop_thread = self.loop_thread, None
            server, self.server = self.server, None
        if loop_thread is not None:
            for p in pools:
                with contextlib.suppress(Exception):
                    asyncio.run_coroutine_threadsafe(p.aclose(), loop_thread.loop).result(timeout=10)
        # Workers, then their server, then the loop thread: they were started on that
        # thread, and its end would SIGTERM them all at once (PR_SET_PDEATHSIG).
        for p in pools:
            if p.pipeline is not None:
                p.pipeline.stop()
        if server is not None:
            server.stop()
        if loop_thread is not None:
            loop_thread.stop()


_runtime = _Runtime()
_runtime_lock = threading.Lock()
_atexit_registered = False


def _current() -> _Runtime:
    global _runtime, _atexit_registered
    with _runtime_lock:
        if _runtime.pid != os.getpid():
            # A forked child: the parent's loop thread, server and workers are not ours.
            _runtime = _Runtime()
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True
        return _runtime


def pool(key: PoolKey) -> Pool:
    """The pool for ``key``, started on first use (once per process, whichever thread asks)."""
    return _current().pool(key)


async def run_on_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the runtime's loop and await it from the caller's loop, whichever
    that is. Cancelling the caller cancels the work on the runtime's loop too."""
    future = asyncio.run_coroutine_threadsafe(coro, _current().loop())
    return await asyncio.wrap_future(future)


def shutdown() -> None:
    """Stop everything the TRL reward functions of this process started (at exit)."""
    with _runtime_lock:
        runtime = _runtime
    if runtime.pid == os.getpid():
        runtime.shutdown()
