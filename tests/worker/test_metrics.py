"""The worker's Prometheus endpoint: per-sample counters and latencies by data source (their
labels capped), dead letters and failures by reason, the stream's length and the group's
lag read from Redis (in entries and in samples, per partition), a scorer's verifier
counters read at scrape time; counters end in ``_total`` and nothing else does.
"""

from __future__ import annotations

import asyncio
import socket
import time
import urllib.request
from typing import Any

import pytest
from helpers import Timed, exact_traj, gsm8k, metric_samples, metric_value, push_exact, samples_of
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from worker_support import finish_with_burst

from stream_reward.cli import main
from stream_reward.config import ProducerConfig
from stream_reward.trainer.aggregator import RewardAggregator
from stream_reward.trainer.producer import RolloutProducer
from stream_reward.wire.connection import connect
from stream_reward.wire.entries import entry_fields
from stream_reward.wire.keys import Keys
from stream_reward.wire.trajectory import ScoreResult
from stream_reward.worker.metrics import WorkerMetrics

pytestmark = pytest.mark.usefixtures("clean_env", "restore_logging")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return metric_samples(text)


def wait_for(predicate: Any, timeout_s: float = 10.0, interval_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(interval_s)


def test_metrics_endpoint_after_a_real_run(
    redis_url: str,
    namespace: str,
    spawn_workers: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("STREAM_REWARD_WORKER_METRICS_REFRESH_S", "0.2")  # inherited by the worker process
    port = free_port()
    (proc,) = spawn_workers(1, "--metrics-port", str(port), "--metrics-addr", "127.0.0.1")
    keys = Keys(namespace)

    async def run() -> Any:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await producer.open_batch("m", 22, 16)
            await producer.push_many(
                [gsm8k("m", i) for i in range(20)] + [gsm8k("m", 20, data_source="no/such-source")]
            )
            # A malformed entry: the worker dead-letters it and still resolves its sample.
            await producer.client.xadd(keys.stream(), entry_fields(b"\xc1not msgpack", "m", 21, "m/21"))
            return await agg.collect("m", timeout_s=30)

    rewards = asyncio.run(run())
    collected_at = time.time()
    assert rewards.status_counts() == {"ok": 20, "failed": 2}
    failed_reason = rewards.results[20].reason
    dead_reason = rewards.results[21].reason

    def settled() -> dict | None:
        # The Redis-side gauges are read every 0.2 s: wait for a reading taken after the run.
        samples = scrape(port)
        ready = (metric_value(samples, "stream_reward_redis_read_timestamp_seconds") or 0) > collected_at and (
            metric_value(samples, "stream_reward_workers_alive") or 0
        ) >= 1
        return samples if ready else None

    samples = wait_for(settled)
    assert samples, "metrics never showed the settled stream"
    assert metric_value(samples, "stream_reward_trajectories_total", status="ok", data_source="openai/gsm8k") == 20
    assert metric_value(samples, "stream_reward_trajectories_total", status="failed", data_source="no/such-source") == 1
    assert metric_value(samples, "stream_reward_failures_total", reason=failed_reason) == 1
    assert metric_value(samples, "stream_reward_dead_letters_total", reason=dead_reason) == 1
    assert (
        metric_value(samples, "stream_reward_scoring_latency_seconds_count", scorer="rules", data_source="openai/gsm8k")
        == 20
    )
    assert (
        metric_value(
            samples,
            "stream_reward_scoring_latency_seconds_bucket",
            scorer="rules",
            data_source="openai/gsm8k",
            le="+Inf",
        )
        == 20
    )
    assert metric_value(samples, "stream_reward_in_flight") == 0
    assert metric_value(samples, "stream_reward_reclaimed_total") == 0
    assert metric_value(samples, "stream_reward_group_lag", stream=keys.stream(), group="scorers") == 0
    assert metric_value(samples, "stream_reward_group_consumers", stream=keys.stream(), group="scorers") == 1
    assert metric_value(samples, "stream_reward_dead_letter_stream_length", stream=keys.dead_letters()) == 1
    assert metric_value(samples, "stream_reward_redis_up") == 1
    info = [labels for (name, labels) in samples if name == "stream_reward_worker_info"]
    assert info and ("namespace", namespace) in info[0] and ("group", "scorers") in info[0]

    # The same live worker passes the health check.
    assert main(["worker", "--check", "--redis", redis_url, "--namespace", namespace]) == 0
    assert "ok: 1 live worker" in capsys.readouterr().out
    assert proc.poll() is None


def test_verifier_counters_are_read_from_the_scorer_at_scrape_time() -> None:
    class Stats:
        scored = failed = duplicates = dead_letters = 0
        reclaimed, in_flight = 3, 5

    class Verifier:
        name = "judge"

        def __init__(self) -> None:
            self.stats = {
                "requests": 10,
                "retries": 2,
                "http_429": 1,
                "quota_wait_s": 1.5,
                "tokens": 4,
                "ok": 7,
                "failures_by_reason": {"timeout": 2},
                "endpoints": ["not a number"],
            }

    class Manager:  # a wrapping manager: the counters live on the scorer it wraps
        def __init__(self) -> None:
            self.inner = Verifier()

    class FakeWorker:
        stats = Stats()
        scorer = Manager()

    metrics = WorkerMetrics(namespace="ns", group="g", consumer="c", scorer="http:x", registry=CollectorRegistry())
    metrics.bind(FakeWorker())
    samples = metric_samples(generate_latest(metrics.registry).decode())
    assert metric_value(samples, "stream_reward_verifier_requests_total", verifier="judge") == 10
    assert metric_value(samples, "stream_reward_verifier_retries_total", verifier="judge") == 2
    assert metric_value(samples, "stream_reward_verifier_http_429_total", verifier="judge") == 1
    assert metric_value(samples, "stream_reward_verifier_quota_wait_seconds_total", verifier="judge") == 1.5
    assert metric_value(samples, "stream_reward_verifier_tokens_total", verifier="judge") == 4
    assert metric_value(samples, "stream_reward_verifier_events_total", verifier="judge", event="ok") == 7
    # Prometheus conventions: counters end in _total, and nothing else does; no gauge holds a count.
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        names = {s.name for s in family.samples}
        if family.type == "counter":
            assert all(n.endswith(("_total", "_created")) for n in names), names
        else:
            assert not any(n.endswith("_total") for n in names), names
        assert not family.name.endswith(("_fraction", "_stat")), family.name
    assert metric_value(samples, "stream_reward_verifier_failures_total", verifier="judge", reason="timeout") == 2
    assert (
        metric_value(samples, "stream_reward_in_flight") == 5
        and metric_value(samples, "stream_reward_reclaimed_total") == 3
    )
    # Counted at scrape time: a later change shows in the next scrape.
    FakeWorker.scorer.inner.stats["requests"] = 11
    assert (
        metric_value(
            metric_samples(generate_latest(metrics.registry).decode()),
            "stream_reward_verifier_requests_total",
            verifier="judge",
        )
        == 11
    )


def test_data_source_labels_are_capped() -> None:
    metrics = WorkerMetrics(
        namespace="ns", group="g", consumer="c", scorer="rules", registry=CollectorRegistry(), max_data_sources=2
    )
    for source in ("a", "b", "c", "d"):
        metrics.on_scored(ScoreResult("u", "b", 0, 1.0, data_source=source), 0.001)
    samples = metric_samples(generate_latest(metrics.registry).decode())
    assert metric_value(samples, "stream_reward_trajectories_total", status="ok", data_source="a") == 1
    assert metric_value(samples, "stream_reward_trajectories_total", status="ok", data_source="other") == 2


async def _scrape_after_refresh(metrics: WorkerMetrics, client: Any, keys: Keys) -> dict:
    await metrics.refresh(client, keys)
    return metric_samples(generate_latest(metrics.registry).decode())


@pytest.mark.parametrize("n", [1, 16, 37])
def test_group_lag_is_exported_in_samples_and_entries_until_a_worker_drains_it(
    redis_url: str, namespace: str, n: int
) -> None:
    keys = Keys(namespace)
    metrics = WorkerMetrics(namespace=namespace, group="scorers", consumer="scraper", registry=CollectorRegistry())
    labels = {"stream": keys.stream(), "group": "scorers"}

    async def run() -> tuple[dict, dict, list[int]]:
        client = connect(redis_url)
        try:
            # No worker reads: everything pushed is lag, in the entries the producer packed.
            await push_exact(redis_url, namespace, "lag", n, k=16)
            packed = [len(samples_of(fields)) for _, fields in await client.xrange(keys.stream())]
            waiting = await _scrape_after_refresh(metrics, client, keys)
            await finish_with_burst(redis_url, namespace, Timed())
            return waiting, await _scrape_after_refresh(metrics, client, keys), packed
        finally:
            await client.aclose()

    waiting, drained, packed = asyncio.run(run())
    assert sum(packed) == n and len(packed) == -(-n // 16)  # the producer fills entries of 16
    assert metric_value(waiting, "stream_reward_group_lag", **labels) == len(packed)
    assert metric_value(waiting, "stream_reward_group_lag_samples", partition="0", **labels) == n
    assert metric_value(waiting, "stream_reward_group_lag_samples_exact", partition="0", **labels) == 1
    assert metric_value(drained, "stream_reward_group_lag", **labels) == 0
    assert metric_value(drained, "stream_reward_group_lag_samples", partition="0", **labels) == 0
    assert metric_value(drained, "stream_reward_group_pending", **labels) == 0


def test_group_lag_in_samples_per_partition(redis_url: str, namespace: str) -> None:
    keys = Keys(namespace, 3)
    metrics = WorkerMetrics(namespace=namespace, group="scorers", consumer="scraper", registry=CollectorRegistry())

    async def run() -> tuple[dict, list[int]]:
        client = connect(redis_url)
        try:
            async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace, partitions=3)) as producer:
                await producer.open_batch("parts", 50, 8)
                await producer.push_many([exact_traj("parts", i) for i in range(50)])
            per_partition = []
            for stream in keys.streams():
                per_partition.append(sum(len(samples_of(f)) for _, f in await client.xrange(stream)))
            return await _scrape_after_refresh(metrics, client, keys), per_partition
        finally:
            await client.aclose()

    samples, per_partition = asyncio.run(run())
    assert sum(per_partition) == 50 and sum(1 for x in per_partition if x) >= 2  # spread over partitions
    for p, stream in enumerate(keys.streams()):
        value = metric_value(
            samples, "stream_reward_group_lag_samples", stream=stream, partition=str(p), group="scorers"
        )
        assert value == per_partition[p]
