"""A producer pushing to more batches at once than it remembers (issue 12: a KeyError
past 64 concurrent batches, when one push evicted another's uid set mid-push)."""

from __future__ import annotations

import asyncio

import pytest

from stream_reward.config import ProducerConfig
from stream_reward.trainer.batches import _RECENT_BATCHES
from stream_reward.trainer.producer import RolloutProducer
from stream_reward.wire.trajectory import Trajectory


@pytest.mark.anyio
async def test_concurrent_pushes_to_more_batches_than_remembered(redis_url: str, namespace: str) -> None:
    n = _RECENT_BATCHES * 3
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
        await asyncio.gather(*(producer.open_batch(f"b{i}", 1, 8) for i in range(n)))
        pushed = await asyncio.gather(
            *(producer.push_many([Trajectory(f"b{i}", 0, "openai/gsm8k", "#### 1", "1")]) for i in range(n))
        )
    assert pushed == [1] * n
