"""``status`` and the trainer's batch metrics: streams, groups, workers (alive, stale, gone),
throughput from heartbeat deltas, dead letters, quota and open batches, as JSON or a table
that says what it counts (stream entries, of several samples each) and never shows the
password; ``record_batch`` histograms and counters per collected batch.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from helpers import gsm8k, metric_samples, metric_value, worker_heartbeat
from prometheus_client import CollectorRegistry, generate_latest

from stream_reward.cli import main
from stream_reward.config import BatchPolicy, ProducerConfig
from stream_reward.ops.status import read_status, record_batch
from stream_reward.trainer.producer import RolloutProducer
from stream_reward.trainer.rewards import build_rewards
from stream_reward.wire.batch_meta import BatchMeta
from stream_reward.wire.connection import connect
from stream_reward.wire.entries import entry_header
from stream_reward.wire.keys import Keys
from stream_reward.wire.trajectory import ScoreResult

pytestmark = pytest.mark.usefixtures("clean_env", "restore_logging")


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
                "w-alive": worker_heartbeat("w-alive", now, scored=7, failed=1),
                "w-stale": worker_heartbeat("w-stale", now - 60, scored=3),
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
    assert (group["lag_samples"], group["lag_samples_exact"]) == (3, True)
    assert status["groups"] == {"scorers": {"pending": 2, "lag": 3, "lag_samples": 3, "consumers": 1}}

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
    that showed them unlabelled next to sample counts read 4x too low as a backlog. The lag
    in samples stands beside the lag in entries."""
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
    title = (
        "streams (entries, added, lag, pending: stream entries, of several samples each; samples, lag samples: samples)"
    )
    assert title in " ".join(text.split())  # (rich wraps a title wider than its table)
    header = next(line for line in text.splitlines() if "stream" in line and "group" in line)
    columns = [c.strip() for c in header.split("┃")[1:-1]]
    assert columns == ["stream", "entries", "added", "samples", "group", "consumers", "lag", "lag samples", "pending"]
    row = next(line for line in text.splitlines() if stream["stream"] in line)
    assert [c.strip() for c in row.split("│")[2:-1]] == ["2", "2", "8", "scorers", "0", "2", "8", "0"], row


def test_status_throughput_from_heartbeat_deltas(redis_url: str, namespace: str) -> None:
    keys = Keys(namespace)

    async def run() -> dict:
        client = connect(redis_url)
        t0 = time.time()
        await client.hset(keys.workers(), "w1", worker_heartbeat("w1", t0 - 0.5, scored=10, failed=0))
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
            await producer.open_batch("t", 6, 16)

            async def meanwhile() -> None:
                await asyncio.sleep(0.1)
                await producer.push_many([gsm8k("t", i) for i in range(6)])
                # The worker's next beat, one second of its own clock after the first.
                await client.hset(keys.workers(), "w1", worker_heartbeat("w1", t0 + 0.5, scored=60, failed=5))

            task = asyncio.create_task(meanwhile())
            status = await read_status(redis_url, namespace, window_s=0.4, client=client)
            await task
        await client.aclose()
        return status

    t = asyncio.run(run())["throughput"]
    assert t["window_s"] == 0.4
    assert t["scored_per_s"] == pytest.approx(50.0) and t["failed_per_s"] == pytest.approx(5.0)
    assert t["pushed_per_s"] == pytest.approx(6 / 0.4)


# ---------------------------------------------------------------------- the trainer's batch metrics
def test_trainer_batch_metrics() -> None:
    registry = CollectorRegistry()
    results = [ScoreResult(f"u{i}", "b", i, 1.0, "ok" if i else "failed", valid_response_length=3) for i in range(4)]
    rewards = build_rewards("b", BatchMeta(4, 8, BatchPolicy(), 0.0, 0.0), results)
    record_batch(rewards, completion_s=2.0, reward_tail_s=0.05, registry=registry)
    record_batch(rewards, completion_s=3.0, registry=registry)
    samples = metric_samples(generate_latest(registry).decode())
    assert metric_value(samples, "stream_reward_batch_completion_seconds_count") == 2
    assert metric_value(samples, "stream_reward_batch_completion_seconds_sum") == 5.0
    assert metric_value(samples, "stream_reward_reward_tail_seconds_count") == 1
    assert metric_value(samples, "stream_reward_batch_samples_total", status="ok") == 6
    assert metric_value(samples, "stream_reward_batch_samples_total", status="failed") == 2
    assert metric_value(samples, "stream_reward_batch_valid_ratio") == 0.75


@pytest.mark.parametrize("shift_s", [3600.0, -3600.0])
def test_status_ages_and_deadlines_are_on_the_server_clock(
    redis_url: str, namespace: str, shift_s: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A status reader an hour off: a batch opened just now with a 600 s deadline is
    seconds old with ~600 s left, not an hour old or an hour past its deadline."""

    async def open_one() -> None:
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
            await producer.open_batch("b", 2, 16, policy=BatchPolicy(deadline_s=600))

    asyncio.run(open_one())
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + shift_s)
    status = asyncio.run(read_status(redis_url, namespace=namespace))
    monkeypatch.undo()
    (batch,) = status["batches"]
    assert 0 <= batch["age_s"] < 60, batch
    assert 540 < batch["deadline_in_s"] <= 600, batch
