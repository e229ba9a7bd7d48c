"""Remote verifiers end to end: worker processes started with ``--scorer http:...``
against the reference server on loopback, a quota they share through Redis, the
shared 429 pause, and infrastructure faults resolved by the batch policy."""

from __future__ import annotations

import time

import pytest
from helpers import score_batch

from stream_reward import BatchPolicy, Trajectory
from stream_reward.bench.verifier_server import VerifierServer
from stream_reward.config import QuotaConfig
from stream_reward.scoring.quota import QuotaLimiter

pytestmark = pytest.mark.anyio


async def score_numbers(
    redis_url: str,
    namespace: str,
    n: int,
    *,
    policy: BatchPolicy | None = None,
    timeout_s: float = 40,
    **fields: object,
):
    batch = f"e2e-{time.monotonic_ns()}"
    trajs = [
        Trajectory(
            batch,
            i,
            "test",
            response=str(i),
            ground_truth=str(i) if i % 3 else "x",
            prompt=f"GOOD question {i}",
            valid_response_length=4,
            **fields,
        )
        for i in range(n)
    ]
    return await score_batch(redis_url, namespace, trajs, width=16, policy=policy, timeout_s=timeout_s)


async def quota_state(redis_url: str, namespace: str, name: str) -> dict:
    limiter = QuotaLimiter(redis_url, QuotaConfig(name), namespace=namespace)
    try:
        return await limiter.state()
    finally:
        await limiter.aclose()


@pytest.mark.parametrize("kind", ["http", "disrm", "genrm"])
async def test_each_protocol_through_a_worker(redis_url: str, namespace: str, spawn_workers, kind: str) -> None:
    async with VerifierServer() as srv:
        spawn_workers(1, "--scorer", f"{kind}:{srv.url}")
        rewards = await score_numbers(redis_url, namespace, 6)
    assert rewards.status == ["ok"] * 6
    if kind == "disrm":
        assert rewards.scores == pytest.approx([0.9] * 6)  # the prompt holds the RM's keyword
    else:
        assert rewards.scores == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]


async def test_two_workers_share_one_rpm_quota(redis_url: str, namespace: str, spawn_workers) -> None:
    # 10 requests/s with 5 of headroom (room for a busy machine's hiccups): two
    # workers each limiting itself to 10/s would trip it within a second.
    async with VerifierServer(rpm=600, rpm_burst=5) as srv:
        spawn_workers(
            2,
            "--scorer",
            f"http:{srv.url}",
            "--max-rpm",
            "600",
            "--quota-key",
            "shared",
            "--read-count",
            "2",
            "--concurrency",
            "4",
        )
        rewards = await score_numbers(redis_url, namespace, 30)
        stats = srv.stats(with_log=True)
    assert rewards.status == ["ok"] * 30
    assert stats["http_429"] == 0 and stats["ok"] == 30
    arrivals = sorted(t for t, _, _ in stats["log"])
    assert arrivals[-1] - arrivals[0] >= 29 / 10 * 0.8  # paced by one schedule, not two
    state = await quota_state(redis_url, namespace, "shared")
    assert state["requests"] == 30


async def test_429_pauses_every_worker(redis_url: str, namespace: str, spawn_workers) -> None:
    # The workers know no limit; the server allows 2/s, no headroom, and says "back in 1.5 s".
    async with VerifierServer(rpm=120, rpm_burst=1, retry_after_s=1.5) as srv:
        spawn_workers(
            2,
            "--scorer",
            f"http:{srv.url}",
            "--retries",
            "20",
            "--quota-key",
            "paused",
            "--read-count",
            "2",
            "--concurrency",
            "3",
        )
        rewards = await score_numbers(redis_url, namespace, 6, timeout_s=50)
        stats = srv.stats(with_log=True)
    assert rewards.status == ["ok"] * 6
    rejected = [t for t, _, status in stats["log"] if status == 429]
    assert rejected, "the server never said 429: the test proves nothing"
    arrivals = [t for t, _, _ in stats["log"]]
    for t in rejected:
        # A request already on the wire when the 429 came may land just after it
        # (later on a busy machine); after that, nobody comes back before the Retry-After.
        assert not [a for a in arrivals if t + 0.3 < a < t + 1.2], "a worker ignored the shared pause"
    assert (await quota_state(redis_url, namespace, "paused"))["http_429"] == len(rejected)


async def test_failing_verifier_marks_samples_failed_and_the_policy_applies(
    redis_url: str, namespace: str, spawn_workers
) -> None:
    async with VerifierServer(fail_5xx_rate=1.0) as srv:
        spawn_workers(1, "--scorer", f"http:{srv.url}", "--retries", "1", "--reward-kwargs", '{"backoff_base_s": 0.01}')
        masked = await score_numbers(redis_url, namespace, 4, policy=BatchPolicy(on_failure="mask"))
        fallback = await score_numbers(
            redis_url, namespace, 2, policy=BatchPolicy(on_failure="fallback", fallback_score=0.25)
        )
        assert srv.stats()["http_5xx"] == 12
    assert masked.status == ["failed"] * 4
    assert {(r.reason, r.attempts) for r in masked.results} == {("http_503", 2)}
    assert masked.valid.tolist() == [False] * 4
    assert fallback.scores == [0.25, 0.25] and fallback.rm_scores[:, 3].tolist() == [0.25, 0.25]


async def test_router_with_a_dead_server_in_a_worker(redis_url: str, namespace: str, spawn_workers) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    async with VerifierServer() as srv:
        spawn_workers(1, "--scorer", f"http:{dead},{srv.url}", "--retries", "3")
        rewards = await score_numbers(redis_url, namespace, 20)
        served = srv.stats()["ok"]
    assert rewards.status == ["ok"] * 20 and served == 20
