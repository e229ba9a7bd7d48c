"""Requests are independent batches: a burst of 64 concurrent OpenRLHF requests
completes, every reward right, with one global quota held across the worker processes
(a real verifier on loopback counts the requests in flight).

64 samples a request here (a verifier call per sample costs ~1 ms of CPU on each side:
the suite's share stays under 10 s). The issue's full size, 64 requests of 256:
``STREAM_REWARD_TEST_BURST_SAMPLES=256 pytest tests/gateway/test_burst.py`` (~30 s)."""

from __future__ import annotations

import asyncio
import os

import pytest
from gateway_support import gateway, post

from stream_reward.bench.verifier_server import VerifierServer

pytestmark = pytest.mark.anyio

REQUESTS, MAX_CONCURRENT = 64, 6
SAMPLES = int(os.environ.get("STREAM_REWARD_TEST_BURST_SAMPLES", "64"))


@pytest.mark.timeout(400)
async def test_a_burst_of_64_requests_holds_the_quota(redis_url, namespace, spawn_workers) -> None:
    async with VerifierServer() as verifier:
        spawn_workers(
            2,
            "--scorer",
            f"http:{verifier.url}",
            "--max-concurrent",
            str(MAX_CONCURRENT),
            "--quota-key",
            f"burst-{namespace}",
            "--concurrency",
            "16",
        )
        async with gateway(redis_url, namespace, data_source="test", timeout_s=360) as gw:

            async def one(r: int) -> tuple[int, dict]:
                # Sample i of request r is right when i % 3 != 0: each reply is checked row by row.
                responses = [str(r * SAMPLES + i) for i in range(SAMPLES)]
                labels = [resp if i % 3 else "wrong" for i, resp in enumerate(responses)]
                prompts = [f"p{r}-{i}:" for i in range(SAMPLES)]
                body = {"query": [p + a for p, a in zip(prompts, responses)], "prompts": prompts, "labels": labels}
                return await post(f"{gw.url}/openrlhf", body)

            replies = await asyncio.gather(*(one(r) for r in range(REQUESTS)))
        stats = verifier.stats()
    expected = [0.0 if i % 3 == 0 else 1.0 for i in range(SAMPLES)]
    for status, reply in replies:
        assert status == 200, reply
        assert reply["rewards"] == expected
    assert stats["ok"] == REQUESTS * SAMPLES and stats["http_429"] == 0
    assert 1 <= stats["max_in_flight"] <= MAX_CONCURRENT
