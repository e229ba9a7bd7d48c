"""HTTP scorers against the reference verifier server on loopback: each protocol,
token accounting, the failure taxonomy, 429 pauses, the router and its breakers."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import pytest

from stream_reward.bench.verifier_server import VerifierServer
from stream_reward.config import ManagerConfig, QuotaConfig
from stream_reward.errors import BadReplyError, ConfigError, RetryLater, ScoringError, VerifierError
from stream_reward.scoring.http.options import HttpOptions
from stream_reward.scoring.http.router import CircuitBreaker
from stream_reward.scoring.http.verifiers import GenRMScorer, build_http_scorer, quota_name, render
from stream_reward.scoring.quota import QuotaLimiter
from stream_reward.scoring.retry import RetryPolicy, call_with_retry, parse_retry_after, status_error, transport_error
from stream_reward.wire.trajectory import Trajectory

pytestmark = pytest.mark.anyio

FAST = {"backoff_base_s": 0.01, "backoff_max_s": 0.05}


def traj(
    i: int = 0, response: str = "42", ground_truth: Any = "42", prompt: str | None = "What is 6*7?", **kw: Any
) -> Trajectory:
    return Trajectory(
        "b", i, kw.pop("data_source", "test"), response=response, ground_truth=ground_truth, prompt=prompt, **kw
    )


def scorer(
    spec: str, *, redis_url: str | None = None, namespace: str = "sr", options: dict[str, Any] | None = None, **cfg: Any
) -> Any:
    config = ManagerConfig(
        scorer=spec, redis_url=redis_url, namespace=namespace, reward_kwargs={**FAST, **(options or {})}, **cfg
    )
    return build_http_scorer(spec, config)


def dead_url() -> str:
    """A loopback port nobody listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# ---------------------------------------------------------------------- protocols
async def test_generic_verifier_scores_and_passes_extra_keys() -> None:
    async with VerifierServer() as srv:
        s = scorer(f"http:{srv.url}")
        assert s._session is None  # nothing bound before the first request
        right = await s.score(traj(0))
        wrong = await s.score(traj(1, response="41"))
        await s.aclose()
    assert right.score == 1.0 and right.extra == {"acc": True, "verifier": "reference"}
    assert wrong.score == 0.0 and wrong.extra["acc"] is False
    assert s.stats["requests"] == 2 and s.stats["ok"] == 2 and s.stats["tokens"] > 0


async def test_generic_verifier_with_the_math_rules() -> None:
    async with VerifierServer(rule="rules") as srv:
        s = scorer(f"http:{srv.url}/score")
        scored = await s.score(
            traj(0, response="so the answer is #### 72", ground_truth="72", data_source="openai/gsm8k")
        )
        await s.aclose()
    assert scored.score == 1.0


async def test_disrm_classify_uses_the_template() -> None:
    async with VerifierServer(rm_keyword="GOOD") as srv:
        default = scorer(f"disrm:{srv.url}", options={"model": "rm"})
        response_only = scorer(f"disrm:{srv.url}/classify", options={"template": "<r>{response}</r>"})
        t = traj(0, prompt="a GOOD prompt", response="plain")
        assert (await default.score(t)).score == pytest.approx(0.9)  # prompt + response
        assert (await response_only.score(t)).score == pytest.approx(0.1)  # the keyword is only in the prompt
        await default.aclose()
        await response_only.aclose()
        assert srv.stats()["by_path"] == {"/classify": 2}
    assert default.stats["tokens"] > 0


async def test_disrm_embeddings() -> None:
    async with VerifierServer() as srv:
        s = scorer(f"disrm:{srv.url}/v1", options={"api": "embeddings"})
        assert (await s.score(traj(0, response="GOOD"))).score == pytest.approx(0.9)
        await s.aclose()
        assert srv.stats()["by_path"] == {"/v1/embeddings": 1}


async def test_genrm_judges_with_the_default_template_and_pattern() -> None:
    async with VerifierServer() as srv:
        s = scorer(f"genrm:{srv.url}", options={"keep_verdict": True})
        right = await s.score(traj(0))
        wrong = await s.score(traj(1, response="41"))
        await s.aclose()
    assert right.score == 1.0 and "Score: 1" in right.extra["genrm_verdict"]
    assert wrong.score == 0.0


def parse_verdict(text: str) -> Any:
    """A user score parser (loaded by file path in a test below)."""
    if "does not match" in text:
        return {"score": -1.0, "judge": "no"}
    return {"score": 2.0, "judge": "yes"} if "matches" in text else None


async def test_genrm_user_parser_and_custom_template() -> None:
    template = "Q: {prompt}\n<reference>{ground_truth}</reference>\n<response>{response}</response>\nuse \\boxed{{}}"
    async with VerifierServer() as srv:
        s = scorer(
            f"genrm:{srv.url}/v1/chat/completions",
            options={
                "template": template,
                "system": "You are a strict grader.",
                "score_parser": f"{__file__}:parse_verdict",
            },
        )
        right = await s.score(traj(0))
        wrong = await s.score(traj(1, response="7"))
        await s.aclose()
    assert (right.score, right.extra) == (2.0, {"judge": "yes"})
    assert (wrong.score, wrong.extra) == (-1.0, {"judge": "no"})


async def test_genrm_unparseable_verdict_fails_the_sample_without_retry() -> None:
    async with VerifierServer(garbage_rate=1.0) as srv:
        s = scorer(f"genrm:{srv.url}", retries=3)
        with pytest.raises(BadReplyError) as info:
            await s.score(traj(0))
        await s.aclose()
        assert srv.stats()["requests"] == 1
    assert info.value.reason == "unparseable_verdict"
    assert info.value.attempts == 1
    assert "not able to decide" in str(info.value)
    assert s.stats["failures_by_reason"] == {"unparseable_verdict": 1}


async def test_genrm_usage_settles_tpm(redis_url: str, namespace: str) -> None:
    async with VerifierServer() as srv:
        s = scorer(
            f"genrm:{srv.url}",
            redis_url=redis_url,
            namespace=namespace,
            max_tpm=1_000_000,
            quota_key="judge",
            estimated_tokens_per_request=5000,
        )
        for i in range(3):
            await s.score(traj(i))
        await s.aclose()
        used = srv.stats()["tokens"]
    check = QuotaLimiter(redis_url, QuotaConfig("judge"), namespace=namespace)
    state = await check.state()
    await check.aclose()
    assert state["requests"] == 3
    assert state["tokens"] == used == s.stats["tokens"]  # the replies' usage, not 3 x 5000


def test_render_leaves_other_braces_alone() -> None:
    t = traj(0, response="x", ground_truth=3)
    assert render("{prompt}|{response}|{ground_truth}|\\boxed{} {unknown}", t) == "What is 6*7?|x|3|\\boxed{} {unknown}"


# ---------------------------------------------------------------------- failure taxonomy
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


async def test_garbage_replies_are_data_faults() -> None:
    async with VerifierServer(garbage_rate=1.0, seed=1) as srv:
        s = scorer(f"http:{srv.url}", retries=3)
        reasons = set()
        for i in range(6):
            with pytest.raises(BadReplyError) as info:
                await s.score(traj(i))
            assert info.value.attempts == 1
            reasons.add(info.value.reason)
        await s.aclose()
        assert srv.stats()["requests"] == 6
    assert reasons <= {"bad_json", "no_score"} and reasons
    disrm = None
    async with VerifierServer(garbage_rate=1.0) as srv:
        disrm = scorer(f"disrm:{srv.url}")
        with pytest.raises(BadReplyError, match="data"):
            await disrm.score(traj(0))
        await disrm.aclose()


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


# ---------------------------------------------------------------------- router and breakers
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


# ---------------------------------------------------------------------- specs and options
def test_bad_specs_and_options_are_config_errors() -> None:
    for spec in ("http:", "ftp:x", "http:not a url", "http:ftp://host/x", "genrm:,"):
        with pytest.raises(ConfigError):
            scorer(spec)
    with pytest.raises(ConfigError, match="colour"):
        scorer("http:http://127.0.0.1:1", options={"colour": "blue"})
    with pytest.raises(ConfigError, match="api"):
        scorer("disrm:http://127.0.0.1:1", options={"api": "rerank"})
    with pytest.raises(ConfigError, match="score_pattern"):
        scorer("genrm:http://127.0.0.1:1", options={"score_pattern": "no group"})


def test_quota_name_never_holds_credentials() -> None:
    s = scorer("genrm:https://user:secret@api.example.com/v1", options={"api_key": "sk-very-secret"})
    assert s.limiter is None  # no Redis here
    name = quota_name("genrm", ["https://user:secret@api.example.com"], HttpOptions(api_key="sk-very-secret"), None)
    assert "secret" not in name and name.startswith("key-")
    assert "secret" not in quota_name("http", ["https://user:secret@h"], HttpOptions(), None)
    assert quota_name("http", ["http://h"], HttpOptions(), "mine") == "mine"
    assert s._headers["Authorization"] == "Bearer sk-very-secret"
    assert s.name.startswith("key-") and "secret" not in s.name


def test_genrm_pattern_takes_the_last_score() -> None:
    s = GenRMScorer(["http://127.0.0.1:1"])
    assert s.verdict_score("Score: 0 at first... **Score:** 0.75").score == 0.75
    assert s.verdict_score("so \\boxed{1}").score == 1.0
    with pytest.raises(BadReplyError) as info:
        s.verdict_score("I refuse.")
    assert info.value.reason == "unparseable_verdict"


# ---------------------------------------------------------------------- retry module
def test_parse_retry_after() -> None:
    assert parse_retry_after({"retry-after-ms": "250"}) == 0.25
    assert parse_retry_after({"Retry-After": "3"}) == 3.0
    assert parse_retry_after({"Retry-After": "Wed, 21 Oct 2015 07:28:10 GMT"}, now=1445412480.0) == 10.0
    assert parse_retry_after({"Retry-After": "soon"}) is None
    assert parse_retry_after({}) is None
    assert parse_retry_after({"Retry-After": "1e9"}) == 300.0


def test_status_and_transport_errors_map_to_the_taxonomy() -> None:
    rate = status_error(429, {"Retry-After": "2"})
    assert isinstance(rate, RetryLater) and rate.rate_limited and rate.retry_after_s == 2.0
    assert isinstance(status_error(503, {}), VerifierError)
    assert isinstance(status_error(408, {}), VerifierError)
    bad = status_error(422, {}, b'{"error": "no"}')
    assert isinstance(bad, BadReplyError) and bad.reason == "http_422" and "no" in str(bad)
    assert transport_error(TimeoutError()).reason == "timeout"
    assert transport_error(ConnectionRefusedError()).reason == "connect"
    assert transport_error(ConnectionResetError()).reason == "reset"
    assert transport_error(ValueError()) is None


def test_backoff_is_jittered_and_capped() -> None:
    policy = RetryPolicy(retries=3, backoff_base_s=0.1, backoff_max_s=0.5)
    for n, ceiling in ((1, 0.1), (2, 0.2), (3, 0.4), (8, 0.5)):
        delays = [policy.backoff_s(n) for _ in range(50)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays)
        assert len(set(delays)) > 1


async def test_call_with_retry_budget_and_hooks() -> None:
    slept: list[float] = []
    paused: list[float | None] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    async def pause(s: float | None) -> None:
        paused.append(s)

    async def always_429(n: int) -> None:
        raise status_error(429, {"retry-after-ms": "1500"})

    with pytest.raises(VerifierError) as info:
        await call_with_retry(always_429, RetryPolicy(retries=2), on_rate_limited=pause, sleep=sleep)
    assert (info.value.reason, info.value.attempts) == ("http_429", 3)
    assert paused == [1.5, 1.5, 1.5] and len(slept) == 2 and all(1.5 <= s <= 1.65 for s in slept)

    calls = []

    async def bad_then(n: int) -> None:
        calls.append(n)
        raise BadReplyError("nope")

    with pytest.raises(BadReplyError) as bad:
        await call_with_retry(bad_then, RetryPolicy(retries=5), sleep=sleep)
    assert calls == [1] and bad.value.attempts == 1

    async def flaky(n: int) -> str:
        if n < 3:
            raise VerifierError("down", reason="http_502")
        return "ok"

    assert await call_with_retry(flaky, RetryPolicy(retries=5), sleep=sleep) == "ok"

    async def crash(n: int) -> None:
        raise KeyError("bug")

    with pytest.raises(KeyError):
        await call_with_retry(crash, RetryPolicy(retries=5), sleep=sleep)
    assert issubclass(VerifierError, ScoringError)
