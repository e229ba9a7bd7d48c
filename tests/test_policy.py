"""The batch failure policy: ``build_rewards`` (a pure function) directly, and end to end
(producer -> Redis -> worker -> aggregator) once per path that needs the pipeline.

A sample whose verifier kept failing is recorded ``failed`` with its reason (never
a silent 0); the batch's policy decides what the trainer sees: ``fallback`` (a
configured score at the sample's last token, valid), ``mask`` (zero row, marked
invalid) or ``drop`` (row removed). Past the batch deadline, samples without a
result resolve as failed with reason ``deadline``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from stream_reward import BatchPolicy, RewardAggregator, RolloutProducer, Trajectory
from stream_reward.config import ConsumerConfig, ProducerConfig
from stream_reward.errors import CollectTimeoutError, VerifierError
from stream_reward.scoring.scorer import Scored
from stream_reward.trainer.aggregator import BatchMeta, build_rewards
from stream_reward.wire.trajectory import ScoreResult
from stream_reward.worker.consumer import Worker

pytestmark = pytest.mark.anyio

RESPONSE_LEN = 8


class FakeVerifier:
    """Scores by exact match; 'fail' exhausts its retries, 'hang' never answers."""

    async def score(self, traj: Trajectory) -> Scored:
        if traj.response == "fail":
            raise VerifierError("verifier replied HTTP 503 (gave up after 6 attempts)", reason="http_503", attempts=6)
        if traj.response == "hang":
            await asyncio.sleep(3600)
        ok = traj.response == traj.ground_truth
        return Scored(1.0 if ok else 0.0, {"acc": ok})


@asynccontextmanager
async def worker(redis_url: str, namespace: str) -> AsyncIterator[Worker]:
    w = Worker(redis_url, FakeVerifier(), ConsumerConfig(namespace=namespace, block_ms=50, drain_timeout_s=0.2))
    stop = asyncio.Event()
    task = asyncio.create_task(w.run(stop))
    try:
        yield w
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
        await w.aclose()


# response per index; lengths chosen so each row's last token is distinct
RESPONSES = ["a", "fail", "b", "wrong", "fail", "c"]
LENGTHS = [3, 5, 1, 8, 2, 4]


async def run_batch(
    redis_url: str,
    namespace: str,
    policy: BatchPolicy,
    responses: list[str] = RESPONSES,
    lengths: list[int] = LENGTHS,
    **collect: object,
):
    batch = f"b-{policy.on_failure}-{time.monotonic_ns()}"
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
        worker(redis_url, namespace),
    ):
        await producer.open_batch(batch, len(responses), RESPONSE_LEN, policy=policy)
        await producer.push_many(
            Trajectory(
                batch, i, "test", response=r, ground_truth=r if r != "wrong" else "right", valid_response_length=n
            )
            for i, (r, n) in enumerate(zip(responses, lengths))
        )
        return await agg.collect(batch, **collect)


def row_of(rewards, index: int) -> list[float]:
    return rewards.rm_scores[rewards.indices.index(index)].tolist()


async def test_mask_zeroes_and_invalidates_failed_samples(redis_url: str, namespace: str) -> None:
    rewards = await run_batch(redis_url, namespace, BatchPolicy(on_failure="mask"), timeout_s=20)
    assert rewards.indices == [0, 1, 2, 3, 4, 5]
    assert rewards.status == ["ok", "failed", "ok", "ok", "failed", "ok"]
    assert rewards.scores == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert rewards.valid.tolist() == [True, False, True, True, False, True]
    assert row_of(rewards, 1) == [0.0] * RESPONSE_LEN
    assert row_of(rewards, 0)[2] == 1.0 and sum(row_of(rewards, 0)) == 1.0  # last valid token = length - 1
    failed = [r for r in rewards.results if r.status == "failed"]
    assert {(r.reason, r.attempts) for r in failed} == {("http_503", 6)}
    assert all("gave up" in (e or "") for e, s in zip(rewards.errors, rewards.status) if s == "failed")
    # reward_extra_info keeps one entry per sample, failed ones filled explicitly
    assert rewards.reward_extra_info["acc"] == [True, None, True, False, None, True]


def pure_batch(policy: BatchPolicy, responses: list[str] = RESPONSES, lengths: list[int] = LENGTHS):
    """What the pipeline's results for ``responses`` are, laid out by ``build_rewards`` alone."""
    results = []
    for i, (response, length) in enumerate(zip(responses, lengths)):
        if response == "fail":
            results.append(
                ScoreResult.failed(
                    f"u{i}", "pure", i, reason="http_503", error="gave up", attempts=6, valid_response_length=length
                )
            )
        else:
            ok = response != "wrong"
            results.append(ScoreResult(f"u{i}", "pure", i, float(ok), extra={"acc": ok}, valid_response_length=length))
    meta = BatchMeta(size=len(results), response_len=RESPONSE_LEN, policy=policy, created=0.0, deadline=0.0)
    return build_rewards("pure", meta, results)


def test_mask_is_the_same_without_the_pipeline() -> None:
    rewards = pure_batch(BatchPolicy(on_failure="mask"))
    assert rewards.status == ["ok", "failed", "ok", "ok", "failed", "ok"]
    assert rewards.scores == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert rewards.valid.tolist() == [True, False, True, True, False, True]
    assert rewards.reward_extra_info["acc"] == [True, None, True, False, None, True]


def test_fallback_scores_failed_samples_at_their_last_token() -> None:
    rewards = pure_batch(BatchPolicy(on_failure="fallback", fallback_score=-0.5))
    assert rewards.status.count("failed") == 2
    assert rewards.scores == [1.0, -0.5, 1.0, 0.0, -0.5, 1.0]
    assert rewards.valid.tolist() == [True] * 6
    assert row_of(rewards, 1)[LENGTHS[1] - 1] == -0.5 and sum(row_of(rewards, 1)) == -0.5
    assert row_of(rewards, 4)[LENGTHS[4] - 1] == -0.5


def test_drop_removes_failed_rows() -> None:
    rewards = pure_batch(BatchPolicy(on_failure="drop"))
    assert rewards.indices == [0, 2, 3, 5]
    assert tuple(rewards.rm_scores.shape) == (4, RESPONSE_LEN)
    assert rewards.status == ["ok"] * 4
    assert rewards.scores == [1.0, 1.0, 0.0, 1.0]
    assert all(len(column) == 4 for column in rewards.reward_extra_info.values())
    assert row_of(rewards, 3) == [0.0] * RESPONSE_LEN


def test_zero_length_response_never_writes_to_the_last_column() -> None:
    rewards = pure_batch(BatchPolicy(on_failure="fallback", fallback_score=-1.0), ["a", "fail"], [0, 0])
    assert rewards.rm_scores.abs().sum().item() == 0.0
    assert rewards.valid.tolist() == [False, False]


async def test_deadline_resolves_unfinished_samples_as_failed(redis_url: str, namespace: str) -> None:
    began = time.monotonic()
    rewards = await run_batch(
        redis_url,
        namespace,
        BatchPolicy(on_failure="mask", deadline_s=1.0),
        responses=["a", "hang", "b", "fail"],
        lengths=[1, 2, 3, 4],
    )
    elapsed = time.monotonic() - began
    assert 0.9 <= elapsed < 10  # collect returned at the deadline, not when the verifier answered
    assert rewards.status == ["ok", "failed", "ok", "failed"]
    assert [r.reason for r in rewards.results] == [None, "deadline", None, "http_503"]
    assert rewards.valid.tolist() == [True, False, True, False]
    assert rewards.scores == [1.0, 0.0, 1.0, 0.0]


async def test_deadline_with_drop(redis_url: str, namespace: str) -> None:
    rewards = await run_batch(
        redis_url,
        namespace,
        BatchPolicy(on_failure="drop", deadline_s=0.8),
        responses=["hang", "a", "hang"],
        lengths=[1, 2, 3],
    )
    assert rewards.indices == [1]
    assert tuple(rewards.rm_scores.shape) == (1, RESPONSE_LEN)


async def test_deadline_fallback_lands_on_the_last_valid_token(redis_url: str, namespace: str) -> None:
    rewards = await run_batch(
        redis_url,
        namespace,
        BatchPolicy(on_failure="fallback", fallback_score=-1.0, deadline_s=0.8),
        responses=["a", "hang"],
        lengths=[1, 2],
    )
    assert rewards.scores == [1.0, -1.0]
    assert row_of(rewards, 1)[1] == -1.0


async def test_collect_timeout_raises_or_resolves(redis_url: str, namespace: str) -> None:
    with pytest.raises(CollectTimeoutError):
        await run_batch(
            redis_url, namespace, BatchPolicy(on_failure="mask"), responses=["a", "hang"], lengths=[1, 1], timeout_s=0.5
        )
    rewards = await run_batch(
        redis_url,
        namespace,
        BatchPolicy(on_failure="mask"),
        responses=["a", "hang"],
        lengths=[1, 1],
        timeout_s=0.5,
        on_timeout="resolve",
    )
    assert rewards.status == ["ok", "failed"]
    assert rewards.results[1].reason == "timeout"
    assert rewards.valid.tolist() == [True, False]
