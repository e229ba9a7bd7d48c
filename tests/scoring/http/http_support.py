"""Helpers for the HTTP scorers' tests: a sample, a scorer built from a spec as a worker
builds it, a port nobody listens on, and a scripted transport in place of aiohttp."""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping
from typing import Any

from stream_reward.config import ManagerConfig
from stream_reward.scoring.http.verifiers import build_http_scorer
from stream_reward.scoring.retry import RetryPolicy
from stream_reward.wire.trajectory import Trajectory

FAST = {"backoff_base_s": 0.01, "backoff_max_s": 0.05}  # reward_kwargs: short backoffs
FAST_RETRY = RetryPolicy(retries=3, backoff_base_s=0.001, backoff_max_s=0.002)


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
