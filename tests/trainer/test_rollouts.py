"""``produce_rollouts``: a produce that fails never leaves its batch open."""

from __future__ import annotations

import json

import pytest

from stream_reward import ProducerConfig, RewardAggregator, RolloutProducer

pytestmark = pytest.mark.anyio


async def test_a_failed_produce_never_leaves_the_batch_open(redis_url, namespace, tmp_path, monkeypatch):
    from stream_reward.errors import BrokerError
    from stream_reward.trainer.rollouts import produce_rollouts, read_rollouts

    lines = [json.dumps({"data_source": "openai/gsm8k", "response": "#### 1", "ground_truth": "1"})] * 3
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    rollouts = read_rollouts(src, "broken")

    async def push_fails(self, trajs):
        raise BrokerError("push failed: Redis unreachable or refused")

    monkeypatch.setattr(RolloutProducer, "push_many", push_fails)
    with pytest.raises(BrokerError):
        await produce_rollouts(redis_url, rollouts, 4, ProducerConfig(namespace=namespace))
    async with RewardAggregator(redis_url, namespace=namespace) as agg:
        rewards = await agg.collect("broken", timeout_s=5)  # resolved, not open at 0/3 for good
    assert rewards.status == ["failed"] * 3
