"""The HTTP scorers' protocol logic through an injected transport: no server, no sockets.

Each test hands ``HttpScorer`` a plain async function in place of the aiohttp
session (as httpx's ``MockTransport`` takes a handler), so the request a protocol
builds, how it reads the reply, and which faults are retried are checked directly.
The end-to-end tests against the reference server on loopback are in
``test_http_scorers.py``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import aiohttp
import pytest

from stream_reward.errors import BadReplyError, ScoringError, VerifierError
from stream_reward.scoring.http.options import HttpOptions
from stream_reward.scoring.http.verifiers import DisRMScorer, GenericVerifier, GenRMScorer
from stream_reward.scoring.retry import RetryPolicy
from stream_reward.wire.trajectory import Trajectory

pytestmark = pytest.mark.anyio

FAST = RetryPolicy(retries=3, backoff_base_s=0.001, backoff_max_s=0.002)


def traj(response: str = "42", ground_truth: Any = "42") -> Trajectory:
    return Trajectory("b", 0, "test", response=response, ground_truth=ground_truth, prompt="What is 6*7?")


class Replies:
    """A transport that answers from a script and records every request it was sent."""

    def __init__(self, *replies: tuple[int, Any] | BaseException) -> None:
        self.replies = list(replies)
        self.sent: list[tuple[str, dict[str, Any], Mapping[str, str]]] = []

    async def __call__(self, url: str, body: bytes, headers: Mapping[str, str]) -> tuple[int, dict[str, str], bytes]:
        self.sent.append((url, json.loads(body), headers))
        reply = self.replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        status, content = reply
        raw = content if isinstance(content, bytes) else json.dumps(content).encode()
        return status, {}, raw


async def test_generic_verifier_request_and_reply() -> None:
    transport = Replies((200, {"score": 0.75, "why": "close"}))
    scorer = GenericVerifier(["http://v"], transport=transport, retry=FAST)
    scored = await scorer.score(traj())
    assert scored.score == 0.75
    url, body, headers = transport.sent[0]
    assert url.startswith("http://v")
    assert body["solution_str"] == "42" and body["ground_truth"] == "42" and body["prompt"] == "What is 6*7?"
    assert headers["Content-Type"] == "application/json"


async def test_infrastructure_faults_are_retried_to_success() -> None:
    transport = Replies(
        aiohttp.ClientConnectionError("reset"), (503, {"error": "busy"}), (502, b"bad gateway"), (200, {"score": 1.0})
    )
    scorer = GenericVerifier(["http://v"], transport=transport, retry=FAST)
    assert (await scorer.score(traj())).score == 1.0
    assert len(transport.sent) == 4
    assert scorer.stats["retries"] == 3


async def test_a_spent_budget_fails_with_the_last_reason() -> None:
    transport = Replies(*[(503, b"busy")] * 4)
    scorer = GenericVerifier(["http://v"], transport=transport, retry=FAST)
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
    scorer = GenericVerifier(["http://v"], transport=transport, retry=FAST)
    with pytest.raises(ScoringError) as info:
        await scorer.score(traj())
    assert info.value.reason == reason
    assert not isinstance(info.value, VerifierError) or reason.startswith("http_4")
    assert len(transport.sent) == 1


async def test_disrm_reads_the_last_probability() -> None:
    transport = Replies((200, {"data": [{"probs": [0.1, 0.9]}, {"probs": [0.3, 0.7]}]}))
    scorer = DisRMScorer(["http://rm"], transport=transport, retry=FAST, options=HttpOptions(model="rm"))
    assert (await scorer.score(traj())).score == pytest.approx(0.7)
    assert transport.sent[0][1]["model"] == "rm"


async def test_genrm_parses_the_verdict_and_rejects_nonsense() -> None:
    good = {"choices": [{"message": {"content": "Reasoning... Score: 0.5"}}], "usage": {"total_tokens": 12}}
    bad = {"choices": [{"message": {"content": "I cannot say."}}]}
    transport = Replies((200, good), (200, bad))
    scorer = GenRMScorer(["http://judge"], transport=transport, retry=FAST, options=HttpOptions(model="judge"))
    scored = await scorer.score(traj())
    assert scored.score == 0.5
    assert scorer.stats["tokens"] == 12
    messages = transport.sent[0][1]["messages"]
    assert "42" in messages[-1]["content"]  # the response went into the prompt
    with pytest.raises(BadReplyError):
        await scorer.score(traj())
