"""A scorer's timeout holds even when its coroutine swallows the cancellation: the
composite (and a plain ``async def`` scorer) stops waiting at the timeout plus a short
grace and records ``timeout``; the abandoned coroutine ends on its own."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from stream_reward import Trajectory
from stream_reward.config import ManagerConfig
from stream_reward.errors import ScorerTimeoutError, ScoringError
from stream_reward.scoring import deadline
from stream_reward.scoring.registry import build_scorer

pytestmark = pytest.mark.anyio

DATA = str(Path(__file__).resolve().parent.parent / "data" / "composite_scorers.py")
HOLD_S = 3.5  # how long the component keeps running after its cancellation
TIMEOUT_S = 0.3
BOUND_S = 3.0  # timeout + grace is 0.55 s: generous for a loaded machine, well under HOLD_S


def traj() -> Trajectory:
    return Trajectory("b", 0, "openai/gsm8k", response="#### 72", ground_truth="72", uid="u0")


async def _ended_abandoned() -> None:
    # The abandoned coroutine runs out its HOLD_S before the test's loop closes.
    await asyncio.gather(*deadline._abandoned, return_exceptions=True)


@pytest.mark.parametrize("required", [True, False])
async def test_a_component_that_swallows_its_cancellation_times_out_on_time(required: bool) -> None:
    stubborn = {
        "name": "stubborn",
        "scorer": f"{DATA}:ignores_cancel",
        "timeout_s": TIMEOUT_S,
        "required": required,
        "reward_kwargs": {"hold_s": HOLD_S},
    }
    scorer = build_scorer(ManagerConfig(components=[{"name": "correct", "scorer": "rules"}, stubborn], retries=0))
    started = time.perf_counter()
    try:
        if required:
            with pytest.raises(ScoringError) as info:
                await scorer.score(traj())
            assert info.value.reason == "stubborn:timeout"
            extra = info.value.extra
        else:
            extra = (await scorer.score(traj())).extra
        took = time.perf_counter() - started
        assert took < BOUND_S, took
        assert extra["stubborn_status"] == "timeout" and extra["stubborn"] is None
        assert TIMEOUT_S * 1000 * 0.8 <= extra["stubborn_latency_ms"] < BOUND_S * 1000
    finally:
        await scorer.aclose()
        await _ended_abandoned()


async def test_a_plain_async_scorer_that_swallows_its_cancellation_times_out_on_time() -> None:
    scorer = build_scorer(
        ManagerConfig(scorer=f"{DATA}:ignores_cancel", timeout=TIMEOUT_S, reward_kwargs={"hold_s": HOLD_S})
    )
    started = time.perf_counter()
    try:
        with pytest.raises(ScorerTimeoutError):
            await scorer.score(traj())
        assert time.perf_counter() - started < BOUND_S
    finally:
        await _ended_abandoned()
