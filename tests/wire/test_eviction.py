"""A server whose maxmemory-policy may evict keys is refused at start (wire/eviction.py):
by the producer's first open_batch, the aggregator's first collect and the worker (exit 2,
one line naming the policy and the fix), unless eviction is allowed explicitly."""

from __future__ import annotations

import asyncio
import sys

import pytest
from helpers import WIDTH, samples

from stream_reward import ProducerConfig, RewardAggregator, RolloutProducer
from stream_reward.errors import EvictionPolicyError
from stream_reward.wire.connection import connect

pytestmark = pytest.mark.anyio


@pytest.fixture
async def evicting_url(own_url: str):
    admin = connect(own_url)
    await admin.config_set("maxmemory-policy", "allkeys-lru")
    yield own_url
    await admin.aclose()


async def test_producer_refuses_a_server_that_may_evict(evicting_url: str, namespace: str) -> None:
    async with RolloutProducer(evicting_url, ProducerConfig(namespace=namespace)) as producer:
        with pytest.raises(EvictionPolicyError, match="allkeys-lru") as info:
            await producer.open_batch("b", 1, WIDTH)
    assert "noeviction" in str(info.value) and "allow-eviction" in str(info.value)
    admin = connect(evicting_url)
    try:
        assert await admin.keys(f"*{namespace}*") == [], "refused, yet it wrote"
    finally:
        await admin.aclose()


async def test_aggregator_refuses_a_server_that_may_evict(evicting_url: str, namespace: str) -> None:
    async with RewardAggregator(evicting_url, namespace=namespace) as agg:
        with pytest.raises(EvictionPolicyError, match="allkeys-lru"):
            await agg.collect("b", timeout_s=5)


async def test_worker_refuses_a_server_that_may_evict_in_one_line(evicting_url: str, namespace: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "workers", "--redis", evicting_url, "--namespace", namespace,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 2
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and "allkeys-lru" in lines[0] and "Traceback" not in lines[0], lines


async def test_allowed_eviction_runs_the_pipeline(evicting_url: str, namespace: str, spawn_workers) -> None:
    spawn_workers(1, "--allow-eviction", "--scorer", "python:tests/data/scorers.py:exact", url=evicting_url)
    config = ProducerConfig(namespace=namespace, allow_eviction=True)
    async with (
        RolloutProducer(evicting_url, config) as producer,
        RewardAggregator(evicting_url, namespace=namespace, allow_eviction=True) as agg,
    ):
        await producer.open_batch("b", 2, WIDTH)
        await producer.push_many(samples("b", ["a", "x"]))
        rewards = await agg.collect("b", timeout_s=60)
    assert (rewards.scores, rewards.status) == ([1.0, 0.0], ["ok", "ok"])
