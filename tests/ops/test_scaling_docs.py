"""The KEDA manifests in docs/scaling.md name what a real worker reads: each ScaledObject's
triggers watch, per partition, the stream and consumer group a worker started from its
Deployment reads (with the default namespace, as a producer that sets nothing writes);
they lag while no worker reads and drain to 0 once one does; KEDA reads Redis where the
worker connects; the grace period covers the worker's drain."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import gsm8k, wait_until

from stream_reward.cli import build_parser
from stream_reward.config import DEFAULT_GROUP, DEFAULT_NAMESPACE, ProducerConfig
from stream_reward.trainer.aggregator import RewardAggregator
from stream_reward.trainer.producer import RolloutProducer
from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys
from stream_reward.wire.trajectory import Trajectory

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "scaling.md"
SLEEPS = f"python:{ROOT / 'tests' / 'data' / 'scorers.py'}:timed"  # sleeps extra_info["sleep_s"]
CONSUMER = "pod-0"


def _manifests() -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for block in re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S):
        found += [doc for doc in yaml.safe_load_all(block) if doc]
    return found


def _pairs() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    manifests = _manifests()
    deployments = {m["metadata"]["name"]: m for m in manifests if m["kind"] == "Deployment"}
    return [(m, deployments[m["spec"]["scaleTargetRef"]["name"]]) for m in manifests if m["kind"] == "ScaledObject"]


PAIRS = _pairs()
IDS = [scaled["metadata"]["name"] for scaled, _ in PAIRS]


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _worker_argv(deployment: dict[str, Any]) -> list[str]:
    """The container's command line after ``stream-reward``, as the pod named CONSUMER runs it."""
    container = _container(deployment)
    assert container["command"] == ["stream-reward", "worker"]
    return ["worker", *(a.replace("$(POD_NAME)", CONSUMER) for a in container["args"])]


def _worker_args(deployment: dict[str, Any]) -> argparse.Namespace:
    return build_parser().parse_args(_worker_argv(deployment))


def _keys_and_group(deployment: dict[str, Any]) -> tuple[Keys, str]:
    args = _worker_args(deployment)
    return Keys(args.namespace or DEFAULT_NAMESPACE, args.partitions or 1), args.group or DEFAULT_GROUP


def _triggers(scaled: dict[str, Any], kind: str) -> list[dict[str, str]]:
    return [t["metadata"] for t in scaled["spec"]["triggers"] if kind in t["metadata"]]


def test_the_docs_show_a_manifest_for_one_partition_and_for_several() -> None:
    partitions = sorted(_keys_and_group(deployment)[0].partitions for _, deployment in PAIRS)
    assert partitions[0] == 1 and partitions[-1] > 1, partitions


@pytest.mark.parametrize(("scaled", "deployment"), PAIRS, ids=IDS)
def test_each_partition_has_a_lag_and_a_pending_trigger_on_the_workers_group(
    scaled: dict[str, Any], deployment: dict[str, Any]
) -> None:
    keys, group = _keys_and_group(deployment)
    assert {t["type"] for t in scaled["spec"]["triggers"]} == {"redis-streams"}
    lag, pending = _triggers(scaled, "lagCount"), _triggers(scaled, "pendingEntriesCount")
    assert len(lag) + len(pending) == len(scaled["spec"]["triggers"])
    assert [t["stream"] for t in lag] == keys.streams() and [t["stream"] for t in pending] == keys.streams()
    for trigger in lag + pending:
        assert trigger["consumerGroup"] == group
    for trigger in lag:
        # Only a lag trigger wakes a Deployment from zero, at the first entry waiting.
        assert int(trigger["lagCount"]) >= 1 and trigger["activationLagCount"] == "0"
    for trigger in pending:
        assert int(trigger["pendingEntriesCount"]) >= 1
    assert scaled["spec"]["minReplicaCount"] == 0


@pytest.mark.parametrize(("scaled", "deployment"), PAIRS, ids=IDS)
def test_keda_reads_redis_where_the_worker_connects_and_the_grace_covers_the_drain(
    scaled: dict[str, Any], deployment: dict[str, Any]
) -> None:
    env = [e["name"] for e in _container(deployment)["env"]]
    url = next(e["value"] for e in _container(deployment)["env"] if e["name"] == "STREAM_REWARD_CONNECTION_REDIS")
    for trigger in scaled["spec"]["triggers"]:
        for name in (trigger["metadata"]["addressFromEnv"], trigger["metadata"]["passwordFromEnv"]):
            # Kubernetes expands $(NAME) only from variables defined before it.
            assert f"$({name})" in url and env.index(name) < env.index("STREAM_REWARD_CONNECTION_REDIS")
    drain_s = _worker_args(deployment).drain_timeout_s
    # The drain, then up to 2 s of handing back, then the process's own exit.
    assert (
        drain_s is not None and deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= drain_s + 10
    )


def _start_worker(deployment: dict[str, Any], url: str, *extra: str) -> subprocess.Popen[bytes]:
    argv = [*_worker_argv(deployment), *extra]  # (a flag given twice: the last one counts)
    if "--metrics-port" in argv:  # a fixed port could be taken on a test machine: any free one
        argv[argv.index("--metrics-port") + 1] = "0"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("STREAM_REWARD_") or k in ("STREAM_REWARD_SERVER_BIN", "STREAM_REWARD_TEST_LOG")
    }
    env["STREAM_REWARD_CONNECTION_REDIS"] = url  # what the Deployment's env composes
    argv += ["--log-level", os.environ.get("STREAM_REWARD_TEST_LOG", "WARNING")]
    return subprocess.Popen([sys.executable, "-m", "stream_reward.cli", *argv], env=env, stdin=subprocess.DEVNULL)


async def _groups(client: Any, stream: str) -> dict[str, dict[str, Any]]:
    rows = await client.xinfo_groups(stream)
    return {(r["name"].decode() if isinstance(r["name"], bytes) else r["name"]): r for r in rows}


@pytest.mark.parametrize(("scaled", "deployment"), PAIRS, ids=IDS)
def test_a_worker_started_from_the_deployment_drains_what_the_triggers_watch(
    own_url: str, scaled: dict[str, Any], deployment: dict[str, Any]
) -> None:
    keys, _ = _keys_and_group(deployment)
    watched = [(t["stream"], t["consumerGroup"]) for t in _triggers(scaled, "lagCount")]
    n = 100

    async def push_with_no_worker() -> tuple[list[int], list[int]]:
        # The producer sets nothing but the partitions: the default namespace and group.
        async with RolloutProducer(own_url, ProducerConfig(partitions=keys.partitions)) as producer:
            await producer.open_batch("keda", n, 16)
            await producer.push_many([gsm8k("keda", i) for i in range(n)])
        client = connect(own_url)
        try:
            lags = [int((await _groups(client, s))[g]["lag"]) for s, g in watched]
            lengths = [int(await client.xlen(s)) for s, _ in watched]
        finally:
            await client.aclose()
        return lags, lengths

    lags, lengths = asyncio.run(push_with_no_worker())
    # Every entry pushed is lag on a watched stream, in the watched group.
    assert sum(lags) > 0 and lags == lengths
    assert sum(1 for lag in lags if lag) >= min(keys.partitions, 2)  # spread over the partitions

    proc = _start_worker(deployment, own_url)
    try:

        async def drained_by_the_worker() -> Any:
            client = connect(own_url)
            try:

                async def settled() -> bool:
                    for stream, group in watched:
                        row = (await _groups(client, stream))[group]
                        if row["lag"] != 0 or row["pending"] != 0:
                            return False
                    return True

                await wait_until(settled, timeout_s=90)
                readers = [{c["name"].decode() for c in await client.xinfo_consumers(s, g)} for s, g in watched]
            finally:
                await client.aclose()
            async with RewardAggregator(own_url) as agg:
                rewards = await agg.collect("keda", timeout_s=60)
            return readers, rewards

        readers, rewards = asyncio.run(drained_by_the_worker())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert all(CONSUMER in names for names in readers), readers  # the Deployment's worker read each one
    assert rewards.status_counts() == {"ok": n}


def test_a_stopped_workers_entries_are_pending_not_lag_so_the_pending_trigger_keeps_a_pod(own_url: str) -> None:
    """A worker stopped with samples in flight hands them back to the group: they stay
    pending, delivered, so the lag is 0 and a lag trigger alone would let KEDA remove the
    last pod and strand them; the pending trigger stays active. The stop itself takes the
    drain and little more: the Deployment's grace period (drain + 10 s or more) covers it."""
    scaled, deployment = next((s, d) for s, d in PAIRS if _keys_and_group(d)[0].partitions == 1)
    (lag_trigger,), (pending_trigger,) = _triggers(scaled, "lagCount"), _triggers(scaled, "pendingEntriesCount")
    stream, group = lag_trigger["stream"], lag_trigger["consumerGroup"]
    drain_s = 0.5
    proc = _start_worker(deployment, own_url, "--scorer", SLEEPS, "--drain-timeout-s", str(drain_s))
    try:

        async def in_flight() -> None:
            async with RolloutProducer(own_url, ProducerConfig()) as producer:
                await producer.open_batch("held", 4, 16)
                await producer.push_many(
                    [
                        Trajectory("held", i, "x", response="r", ground_truth="1", extra_info={"sleep_s": 120})
                        for i in range(4)
                    ]
                )
            client = connect(own_url)
            try:

                async def delivered() -> bool:
                    row = (await _groups(client, stream))[group]
                    return row["lag"] == 0 and row["pending"] > 0

                await wait_until(delivered, timeout_s=60)
            finally:
                await client.aclose()

        asyncio.run(in_flight())
        stopping = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        stop_s = time.monotonic() - stopping
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    async def left() -> dict[str, Any]:
        client = connect(own_url)
        try:
            return (await _groups(client, stream))[group]
        finally:
            await client.aclose()

    row = asyncio.run(left())
    # KEDA calls a trigger active when its count is above the activation value (0 by default).
    assert not row["lag"] > int(lag_trigger["activationLagCount"])
    assert row["pending"] > int(pending_trigger.get("activationLagCount", "0"))
    print(f"stop took {stop_s:.2f} s with a {drain_s} s drain")
    assert stop_s < drain_s + 10, stop_s
