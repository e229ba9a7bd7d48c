"""The three protocols — the generic verifier, the discriminative RM (DisRM) and the LLM
judge (GenRM): what each sends, how it reads the reply, and how a spec and its options
become a scorer.

A protocol's request and reply are checked through an injected transport (no server,
no sockets, as httpx's ``MockTransport`` takes a handler); the rest against the
reference verifier server on loopback. An unreadable reply is a data fault: it fails
the sample at once, never retried. The quota name built from a spec never holds a
credential.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from http_support import FAST_RETRY, Replies, scorer, traj

from stream_reward import Trajectory
from stream_reward.bench.verifier_server import VerifierServer
from stream_reward.config import QuotaConfig
from stream_reward.errors import BadReplyError, ConfigError
from stream_reward.scoring.http.options import HttpOptions
from stream_reward.scoring.http.verifiers import DisRMScorer, GenericVerifier, GenRMScorer, quota_name, render
from stream_reward.scoring.quota import QuotaLimiter

pytestmark = pytest.mark.anyio


# ---------------------------------------------------------------------- requests and replies, no server
async def test_generic_verifier_request_and_reply() -> None:
    transport = Replies((200, {"score": 0.75, "why": "close"}))
    scorer = GenericVerifier(["http://v"], transport=transport, retry=FAST_RETRY)
    scored = await scorer.score(traj())
    assert scored.score == 0.75
    url, body, headers = transport.sent[0]
    assert url.startswith("http://v")
    assert body["solution_str"] == "42" and body["ground_truth"] == "42" and body["prompt"] == "What is 6*7?"
    assert headers["Content-Type"] == "application/json"


async def test_disrm_reads_the_last_probability() -> None:
    transport = Replies((200, {"data": [{"probs": [0.1, 0.9]}, {"probs": [0.3, 0.7]}]}))
    scorer = DisRMScorer(["http://rm"], transport=transport, retry=FAST_RETRY, options=HttpOptions(model="rm"))
    assert (await scorer.score(traj())).score == pytest.approx(0.7)
    assert transport.sent[0][1]["model"] == "rm"


async def test_genrm_parses_the_verdict_and_rejects_nonsense() -> None:
    good = {"choices": [{"message": {"content": "Reasoning... Score: 0.5"}}], "usage": {"total_tokens": 12}}
    bad = {"choices": [{"message": {"content": "I cannot say."}}]}
    transport = Replies((200, good), (200, bad))
    scorer = GenRMScorer(["http://judge"], transport=transport, retry=FAST_RETRY, options=HttpOptions(model="judge"))
    scored = await scorer.score(traj())
    assert scored.score == 0.5
    assert scorer.stats["tokens"] == 12
    messages = transport.sent[0][1]["messages"]
    assert "42" in messages[-1]["content"]  # the response went into the prompt
    with pytest.raises(BadReplyError):
        await scorer.score(traj())


# ---------------------------------------------------------------------- against the reference server
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


async def test_disrm_embeddings_api_posts_to_v1_embeddings() -> None:
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


def test_render_leaves_other_braces_alone() -> None:
    t = traj(0, response="x", ground_truth=3)
    assert render("{prompt}|{response}|{ground_truth}|\\boxed{} {unknown}", t) == "What is 6*7?|x|3|\\boxed{} {unknown}"


def test_genrm_pattern_takes_the_last_score() -> None:
    s = GenRMScorer(["http://127.0.0.1:1"])
    assert s.verdict_score("Score: 0 at first... **Score:** 0.75").score == 0.75
    assert s.verdict_score("so \\boxed{1}").score == 1.0
    with pytest.raises(BadReplyError) as info:
        s.verdict_score("I refuse.")
    assert info.value.reason == "unparseable_verdict"


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
