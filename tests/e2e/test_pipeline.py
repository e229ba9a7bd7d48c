"""Producer -> worker processes -> aggregator against a real server."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from helpers import samples_of

from stream_reward import BatchPolicy, RewardAggregator, RolloutProducer, SyncRolloutProducer, Trajectory
from stream_reward.errors import CollectTimeoutError, ConfigError
from stream_reward.trainer.rewards import merge_extra_info, place_scores
from stream_reward.wire.keys import Keys

pytestmark = pytest.mark.anyio

SCORER = "python:tests/data/scorers.py:exact"


def make_batch(batch_id: str, n: int, response_len: int, seed: int = 0) -> tuple[list[Trajectory], list[float]]:
    rng = random.Random(seed)
    trajs, expected = [], []
    for i in range(n):
        right = rng.random() < 0.6
        gt = str(rng.randint(0, 1000))
        trajs.append(
            Trajectory(
                batch_id,
                i,
                "test/exact",
                response=gt if right else gt + "0",
                ground_truth=gt,
                valid_response_length=rng.randint(0, response_len + 3),
                group=f"g{i // 4}",
                extra_info={"as_dict": i % 3 == 0},
            )
        )
        expected.append(1.0 if right else 0.0)
    return trajs, expected


async def test_two_worker_processes_score_every_sample_once(redis_url, namespace, spawn_workers):
    n, width = 600, 32
    procs = spawn_workers(2, "--scorer", SCORER, "--num-processes", "1")
    trajs, expected = make_batch("b1", n, width)
    async with (
        RolloutProducer(redis_url, _producer_config(namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await producer.open_batch("b1", n, width)
        landed = []

        async def watch():
            async for result in agg.stream("b1", timeout_s=60):
                landed.append(result.uid)

        watcher = asyncio.create_task(watch())
        for start in range(0, n, 50):  # rollouts finishing a few at a time
            await producer.push_many(trajs[start : start + 50])
            await asyncio.sleep(0.01)
        rewards = await agg.collect("b1", timeout_s=60)
        await watcher

    assert all(p.poll() is None for p in procs)
    assert rewards.status == ["ok"] * n
    assert rewards.scores == expected
    assert rewards.indices == list(range(n))
    # each uid landed exactly once on the streamed view too
    assert sorted(landed) == sorted(t.uid for t in trajs)
    # rm_scores: zero except at valid_response_length - 1 (clamped to the row; nothing for length 0)
    assert rewards.rm_scores.dtype == torch.float32 and rewards.rm_scores.shape == (n, width)
    for i, traj in enumerate(trajs):
        row = rewards.rm_scores[i]
        length = traj.valid_response_length
        if length == 0:
            assert not row.any() and not rewards.valid[i]
            continue
        col = min(length, width) - 1
        assert row[col].item() == expected[i]
        assert torch.count_nonzero(torch.cat([row[:col], row[col + 1 :]])) == 0
    # union of extra keys, explicit None for the float-returning samples
    assert set(rewards.reward_extra_info) == {"acc", "len"}
    assert rewards.reward_extra_info["acc"][1] is None and rewards.reward_extra_info["acc"][0] is not None


async def test_results_land_while_the_batch_is_still_being_generated(redis_url, namespace, spawn_workers):
    spawn_workers(1, "--scorer", SCORER)
    trajs, _ = make_batch("early", 8, 4)
    async with (
        RolloutProducer(redis_url, _producer_config(namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await producer.open_batch("early", 8, 4)
        await producer.push_many(trajs[:4])
        got = []
        async for result in agg.stream("early", timeout_s=30):
            got.append(result.index)
            if len(got) == 4:
                break
        assert sorted(got) == [0, 1, 2, 3]  # the first GRPO group is usable before the rest exists
        await producer.push_many(trajs[4:])
        rewards = await agg.collect("early", timeout_s=30)
    assert rewards.n == 8


async def test_unknown_data_source_and_scorer_errors_fail_only_their_sample(redis_url, namespace, spawn_workers):
    spawn_workers(1)  # built-in rules
    async with (
        RolloutProducer(redis_url, _producer_config(namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await producer.open_batch("mixed", 3, 8)
        await producer.push_many(
            [
                Trajectory(
                    "mixed", 0, "openai/gsm8k", response="so #### 42", ground_truth="42", valid_response_length=5
                ),
                Trajectory("mixed", 1, "no/such-source", response="x", ground_truth="1", valid_response_length=1),
                Trajectory("mixed", 2, "openai/gsm8k", response="#### 7", ground_truth="8", valid_response_length=2),
            ]
        )
        rewards = await agg.collect("mixed", timeout_s=30)
    assert rewards.status == ["ok", "failed", "ok"]
    assert rewards.scores[0] == 1.0 and rewards.scores[2] == 0.0
    assert rewards.results[1].reason == "unknown_data_source"
    assert "no/such-source" in rewards.errors[1]
    assert not rewards.valid[1] and rewards.valid[0]


async def test_collect_timeout_raises_with_counts(redis_url, namespace):
    async with (
        RolloutProducer(redis_url, _producer_config(namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await producer.open_batch("nobody", 2, 4)
        with pytest.raises(CollectTimeoutError, match="0 of 2"):
            await agg.collect("nobody", timeout_s=0.3)
        resolved = await agg.collect("nobody", timeout_s=0.1, on_timeout="resolve")
        assert resolved.status == ["failed", "failed"] and not resolved.valid.any()
        with pytest.raises(ConfigError, match="never opened"):
            await agg.collect("missing", timeout_s=0.1)


async def test_producer_refuses_duplicate_uid_in_a_batch(redis_url, namespace):
    async with RolloutProducer(redis_url, _producer_config(namespace)) as producer:
        await producer.open_batch("dup", 2, 4)
        await producer.push(Trajectory("dup", 0, "x", uid="same"))
        with pytest.raises(ConfigError, match="pushed twice"):
            await producer.push(Trajectory("dup", 1, "x", uid="same"))


def test_sync_producer_for_non_async_trainers(redis_url, namespace):
    with SyncRolloutProducer(redis_url, _producer_config(namespace)) as producer:
        producer.open_batch("sync", 3, 4, policy=BatchPolicy(on_failure="drop"))
        assert producer.push_many(Trajectory("sync", i, "x", response="r") for i in range(3)) == 3

    async def length() -> int:
        from stream_reward.wire.connection import connect

        client = connect(redis_url)
        try:
            return sum(len(samples_of(f)) for _, f in await client.xrange(Keys(namespace).stream()))
        finally:
            await client.aclose()

    assert asyncio.run(length()) == 3


def test_place_scores_never_writes_index_minus_one():
    tensor = place_scores([1.0, 2.0, 3.0, 4.0], [0, 3, None, 99], 5)
    assert tensor.tolist() == [
        [0, 0, 0, 0, 0],
        [0, 0, 2.0, 0, 0],
        [0, 0, 0, 0, 3.0],
        [0, 0, 0, 0, 4.0],
    ]


def test_merge_extra_info_is_a_union_with_explicit_fill():
    assert merge_extra_info([{"a": 1}, {}, {"b": "x", "a": 2}]) == {"a": [1, None, 2], "b": [None, None, "x"]}


def _producer_config(namespace: str):
    from stream_reward import ProducerConfig

    return ProducerConfig(namespace=namespace)
