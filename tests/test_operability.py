"""Metrics endpoint, ``status``, health check and the CLI end to end, against real Redis and real worker processes."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from stream_reward.cli import main
from stream_reward.config import BatchPolicy, ProducerConfig
from stream_reward.ops.status import read_status, record_batch
from stream_reward.trainer.aggregator import BatchMeta, RewardAggregator, build_rewards
from stream_reward.trainer.producer import RolloutProducer
from stream_reward.wire.connection import connect
from stream_reward.wire.entries import entry_fields, entry_header
from stream_reward.wire.keys import Keys
from stream_reward.wire.trajectory import ScoreResult, Trajectory
from stream_reward.worker.metrics import WorkerMetrics

GOOD = "First 2 * 3 = 6.\n#### 6"


@pytest.fixture(autouse=True)
def _clean_env(clean_env: None) -> None:
    """Every test here reads settings: none may leak in from the outer environment."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return parse(text)


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def gsm8k(batch: str, index: int, *, data_source: str = "openai/gsm8k") -> Trajectory:
    return Trajectory(batch, index, data_source, response=GOOD, ground_truth="6", valid_response_length=8)


def heartbeat(name: str, seen: float, **fields: Any) -> bytes:
    beat = {
        "host": "h1",
        "pid": 4242,
        "started": seen - 100,
        "seen": seen,
        "group": "scorers",
        "scorer": "RuleScorer",
        "scored": 0,
        "failed": 0,
        "duplicates": 0,
        "dead_letters": 0,
        "reclaimed": 0,
        "in_flight": 0,
        **fields,
    }
    return msgpack.packb(beat)


def wait_for(predicate: Any, timeout_s: float = 10.0, interval_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(interval_s)


# ---------------------------------------------------------------------- metrics, real worker
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
        ready = (value(samples, "stream_reward_redis_read_timestamp_seconds") or 0) > collected_at and (
            value(samples, "stream_reward_workers_alive") or 0
        ) >= 1
        return samples if ready else None

    samples = wait_for(settled)
    assert samples, "metrics never showed the settled stream"
    assert value(samples, "stream_reward_trajectories_total", status="ok", data_source="openai/gsm8k") == 20
    assert value(samples, "stream_reward_trajectories_total", status="failed", data_source="no/such-source") == 1
    assert value(samples, "stream_reward_failures_total", reason=failed_reason) == 1
    assert value(samples, "stream_reward_dead_letters_total", reason=dead_reason) == 1
    assert (
        value(samples, "stream_reward_scoring_latency_seconds_count", scorer="rules", data_source="openai/gsm8k") == 20
    )
    assert (
        value(
            samples,
            "stream_reward_scoring_latency_seconds_bucket",
            scorer="rules",
            data_source="openai/gsm8k",
            le="+Inf",
        )
        == 20
    )
    assert value(samples, "stream_reward_in_flight") == 0
    assert value(samples, "stream_reward_reclaimed_total") == 0
    assert value(samples, "stream_reward_group_lag", stream=keys.stream(), group="scorers") == 0
    assert value(samples, "stream_reward_group_consumers", stream=keys.stream(), group="scorers") == 1
    assert value(samples, "stream_reward_dead_letter_stream_length", stream=keys.dead_letters()) == 1
    assert value(samples, "stream_reward_redis_up") == 1
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
    samples = parse(generate_latest(metrics.registry).decode())
    assert value(samples, "stream_reward_verifier_requests_total", verifier="judge") == 10
    assert value(samples, "stream_reward_verifier_retries_total", verifier="judge") == 2
    assert value(samples, "stream_reward_verifier_http_429_total", verifier="judge") == 1
    assert value(samples, "stream_reward_verifier_quota_wait_seconds_total", verifier="judge") == 1.5
    assert value(samples, "stream_reward_verifier_tokens_total", verifier="judge") == 4
    assert value(samples, "stream_reward_verifier_events_total", verifier="judge", event="ok") == 7
    # Prometheus conventions: counters end in _total, and nothing else does; no gauge holds a count.
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        names = {s.name for s in family.samples}
        if family.type == "counter":
            assert all(n.endswith(("_total", "_created")) for n in names), names
        else:
            assert not any(n.endswith("_total") for n in names), names
        assert not family.name.endswith(("_fraction", "_stat")), family.name
    assert value(samples, "stream_reward_verifier_failures_total", verifier="judge", reason="timeout") == 2
    assert value(samples, "stream_reward_in_flight") == 5 and value(samples, "stream_reward_reclaimed_total") == 3
    # Counted at scrape time: a later change shows in the next scrape.
    FakeWorker.scorer.inner.stats["requests"] = 11
    assert (
        value(
            parse(generate_latest(metrics.registry).decode()), "stream_reward_verifier_requests_total", verifier="judge"
        )
        == 11
    )


def test_data_source_labels_are_capped() -> None:
    metrics = WorkerMetrics(
        namespace="ns", group="g", consumer="c", scorer="rules", registry=CollectorRegistry(), max_data_sources=2
    )
    for source in ("a", "b", "c", "d"):
        metrics.on_scored(ScoreResult("u", "b", 0, 1.0, data_source=source), 0.001)
    samples = parse(generate_latest(metrics.registry).decode())
    assert value(samples, "stream_reward_trajectories_total", status="ok", data_source="a") == 1
    assert value(samples, "stream_reward_trajectories_total", status="ok", data_source="other") == 2


def test_trainer_batch_metrics() -> None:
    registry = CollectorRegistry()
    results = [ScoreResult(f"u{i}", "b", i, 1.0, "ok" if i else "failed", valid_response_length=3) for i in range(4)]
    rewards = build_rewards("b", BatchMeta(4, 8, BatchPolicy(), 0.0, 0.0), results)
    record_batch(rewards, completion_s=2.0, reward_tail_s=0.05, registry=registry)
    record_batch(rewards, completion_s=3.0, registry=registry)
    samples = parse(generate_latest(registry).decode())
    assert value(samples, "stream_reward_batch_completion_seconds_count") == 2
    assert value(samples, "stream_reward_batch_completion_seconds_sum") == 5.0
    assert value(samples, "stream_reward_reward_tail_seconds_count") == 1
    assert value(samples, "stream_reward_batch_samples_total", status="ok") == 6
    assert value(samples, "stream_reward_batch_samples_total", status="failed") == 2
    assert value(samples, "stream_reward_batch_valid_ratio") == 0.75


# ---------------------------------------------------------------------- status
@pytest.fixture
def known_state(redis_url: str, namespace: str) -> Iterator[float]:
    """Two open batches (one partly resolved), five entries of which a vanished consumer holds
    two, a live and a stale heartbeat, one dead letter, one used quota."""
    keys = Keys(namespace)
    now = time.time()

    async def setup() -> None:
        from stream_reward.config import QuotaConfig
        from stream_reward.scoring.quota import QuotaLimiter

        client = connect(redis_url)
        # An entry per sample: the state below is counted in entries (pending, lag).
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace, samples_per_entry=1)) as producer:
            await producer.open_batch("a", 3, 16)
            await producer.open_batch("b", 2, 16, policy=BatchPolicy(on_failure="drop", deadline_s=600))
            await producer.push_many([gsm8k("a", i) for i in range(3)] + [gsm8k("b", i) for i in range(2)])
            await producer.fail("a", 0, reason="bad_input", error="line 1: not JSON")
        await client.xreadgroup("scorers", "c-gone", {keys.stream(): ">"}, count=2)
        await client.hset(
            keys.workers(),
            mapping={
                "w-alive": heartbeat("w-alive", now, scored=7, failed=1),
                "w-stale": heartbeat("w-stale", now - 60, scored=3),
            },
        )
        dead = {
            "reason": "malformed",
            "error": "payload is not msgpack",
            "consumer": "w-alive",
            "deliveries": 1,
            "at": now,
            "fields": {"h": entry_header("a", 2, "a/2", 0)},
        }
        await client.xadd(keys.dead_letters(), {"e": msgpack.packb(dead, use_bin_type=True)})
        limiter = QuotaLimiter(client, QuotaConfig(name="judge", max_rpm=600), namespace=namespace)
        async with limiter.lease():
            pass
        await limiter.aclose()
        await client.aclose()

    asyncio.run(setup())
    yield now


def test_status_json_against_a_known_state(
    redis_url: str, namespace: str, known_state: float, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", "--redis", redis_url, "--namespace", namespace, "--json", "--window-s", "0"]) == 0
    status = json.loads(capsys.readouterr().out)
    keys = Keys(namespace)
    assert status["namespace"] == namespace and status["partitions"] == 1
    (stream,) = status["streams"]
    assert (stream["stream"], stream["length"], stream["entries_added"]) == (keys.stream(), 5, 5)
    assert stream["samples_pushed"] == 5
    (group,) = stream["groups"]
    assert (group["group"], group["consumers"], group["pending"], group["lag"]) == ("scorers", 1, 2, 3)
    assert status["groups"] == {"scorers": {"pending": 2, "lag": 3, "consumers": 1}}

    assert status["workers"] == {"alive": 1, "stale": 1, "gone": 1}
    consumers = {c["name"]: c for c in status["consumers"]}
    assert consumers["w-alive"]["state"] == "alive" and consumers["w-alive"]["scored"] == 7
    assert consumers["w-alive"]["host"] == "h1" and consumers["w-alive"]["pid"] == 4242
    assert consumers["w-stale"]["state"] == "stale" and consumers["w-stale"]["age_s"] >= 59
    assert consumers["c-gone"]["state"] == "gone" and consumers["c-gone"]["pending"] == 2
    assert status["throughput"] is None

    dead = status["dead_letters"]
    assert dead["total"] == 1 and dead["partitions"] == [1]
    assert (dead["recent"][0]["reason"], dead["recent"][0]["batch"], dead["recent"][0]["index"]) == (
        "malformed",
        "a",
        2,
    )

    (quota,) = status["quota"]
    assert quota["name"] == "judge" and quota["state"]["requests"] == 1 and quota["state"]["in_flight"] == 0

    assert status["open_batches"] == 2
    b, a = status["batches"]  # newest first
    assert (a["batch"], a["size"], a["done"], a["complete"], a["on_failure"]) == ("a", 3, 1, 0.3333, "mask")
    assert (b["batch"], b["size"], b["done"], b["on_failure"]) == ("b", 2, 0, "drop")
    assert 590 < b["deadline_in_s"] <= 600 and a["deadline_in_s"] is None


def test_status_table_never_shows_the_password(
    redis_url: str, namespace: str, known_state: float, capsys: pytest.CaptureFixture[str]
) -> None:
    """Connect as an ACL user with a password; neither output form prints it."""
    secret = f"pw-{namespace}"
    user = f"u{namespace}"

    async def acl(*args: str) -> None:
        client = connect(redis_url)
        await client.execute_command("ACL", *args)
        await client.aclose()

    asyncio.run(acl("SETUSER", user, "on", f">{secret}", "~*", "&*", "+@all"))
    try:
        url = (
            redis_url.replace("unix://", f"unix://{user}:{secret}@", 1)
            if redis_url.startswith("unix://")
            else redis_url.replace("://", f"://{user}:{secret}@", 1)
        )
        assert main(["status", "--redis", url, "--namespace", namespace, "--window-s", "0"]) == 0
        table = capsys.readouterr().out
        assert main(["status", "--redis", url, "--namespace", namespace, "--window-s", "0", "--json"]) == 0
        as_json = capsys.readouterr().out
    finally:
        asyncio.run(acl("DELUSER", user))
    assert secret not in table and secret not in as_json
    assert "***@" in table and json.loads(as_json)["redis"].startswith("unix://***@")
    for text in ("w-alive", "c-gone", "malformed", "judge", "open batches (2"):
        assert text in table


def test_status_table_says_what_it_counts_when_an_entry_holds_several_samples(redis_url: str, namespace: str) -> None:
    """Lag and pending are Redis's, in stream entries; with 4 samples to an entry, a table
    that showed them unlabelled next to sample counts read 4x too low as a backlog."""
    from rich.console import Console

    from stream_reward.ops.status import render_status

    async def setup() -> dict[str, Any]:
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace, samples_per_entry=4)) as producer:
            await producer.open_batch("four", 8, 16)
            await producer.push_many([gsm8k("four", i) for i in range(8)])
        return await read_status(redis_url, namespace, window_s=0)

    status = asyncio.run(setup())
    console = Console(record=True, width=240, color_system=None)
    render_status(status, console)
    text = console.export_text()
    (stream,) = status["streams"]
    assert (stream["length"], stream["samples_pushed"]) == (2, 8)
    assert "streams (entries, added, lag, pending: stream entries, of several samples each)" in text
    header = next(line for line in text.splitlines() if "stream" in line and "group" in line)
    assert [c.strip() for c in header.split("┃")[1:5]] == ["stream", "entries", "added", "samples"], header
    row = next(line for line in text.splitlines() if stream["stream"] in line)
    assert [c.strip() for c in row.split("│")[2:5]] == ["2", "2", "8"], row


def test_status_throughput_from_heartbeat_deltas(redis_url: str, namespace: str) -> None:
    keys = Keys(namespace)

    async def run() -> dict:
        client = connect(redis_url)
        t0 = time.time()
        await client.hset(keys.workers(), "w1", heartbeat("w1", t0 - 0.5, scored=10, failed=0))
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
            await producer.open_batch("t", 6, 16)

            async def meanwhile() -> None:
                await asyncio.sleep(0.1)
                await producer.push_many([gsm8k("t", i) for i in range(6)])
                # The worker's next beat, one second of its own clock after the first.
                await client.hset(keys.workers(), "w1", heartbeat("w1", t0 + 0.5, scored=60, failed=5))

            task = asyncio.create_task(meanwhile())
            status = await read_status(redis_url, namespace, window_s=0.4, client=client)
            await task
        await client.aclose()
        return status

    t = asyncio.run(run())["throughput"]
    assert t["window_s"] == 0.4
    assert t["scored_per_s"] == pytest.approx(50.0) and t["failed_per_s"] == pytest.approx(5.0)
    assert t["pushed_per_s"] == pytest.approx(6 / 0.4)


# ---------------------------------------------------------------------- health check
def test_worker_check_both_ways(redis_url: str, namespace: str, capsys: pytest.CaptureFixture[str]) -> None:
    keys = Keys(namespace)
    check = ["worker", "--check", "--redis", redis_url, "--namespace", namespace]

    async def beat(name: str, seen: float) -> None:
        client = connect(redis_url)
        await client.hset(keys.workers(), name, heartbeat(name, seen))
        await client.aclose()

    assert main(check) == 1
    assert "no worker heartbeat" in capsys.readouterr().err

    asyncio.run(beat("old", time.time() - 7))  # older than 3 x 2 s
    assert main(check) == 1
    assert "no live worker" in capsys.readouterr().err

    asyncio.run(beat("fresh", time.time() - 1))
    assert main(check) == 0
    assert main([*check, "--consumer", "fresh"]) == 0
    assert main([*check, "--consumer", "old"]) == 1
    assert main([*check, "--group", "other-pool"]) == 1
    capsys.readouterr()

    # The interval comes from the config: with 5 s beats, 7 s old is still alive.
    os.environ["STREAM_REWARD_CONSUMER_HEARTBEAT_INTERVAL_S"] = "5"
    try:
        assert main([*check, "--consumer", "old"]) == 0
    finally:
        del os.environ["STREAM_REWARD_CONSUMER_HEARTBEAT_INTERVAL_S"]
    assert main(["worker", "--check", "--redis", "redis://127.0.0.1:1", "--namespace", namespace]) == 1


# ---------------------------------------------------------------------- CLI end to end
def test_produce_and_collect_with_connection_from_the_config(
    redis_url: str, namespace: str, spawn_workers: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "sr.toml"
    config.write_text(
        f'[connection]\nredis = "{redis_url}"\nnamespace = "{namespace}"\n[policy]\non_failure = "drop"\n'
    )
    rollouts = tmp_path / "rollouts.jsonl"
    good = json.dumps(
        {"data_source": "openai/gsm8k", "response": GOOD, "ground_truth": "6", "valid_response_length": 8}
    )
    rollouts.write_text(f"{good}\nnot json\n{good}\n")
    assert main(["produce", "--config", str(config), "--batch", "p1", str(rollouts)]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {"batch": "p1", "pushed": 2, "bad_lines": 1}
    spawn_workers(1)
    assert main(["collect", "--config", str(config), "--batch", "p1", "--timeout-s", "30", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # The config's failure policy (drop) reached the batch: the bad line's row is gone.
    assert out["indices"] == [0, 2] and out["status"] == ["ok", "ok"] and out["scores"] == [1.0, 1.0]
