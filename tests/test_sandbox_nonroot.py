"""The sandbox run by a non-root worker (bwrap in a user namespace, no cgroups):
the hacks that worked there — writing a fake result to the harness's stdout and
killing it, forging the verdict fd, reading expected outputs from memory — score
0.0 with status ok there too.

Runs the scorer in a child process as uid 65534 with the system interpreter of
the same Python version (the venv's lives under /root, which nobody cannot read).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import test_sandbox_hacks as hacks

REPO = Path(__file__).resolve().parent.parent
SYSTEM_PYTHON = f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}"

SCRIPT = r"""
import asyncio, json, sys, types
repo, site = sys.argv[1], sys.argv[2]
sys.path[:0] = [repo, site]
# Only the scorer's modules: the package's __init__ pulls in the Redis client.
pkg = types.ModuleType("stream_reward")
pkg.__path__ = [repo + "/stream_reward"]
sys.modules["stream_reward"] = pkg
from stream_reward.scoring.sandbox.scorer import SandboxConfig, SandboxScorer
from stream_reward.wire.trajectory import Trajectory

cases = json.loads(sys.stdin.read())
s = SandboxScorer(SandboxConfig(backend="bwrap", timeout_s=2, cpu_s=2, memory_mb=256, tmp_mb=16, concurrency=1))
out = {"backend": s.backend, "cgroups": s._slots[0].cgroups is not None, "scores": []}
for name, program, gt in cases:
    traj = Trajectory(batch_id="b", index=0, data_source="code", response=f"```python\n{program}\n```", ground_truth=json.dumps(gt))
    try:
        r = asyncio.run(s.score(traj))
        out["scores"].append([name, r.score, r.extra.get("error", "")])
    except Exception as exc:
        out["scores"].append([name, None, f"{type(exc).__name__}: {exc}"])
s.close()
print(json.dumps(out))
"""


def _runnable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to switch to uid 65534"
    if shutil.which("setpriv") is None or shutil.which("bwrap") is None:
        return "needs setpriv and bwrap"
    if not os.path.exists(SYSTEM_PYTHON):
        return f"needs {SYSTEM_PYTHON} (same version as the tests)"
    return None


def _run_as_nobody(repo: Path, cases: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            "setpriv",
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
            SYSTEM_PYTHON,
            "-c",
            SCRIPT,
            str(repo),
            str(repo),
        ],
        input=cases,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/tmp"},
    )


@pytest.mark.skipif(_runnable() is not None, reason=str(_runnable()))
def test_non_root_sandbox_scores_hacks_zero():
    table = [(f"{n}-{f}", p, e.get("gt", hacks.FORMS[f])) for n, f, p, e in hacks.HACKS if "prompt" not in e]
    table += [
        (n, p, {"inputs": ["2 3\n", "-1 1\n", "4 4\n"], "outputs": ["5\n", "0\n", "8\n"]})
        for n, p in hacks.LIMIT_HACKS
        if n not in ("memory_across_forks",)
    ]
    honest = [
        ("honest-stdin", hacks.RIGHT_STDIN, hacks.FORMS["stdin"]),
        ("honest-check", "def add(a, b):\n    return a + b\n", hacks.FORMS["check"]),
    ]
    # uid 65534 must read the scorer's source: the checkout (a CI clone in a 0700 temp dir,
    # say) may be closed to it, so it gets a world-readable copy. The scorer needs only
    # the stdlib, so no site-packages is put on its path.
    shown = Path(tempfile.mkdtemp(prefix="sr-nonroot-"))
    try:
        os.chmod(shown, 0o755)
        shutil.copytree(REPO / "stream_reward", shown / "stream_reward", ignore=shutil.ignore_patterns("__pycache__"))
        proc = _run_as_nobody(shown, json.dumps(honest + table))
    finally:
        shutil.rmtree(shown, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["backend"] == "bwrap"
    scores = {name: (score, error) for name, score, error in out["scores"]}
    assert scores["honest-stdin"][0] == 1.0 and scores["honest-check"][0] == 1.0, scores
    gamed = {name: v for name, v in scores.items() if not name.startswith("honest") and v[0] != 0.0}
    assert gamed == {}
