"""The blocking producer: ``RolloutProducer``'s calls for trainers that are not async.

One private event loop in a thread (``loop_thread.py``) runs the async producer; each
call blocks until its coroutine ends there, so many threads may call at once.
"""

from __future__ import annotations

from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

from stream_reward.config import BatchPolicy, ProducerConfig
from stream_reward.trainer.loop_thread import LoopThread
from stream_reward.trainer.producer import RolloutProducer
from stream_reward.wire.trajectory import ScoreResult, Trajectory

__all__ = ["SyncRolloutProducer"]

T = TypeVar("T")


class SyncRolloutProducer:
    """Blocking wrapper for trainers that are not async: one private loop in a thread."""

    def __init__(self, redis_url: str, config: ProducerConfig | None = None) -> None:
        self._thread = LoopThread("stream-reward-producer")
        self._producer = RolloutProducer(redis_url, config)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._thread.run(coro)

    def open_batch(
        self, batch_id: str, size: int, response_len: int, *, policy: BatchPolicy | None = None, resume: bool = False
    ) -> None:
        self._run(self._producer.open_batch(batch_id, size, response_len, policy=policy, resume=resume))

    def push(self, traj: Trajectory) -> None:
        self._run(self._producer.push(traj))

    def score(self, traj: Trajectory, *, timeout_s: float | None = None) -> ScoreResult:
        """Push and wait for the sample's result; safe to call from many threads at once."""
        return self._run(self._producer.score(traj, timeout_s=timeout_s))

    def push_many(self, trajs: Iterable[Trajectory]) -> int:
        return self._run(self._producer.push_many(list(trajs)))

    def close(self) -> None:
        if self._thread.running:
            self._run(self._producer.aclose())
            self._thread.stop()

    def __enter__(self) -> SyncRolloutProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
