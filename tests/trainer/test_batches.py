"""Opening a batch (trainer/batches.py): a batch id is unique in its namespace while its
keys live. Reopening one is refused (BatchExistsError, saying when it was opened or
collected) rather than answered with its stored rewards; ``resume=True`` continues an
open, uncollected batch of the same size, width and policy, and refuses any other.
"""

from __future__ import annotations

import pytest
from helpers import WIDTH, samples, worker

from stream_reward import BatchPolicy, RewardAggregator, RolloutProducer
from stream_reward.config import ProducerConfig
from stream_reward.errors import BatchExistsError

pytestmark = pytest.mark.anyio


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
