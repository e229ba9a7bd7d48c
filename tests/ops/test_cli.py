"""The ``stream-reward`` command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stream_reward.cli import main

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------- deprecations
def test_an_old_flag_is_one_line_of_ours_not_pythons_warning(capsys: pytest.CaptureFixture[str]) -> None:
    """Python's line names our file and line (``.../worker_cli.py:90: ConfigDeprecationWarning:``)
    and prints the source line under it; the user needs the new spelling only."""
    assert main(["score", "/nonexistent/in.jsonl", "--timeout", "5"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "stream-reward score: --timeout is deprecated; use --timeout-s",
        "stream-reward score: /nonexistent/in.jsonl: No such file or directory",
    ]


def test_old_flags_and_environment_names_are_one_line_each_from_the_programs() -> None:
    """As run, with Python's own warning filters: the CLI, and the worker program that
    ``stream-reward worker`` becomes (it says its own, the CLI says nothing before the exec)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "STREAM_REWARD_MAX_RPM": "5"}
    env.pop("PYTHONWARNINGS", None)
    nowhere = ["--redis", "unix:///nonexistent/redis.sock"]
    runs = {
        "config": [sys.executable, "-m", "stream_reward.cli", "config", "show", "--json", "--max-inflight", "4"],
        "worker": [sys.executable, "-m", "stream_reward.worker", *nowhere, "--max-inflight", "4", "--check"],
        "cli worker": [sys.executable, "-m", "stream_reward.cli", "worker", *nowhere, "--max-inflight", "4", "--check"],
    }
    for name, argv in runs.items():
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        prog = "stream-reward config" if name == "config" else "stream-reward worker"
        said = [line for line in proc.stderr.splitlines() if "deprecated" in line]
        assert said == [
            f"{prog}: --max-inflight is deprecated; use --max-concurrent",
            f"{prog}: $STREAM_REWARD_MAX_RPM is deprecated; set $STREAM_REWARD_QUOTA_MAX_RPM instead",
        ], (name, proc.stderr)
        assert "Warning" not in proc.stderr, (name, proc.stderr)
