"""The deployment files in workers/ name the real program, flags and keys: the Deployment's
worker command parses, and the KEDA trigger watches the stream and group those workers read."""

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


def test_the_keda_trigger_watches_the_stream_and_group_the_workers_read() -> None:
    args = build_parser().parse_args([*_entrypoint()[1:], *_deployment_args()])
    scaled = yaml.safe_load((WORKERS / "k8s" / "keda-scaledobject.yaml").read_text())
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "redis-streams"
    assert trigger["metadata"]["stream"] == Keys(args.namespace).stream(0)
    assert trigger["metadata"]["consumerGroup"] == args.group
    assert re.fullmatch(r"\d+", trigger["metadata"]["lagCount"])
