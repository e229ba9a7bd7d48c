"""A real gateway on loopback for the tests, the requests they send, and what Redis holds."""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from stream_reward.config import ProducerConfig
from stream_reward.gateway.serve import RunningGateway
from stream_reward.gateway.service import GatewayConfig
from stream_reward.ops.health import check_health
from stream_reward.ops.settings import load_settings
from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys

ECHO = "python:tests/data/gateway_scorers.py:echo"


@contextlib.asynccontextmanager
async def gateway(redis_url: str, namespace: str, **cfg: Any) -> AsyncIterator[RunningGateway]:
    """The gateway's service and HTTP server against ``redis_url``; workers are the test's."""
    settings = load_settings(env={}, flags={"connection.redis": redis_url, "connection.namespace": namespace})
    config = GatewayConfig(redis_url, ProducerConfig(namespace=namespace), **cfg)
    async with RunningGateway(config, lambda: check_health(settings)) as running:
        yield running


async def post(url: str, body: Any, *, raw: bytes | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session:
        # A file object, as aiohttp asks of a large body (raw bytes it warns about).
        kwargs: dict[str, Any] = {"data": io.BytesIO(raw)} if raw is not None else {"json": body}
        async with session.post(url, **kwargs) as resp:
            text = await resp.text()
            try:
                return resp.status, await resp.json(content_type=None)
            except ValueError:
                return resp.status, text


async def get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session:
        async with session.get(url) as resp:
            return resp.status, await resp.text()


async def enqueued(redis_url: str, namespace: str) -> tuple[int, int]:
    """(entries on the namespace's streams, batches opened): what a refused request must not grow."""
    keys = Keys(namespace)
    client = connect(redis_url)
    try:
        entries = 0
        for stream in keys.streams():
            entries += int(await client.xlen(stream))
        return entries, int(await client.zcard(keys.history()))
    finally:
        await client.aclose()


def openrlhf_body(prompts: list[str], responses: list[str], labels: list[Any], **extra: Any) -> dict[str, Any]:
    return {"query": [p + r for p, r in zip(prompts, responses)], "prompts": prompts, "labels": labels, **extra}


# A code task whose test calls a helper only the task's prompt defines.
HELPER_TASK = "def helper():\n    return 41\n\n\ndef answer():\n    '''helper() + 1'''\n"
HELPER_GT = json.dumps(
    {"test": "def check(candidate):\n    assert candidate() == helper() + 1\n", "entry_point": "answer"}
)


def sandbox_worker_args() -> tuple[str, ...]:
    uids = {"uid_base": 1_400_000 + (os.getpid() % 10_000) * 16, "uid_count": 16}
    return ("--scorer", "sandbox", "--manager-kwargs", json.dumps({"sandbox": uids}))
