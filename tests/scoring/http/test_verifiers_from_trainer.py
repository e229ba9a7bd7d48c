"""An HTTP verifier that succeeds after retries reports how many attempts it took."""

from __future__ import annotations

import asyncio

import pytest

from stream_reward import Trajectory

pytestmark = pytest.mark.anyio


async def test_http_success_after_retries_reports_its_attempts() -> None:
    from stream_reward.bench.verifier_server import VerifierServer
    from stream_reward.config import ManagerConfig
    from stream_reward.scoring.http.verifiers import build_http_scorer

    async with VerifierServer(fail_5xx_rate=0.5, seed=3) as srv:
        config = ManagerConfig(
            scorer=f"http:{srv.url}", retries=20, reward_kwargs={"backoff_base_s": 0.001, "backoff_max_s": 0.002}
        )
        s = build_http_scorer(config.scorer, config)
        results = await asyncio.gather(
            *(s.score(Trajectory("b", i, "test", response="1", ground_truth="1")) for i in range(20))
        )
        await s.aclose()
    assert s.stats["retries"] > 0
    assert sum(r.attempts for r in results) == 20 + s.stats["retries"]
