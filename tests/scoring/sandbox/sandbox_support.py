"""Helpers for the tests that run real programs in real sandboxes (bwrap and unshare):
a scorer with short limits (skipped where no backend works), a sample around a
program, and the live processes of this test process's sandboxes."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import pytest

from stream_reward.errors import ConfigError
from stream_reward.scoring.sandbox.isolation import MARKER, OWNER_ENV
from stream_reward.scoring.sandbox.scorer import SandboxConfig, SandboxScorer
from stream_reward.scoring.scorer import Scored
from stream_reward.wire.trajectory import Trajectory

# A uid range of our own, so that sandboxes of other test runs or benchmarks on the
# same host never look like ours (nor ours like theirs).
UIDS = dict(uid_base=200_000 + (os.getpid() % 10_000) * 64, uid_count=64)
FAST = dict(timeout_s=1.5, cpu_s=1.0, memory_mb=256, max_output_bytes=1 << 20, **UIDS)


def config(limits: dict[str, Any] = FAST, **kw: Any) -> SandboxConfig:
    return SandboxConfig(**{**limits, **kw})


def scorer_or_skip(limits: dict[str, Any] = FAST, **kw: Any) -> SandboxScorer:
    """A scorer with ``limits`` (``kw`` overrides them); the caller closes it."""
    try:
        return SandboxScorer(config(limits, **kw))
    except ConfigError as exc:
        pytest.skip(f"sandbox backend unavailable here: {exc}")


def sandboxed_processes(slots: bool = True) -> list[tuple[str, int, bytes]]:
    """Live processes of sandboxes this test process started: by uid (even a program
    that exec'd something else with a clean environment keeps its uid), and, with
    ``slots``, by the harness's marker plus our pid as owner (the harness itself
    runs as root and lives as long as its scorer)."""
    owner = f"{OWNER_ENV}={os.getpid()}".encode()
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            uid = os.stat(f"/proc/{pid}").st_uid
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        mine = UIDS["uid_base"] <= uid < UIDS["uid_base"] + UIDS["uid_count"]
        if mine or (slots and MARKER.encode() in cmdline and owner in environ):
            found.append((pid, uid, cmdline[:120]))
    return found


def traj(code: str, ground_truth: Any, lang: str = "python") -> Trajectory:
    gt = ground_truth if isinstance(ground_truth, str) else json.dumps(ground_truth)
    return Trajectory(
        batch_id="b", index=0, data_source="code", response=f"Solution:\n```{lang}\n{code}\n```\n", ground_truth=gt
    )


def score(scorer: SandboxScorer, code: str, ground_truth: Any, **kw: Any) -> Scored:
    return asyncio.run(scorer.score(traj(code, ground_truth, **kw)))


def run(scorer: SandboxScorer, traj: Trajectory) -> Scored:
    return asyncio.run(scorer.score(traj))


def stdin_case(expected: str = "ok") -> dict[str, list[str]]:
    return {"inputs": [""], "outputs": [expected]}
