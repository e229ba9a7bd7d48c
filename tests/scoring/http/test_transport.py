"""``HttpScorer``, how every remote scorer's request travels: infrastructure faults
(connection errors, timeouts, 5xx, 408) are retried within the budget and then fail the
sample with the last reason; data faults (4xx, unreadable replies) fail it at once; a
429 pauses every scorer sharing the quota for its ``Retry-After``; RPM limits keep a
strict server from ever saying 429; limits need Redis.

The retry logic is checked through an injected transport (no sockets); the faults and
the quota against the reference verifier server on loopback.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from http_support import FAST_RETRY, Replies, scorer, traj

from stream_reward.bench.verifier_server import VerifierServer
from stream_reward.errors import BadReplyError, ConfigError, ScoringError, VerifierError
from stream_reward.scoring.http.verifiers import GenericVerifier

pytestmark = pytest.mark.anyio


# ---------------------------------------------------------------------- retries, through a scripted transport
async def test_infrastructure_faults_are_retried_to_success() -> None:
    transport = Replies(
        aiohttp.ClientConnectionError("reset"), (503, {"error": "busy"}), (502, b"bad gateway"), (200, {"score": 1.0})
    )
    scorer = GenericVerifier(["http://v"], transport=transport, retry=FAST_RETRY)
    assert (await scorer.score(traj())).score == 1.0
    assert len(transport.sent) == 4
    assert scorer.stats["retries"] == 3


async def test_a_spent_budget_fails_with_the_last_reason() -> None:
    transport = Replies(*[(503, b"busy")] * 4)
    scorer = GenericVerifier(["http://v"], transport=transport, retry=FAST_RETRY)
    with pytest.raises(VerifierError) as info:
        await scorer.score(traj())
    assert info.value.reason == "http_503"
    assert len(transport.sent) == 4  # the first try and three retries, no more


@pytest.mark.parametrize(
    ("reply", "reason"),
    [((200, b"<html>"), "bad_json"), ((200, {"no_score": 1}), "no_score"), ((400, b"bad input"), "http_400")],
)
async def test_data_faults_are_not_retried(reply: tuple[int, Any], reason: str) -> None:
    transport = Replies(reply, (200, {"score": 1.0}))
    scorer = GenericVerifier(["http://v"], transport=transport, retry=FAST_RETRY)
    with pytest.raises(ScoringError) as info:
        await scorer.score(traj())
    assert info.value.reason == reason
    assert not isinstance(info.value, VerifierError) or reason.startswith("http_4")
    assert len(transport.sent) == 1


# ---------------------------------------------------------------------- the failure taxonomy against a server
@pytest.mark.parametrize(
    ("fault", "reason"), [("fail_5xx_rate", "http_503"), ("reset_rate", "reset"), ("timeout_rate", "timeout")]
)
async def test_infrastructure_faults_are_retried_then_fail(fault: str, reason: str) -> None:
    async with VerifierServer(**{fault: 1.0}) as srv:
        s = scorer(f"http:{srv.url}", retries=2, timeout=0.3)
        with pytest.raises(VerifierError) as info:
            await s.score(traj(0))
        await s.aclose()
        assert srv.stats()["requests"] == 3
    assert info.value.reason == reason
    assert info.value.attempts == 3
    assert s.stats["retries"] == 2
    assert s.stats["failures_by_reason"] == {reason: 1}


async def test_408_is_retried() -> None:
    async with VerifierServer(fail_5xx_rate=1.0, fail_status=408) as srv:
        s = scorer(f"http:{srv.url}", retries=1)
        with pytest.raises(VerifierError) as info:
            await s.score(traj(0))
        await s.aclose()
    assert (info.value.reason, info.value.attempts) == ("http_408", 2)


async def test_flaky_server_is_retried_to_success() -> None:
    async with VerifierServer(fail_5xx_rate=0.3, reset_rate=0.2, seed=7) as srv:
        s = scorer(f"http:{srv.url}", retries=10)
        results = await asyncio.gather(*(s.score(traj(i)) for i in range(20)))
        await s.aclose()
    assert all(r.score == 1.0 for r in results)
    assert s.stats["retries"] > 0 and s.stats["ok"] == 20


async def test_client_errors_are_not_retried() -> None:
    async with VerifierServer() as srv:
        s = scorer(f"http:{srv.url}/no/such/path", retries=3)
        with pytest.raises(BadReplyError) as info:
            await s.score(traj(0))
        await s.aclose()
    assert (info.value.reason, info.value.attempts) == ("http_404", 1)


# ---------------------------------------------------------------------- 429s and the quota
async def test_429_pauses_every_scorer_sharing_the_quota(redis_url: str, namespace: str) -> None:
    # One request per 500 ms, no headroom; a 429 says "come back in 1 s".
    async with VerifierServer(rpm=120, rpm_burst=1, retry_after_s=1.0) as srv:
        a = scorer(f"http:{srv.url}", redis_url=redis_url, namespace=namespace, quota_key="api", retries=5)
        b = scorer(f"http:{srv.url}", redis_url=redis_url, namespace=namespace, quota_key="api", retries=5)
        await a.score(traj(0))
        second = asyncio.create_task(a.score(traj(1)))  # too soon: 429
        while (await a.limiter.state())["blocked_until"] is None:
            await asyncio.sleep(0.01)
        third = asyncio.create_task(b.score(traj(2)))  # another "worker": must wait out the pause
        results = await asyncio.wait_for(asyncio.gather(second, third), 30)
        await a.aclose()
        await b.aclose()
        stats = srv.stats(with_log=True)
    assert all(r.score == 1.0 for r in results)
    first_429 = min(t for t, _, status in stats["log"] if status == 429)
    later = [t - first_429 for t, _, _ in stats["log"] if t > first_429]
    assert later and all(dt >= 0.8 for dt in later)  # nobody came back before the Retry-After
    assert b.stats["http_429"] <= stats["http_429"] <= 4
    assert a.stats["quota_wait_s"] + b.stats["quota_wait_s"] >= 0.8


async def test_rpm_limit_keeps_a_strict_server_happy(redis_url: str, namespace: str) -> None:
    async with VerifierServer(rpm=1200, rpm_burst=4) as srv:  # 20/s, 150 ms of slack for a busy machine
        s = scorer(f"http:{srv.url}", redis_url=redis_url, namespace=namespace, max_rpm=1200, max_concurrent=4)
        began = time.monotonic()
        results = await asyncio.gather(*(s.score(traj(i)) for i in range(15)))
        elapsed = time.monotonic() - began
        await s.aclose()
        assert srv.stats()["http_429"] == 0
    assert len(results) == 15 and elapsed >= 0.6
    assert s.stats["quota_wait_s"] > 0


async def test_limits_without_redis_are_a_config_error() -> None:
    with pytest.raises(ConfigError, match="redis_url"):
        scorer("http:http://127.0.0.1:1", max_rpm=60)
