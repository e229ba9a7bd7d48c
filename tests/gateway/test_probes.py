"""``GET /healthz`` is a round trip: 200 while a worker reads the group, 503 with the
reason when none does or Redis cannot be reached. ``GET /metrics`` counts requests,
samples, failures by reason and latency in Prometheus text."""

from __future__ import annotations

import json

import pytest
from gateway_support import ECHO, gateway, get, openrlhf_body, post
from helpers import metric_samples, metric_value, wait_for_workers

pytestmark = pytest.mark.anyio


async def test_healthz_is_503_without_workers_and_200_with_one(redis_url, namespace, spawn_workers) -> None:
    async with gateway(redis_url, namespace) as gw:
        status, text = await get(f"{gw.url}/healthz")
        assert status == 503 and "no worker heartbeat" in json.loads(text)["reason"]
        spawn_workers(1, "--scorer", ECHO)
        await wait_for_workers(redis_url, namespace, 1)
        status, text = await get(f"{gw.url}/healthz")
    assert status == 200 and json.loads(text)["ok"] is True


async def test_healthz_is_503_when_redis_is_unreachable(namespace) -> None:
    dead = "redis://127.0.0.1:1"
    async with gateway(dead, namespace) as gw:
        status, text = await get(f"{gw.url}/healthz")
    body = json.loads(text)
    assert status == 503 and body["ok"] is False and "cannot reach Redis" in body["reason"]


async def test_metrics_count_requests_samples_and_failures(redis_url, namespace, spawn_workers) -> None:
    spawn_workers(1, "--scorer", ECHO, "--retries", "0")
    async with gateway(redis_url, namespace, data_source="s") as gw:
        await post(f"{gw.url}/openrlhf", openrlhf_body(["a", "b"], ["1", "raise"], ["1", "2"]))
        await post(f"{gw.url}/openrlhf", {"query": 1})
        await post(f"{gw.url}/slime", {"response": "1", "label": "1"})
        status, text = await get(f"{gw.url}/metrics")
    assert status == 200
    samples = metric_samples(text)
    assert metric_value(samples, "stream_reward_gateway_requests_total", route="openrlhf", code="503") == 1
    assert metric_value(samples, "stream_reward_gateway_requests_total", route="openrlhf", code="400") == 1
    assert metric_value(samples, "stream_reward_gateway_samples_total", route="openrlhf", status="ok") == 1
    assert metric_value(samples, "stream_reward_gateway_samples_total", route="slime", status="ok") == 1
    failures = [v for (name, _), v in samples.items() if name == "stream_reward_gateway_failures_total"]
    assert failures == [1.0]
    assert metric_value(samples, "stream_reward_gateway_request_seconds_count", route="slime") == 1


async def test_metrics_count_the_samples_of_a_timed_out_request_as_failed(redis_url, namespace) -> None:
    """A 504's samples got no score: they are failed samples in /metrics (an operator's
    failure rate from samples_total must not leave them out), by the timeout's reason."""
    async with gateway(redis_url, namespace, data_source="s", timeout_s=1.0) as gw:  # no worker reads
        status, _ = await post(f"{gw.url}/openrlhf", openrlhf_body(["a", "b"], ["1", "2"], ["1", "2"]))
        _, text = await get(f"{gw.url}/metrics")
    assert status == 504
    samples = metric_samples(text)
    assert metric_value(samples, "stream_reward_gateway_samples_total", route="openrlhf", status="failed") == 2
    assert (
        metric_value(samples, "stream_reward_gateway_failures_total", route="openrlhf", reason="request_timeout") == 2
    )
