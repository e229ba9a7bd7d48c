"""The pool of killable scorer processes (the ``prime`` and ``remote`` managers): a hung
call is killed at its timeout and costs only that sample, a crashed process fails its
sample with its exit code, a refusal fails it with the scorer's error, and the pool
replaces what it lost."""

from __future__ import annotations

import time

import pytest
from helpers import score_batch, wait_for_workers

from stream_reward import Trajectory
from stream_reward.errors import ScorerCrashedError
from stream_reward.scoring.procpool import ProcessPool

pytestmark = pytest.mark.anyio

SCORERS = "tests/data/scorers.py"
FAST = ["--block-ms", "50", "--log-level", "ERROR"]


@pytest.mark.parametrize("manager", ["prime", "remote"])
async def test_hung_scorer_is_killed_at_its_timeout_and_a_crashed_one_replaced(
    manager, redis_url, namespace, spawn_workers
):
    spawn_workers(
        1,
        "--manager",
        manager,
        "--scorer",
        f"{SCORERS}:slow_or_hang",
        "--num-processes",
        "2",
        "--timeout-s",
        "1",
        *FAST,
    )
    responses = ["ok0", "hang", "ok2", "crash", "ok4", "raise", "ok6", "ok7"]
    trajs = [Trajectory(f"p-{manager}", i, "x", response=r, valid_response_length=1) for i, r in enumerate(responses)]
    await wait_for_workers(redis_url, namespace, 1)  # its start-up (imports) is not under test
    started = time.monotonic()
    rewards = await score_batch(redis_url, namespace, trajs)
    elapsed = time.monotonic() - started
    # The hung sample cost its 1 s timeout, not the batch (the collect's 30 s); the slack is
    # for the two replacement processes' start-up on a loaded machine.
    assert elapsed < 15, elapsed
    assert rewards.status == ["ok", "failed", "ok", "failed", "ok", "failed", "ok", "ok"]
    assert [r.reason for r in rewards.results] == [
        None,
        "timeout",
        None,
        "scorer_crashed",
        None,
        "scorer_error",
        None,
        None,
    ]
    assert "exit code 17" in rewards.errors[3]
    assert "refused this sample" in rewards.errors[5]
    assert [rewards.scores[i] for i in (0, 2, 4, 6, 7)] == [1.0] * 5
    # the pool is healthy afterwards: the killed and crashed processes were replaced
    again = [Trajectory(f"p2-{manager}", i, "x", response="fine", valid_response_length=1) for i in range(4)]
    rewards = await score_batch(redis_url, namespace, again)
    assert rewards.status == ["ok"] * 4


async def test_with_a_timeout_score_a_hung_call_is_the_samples_loss_not_a_failure():
    pool = ProcessPool(f"{SCORERS}:slow_or_hang", size=1, timeout_s=0.5, timeout_score=0.0)
    try:
        hung = await pool.score(Trajectory("ts", 0, "x", response="hang"))
        assert (hung.score, hung.extra) == (0.0, {"timeout": True})
        assert pool.kills == 1
        assert (await pool.score(Trajectory("ts", 1, "x", response="fine"))).score == 1.0
        with pytest.raises(ScorerCrashedError):  # a process that dies is still a failure
            await pool.score(Trajectory("ts", 2, "x", response="crash"))
    finally:
        await pool.aclose()


@pytest.mark.parametrize(("function", "reason"), [("sync_not_finite", "bad_score"), ("sync_no_score", "no_score")])
async def test_a_refusal_in_a_scorer_process_keeps_its_reason_alone_and_as_a_component(function, reason):
    from stream_reward.config import ManagerConfig
    from stream_reward.errors import ScoringError
    from stream_reward.scoring.registry import build_scorer

    spec = f"tests/data/composite_scorers.py:{function}"
    traj = Trajectory("b", 0, "x", response="r", ground_truth="g", uid="u0")
    pool = ProcessPool(spec, size=1, timeout_s=30)
    try:
        with pytest.raises(ScoringError) as alone:
            await pool.score(traj)
    finally:
        await pool.aclose()
    assert alone.value.reason == reason
    composite = build_scorer(ManagerConfig(components=[{"name": "check", "scorer": spec}], num_processes=1, retries=0))
    try:
        with pytest.raises(ScoringError) as inside:
            await composite.score(traj)
    finally:
        await composite.aclose()
    assert inside.value.reason == f"check:{reason}"
