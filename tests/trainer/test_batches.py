"""Opening a batch (trainer/batches.py): a batch id is unique in its namespace while its
keys live. Reopening one is refused (BatchExistsError, saying when it was opened or
collected) rather than answered with its stored rewards; ``resume=True`` continues an
open, uncollected batch of the same size, width and policy, and refuses any other.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from stream_reward import BatchPolicy, RewardAggregator, RolloutProducer, Trajectory
from stream_reward.config import ConsumerConfig, ProducerConfig
from stream_reward.errors import BatchExistsError
from stream_reward.scoring.scorer import Scored
from stream_reward.worker.consumer import Worker

pytestmark = pytest.mark.anyio


WIDTH = 8


class Exact:
    """1.0 when the response equals the ground truth, else 0.0."""

    async def score(self, traj: Trajectory) -> Scored:
        return Scored(1.0 if traj.response == traj.ground_truth else 0.0)


@asynccontextmanager
async def worker(redis_url: str, namespace: str, scorer: Any = None, **cfg: Any) -> AsyncIterator[Worker]:
    w = Worker(
        redis_url, scorer or Exact(), ConsumerConfig(namespace=namespace, block_ms=50, drain_timeout_s=0.2, **cfg)
    )
    stop = asyncio.Event()
    task = asyncio.create_task(w.run(stop))
    try:
        yield w
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
        await w.aclose()


def samples(batch: str, responses: list[str], truth: str = "a", **kw: Any) -> list[Trajectory]:
    return [
        Trajectory(batch, i, "test", response=r, ground_truth=truth, valid_response_length=i + 1, **kw)
        for i, r in enumerate(responses)
    ]


async def test_reopening_a_batch_id_is_refused_not_answered_with_old_rewards(redis_url: str, namespace: str) -> None:
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
        worker(redis_url, namespace),
    ):
        await producer.open_batch("b", 3, WIDTH)
        await producer.push_many(samples("b", ["a", "a", "a"]))
        assert (await agg.collect("b", timeout_s=20)).scores == [1.0, 1.0, 1.0]
        # The same id again (all wrong this time): refused, saying the batch was collected.
        with pytest.raises(BatchExistsError, match="collected") as info:
            await producer.open_batch("b", 3, WIDTH)
        assert "unique" in str(info.value)
        # Open and not collected: refused too, saying when it was opened.
        await producer.open_batch("c", 2, WIDTH)
        with pytest.raises(BatchExistsError, match="opened"):
            await producer.open_batch("c", 5, WIDTH)
        # A restarted producer continuing its own batch resumes it; another size or policy is refused.
        await producer.open_batch("c", 2, WIDTH, resume=True)
        with pytest.raises(BatchExistsError, match="size"):
            await producer.open_batch("c", 3, WIDTH, resume=True)
        with pytest.raises(BatchExistsError, match="on_failure"):
            await producer.open_batch("c", 2, WIDTH, resume=True, policy=BatchPolicy(on_failure="drop"))
