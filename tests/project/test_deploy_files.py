"""The deployment files in workers/ name the real program, flags and keys: the Deployment's
worker command parses, and the KEDA triggers watch the stream and group those workers read,
on the Redis they connect to."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from stream_reward.cli import build_parser
from stream_reward.wire.keys import Keys

WORKERS = Path(__file__).resolve().parents[2] / "workers"


def _deployment_args() -> list[str]:
    deployment = yaml.safe_load((WORKERS / "k8s" / "deployment.yaml").read_text())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return [a.replace("$(POD_NAME)", "pod-0") for a in container["args"]]


def _entrypoint() -> list[str]:
    line = next(x for x in (WORKERS / "Dockerfile").read_text().splitlines() if x.startswith("ENTRYPOINT"))
    return json.loads(line.removeprefix("ENTRYPOINT").strip())


def test_the_image_runs_the_worker_and_the_deployment_args_parse() -> None:
    program, *entry = _entrypoint()
    assert program == "stream-reward" and entry[0] == "worker"
    args = build_parser().parse_args([*entry, *_deployment_args()])
    assert args.namespace == "sr" and args.group == "scorers" and args.consumer == "pod-0"


def test_the_keda_triggers_watch_the_stream_and_group_the_workers_read() -> None:
    args = build_parser().parse_args([*_entrypoint()[1:], *_deployment_args()])
    scaled = yaml.safe_load((WORKERS / "k8s" / "keda-scaledobject.yaml").read_text())
    lag, pending = scaled["spec"]["triggers"]
    for trigger in (lag, pending):
        assert trigger["type"] == "redis-streams"
        assert trigger["metadata"]["stream"] == Keys(args.namespace, args.partitions or 1).stream(0)
        assert trigger["metadata"]["consumerGroup"] == args.group
    assert re.fullmatch(r"\d+", lag["metadata"]["lagCount"]) and lag["metadata"]["activationLagCount"] == "0"
    assert re.fullmatch(r"\d+", pending["metadata"]["pendingEntriesCount"])


def test_keda_reads_the_redis_the_workers_connect_to() -> None:
    deployment = yaml.safe_load((WORKERS / "k8s" / "deployment.yaml").read_text())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    url = env["STREAM_REWARD_CONNECTION_REDIS"]["value"]
    scaled = yaml.safe_load((WORKERS / "k8s" / "keda-scaledobject.yaml").read_text())
    for trigger in scaled["spec"]["triggers"]:
        for name in (trigger["metadata"]["addressFromEnv"], trigger["metadata"]["passwordFromEnv"]):
            assert name in env and f"$({name})" in url
