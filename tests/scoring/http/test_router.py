"""The router of a multi-URL scorer and its circuit breakers: a dead server is skipped
after its breaker opens, load goes to the server with the fewest requests in flight,
every server dead fails the sample with a reason, and a breaker opens, probes once,
doubles its cool-down on a failed probe and closes on success."""

from __future__ import annotations

import asyncio

import pytest
from http_support import dead_url, scorer, traj

from stream_reward.bench.verifier_server import VerifierServer
from stream_reward.errors import VerifierError
from stream_reward.scoring.http.router import CircuitBreaker

pytestmark = pytest.mark.anyio


async def test_router_skips_a_dead_server() -> None:
    dead = dead_url()
    async with VerifierServer() as srv:
        s = scorer(f"http:{dead},{srv.url}", retries=3, options={"breaker_failures": 2, "breaker_cooldown_s": 30})
        results = [await s.score(traj(i)) for i in range(10)]
        results += await asyncio.gather(*(s.score(traj(i)) for i in range(10, 30)))
        await s.aclose()
        served = srv.stats()["requests"]
    assert all(r.score == 1.0 for r in results)
    by_url = {e["url"]: e for e in s.endpoints()}
    assert by_url[dead]["breaker"] == "open" and by_url[dead]["requests"] <= 3
    assert served == 30
    assert s.stats["failures_by_reason"] == {}


async def test_router_balances_by_requests_in_flight() -> None:
    async with VerifierServer(latency_ms_p50=30) as one, VerifierServer(latency_ms_p50=30) as two:
        s = scorer(f"http:{one.url},{two.url}")
        await asyncio.gather(*(s.score(traj(i)) for i in range(40)))
        await s.aclose()
        counts = [one.stats()["requests"], two.stats()["requests"]]
    assert sum(counts) == 40 and min(counts) >= 15


async def test_all_servers_dead_fails_with_a_reason() -> None:
    s = scorer(
        f"http:{dead_url()},{dead_url()}", retries=4, options={"breaker_failures": 1, "breaker_cooldown_s": 0.05}
    )
    with pytest.raises(VerifierError) as info:
        await s.score(traj(0))
    await s.aclose()
    assert info.value.reason == "connect"
    assert info.value.attempts == 5


def test_circuit_breaker_opens_probes_and_closes() -> None:
    now = [0.0]
    breaker = CircuitBreaker(failures=2, cooldown_s=1.0, max_cooldown_s=3.0, clock=lambda: now[0])
    breaker.failure()
    assert breaker.available()
    breaker.failure()
    assert breaker.state == "open" and not breaker.available()
    now[0] = 1.0
    assert breaker.available()
    breaker.on_pick()
    assert breaker.state == "half_open" and not breaker.available()  # one probe at a time
    breaker.failure()
    assert breaker.state == "open" and breaker.open_until == 3.0  # cool-down doubled
    now[0] = 3.0
    breaker.on_pick()
    breaker.success()
    assert breaker.state == "closed" and breaker.cooldown_s == 1.0
