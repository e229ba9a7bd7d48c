"""The local pipeline of ``score`` and ``demo`` (``stream_reward/ops/pipeline.py``): its workers
die with their owner, and workers that cannot start (an unloadable scorer) or die mid-batch
fail the command within seconds, naming the cause, long before its ``--timeout-s``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from helpers import stream_reward_cli
from ops_support import _alive


def test_local_workers_die_with_their_owner(redis_url):
    owner_code = (
        "import sys, time\n"
        "from stream_reward.ops.pipeline import spawn_worker\n"
        f"w = spawn_worker({redis_url!r}, namespace='orphans')\n"
        "print(w.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", owner_code], stdout=subprocess.PIPE, text=True)
    worker_pid = int(owner.stdout.readline())
    assert _alive(worker_pid)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    owner.stdout.close()
    deadline = time.monotonic() + 15  # the worker drains (SIGTERM) before it exits
    while _alive(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker_pid)


# "In seconds" means long before --timeout-s: the fault this guards against is a score that
# waits out its timeout (120 s here) for workers that can never load their scorer. Alone
# each spec takes about 4 s (the CLI's and the worker's imports, the server's start); in
# CI's parallel suite one took 15.5 s. The bound is half the timeout, not a guess at speed.
def test_score_with_an_unloadable_scorer_fails_in_seconds(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"data_source": "openai/gsm8k", "response": "#### 1", "ground_truth": "1"}\n' * 2)
    for spec in ("python:missing.py:f", "python:tests/data/failwell_scorers.py:nope", "no_such_module_x:f"):
        done, took = stream_reward_cli(
            "score", str(src), "--scorer", spec, "--processes", "1", "--timeout-s", "120", timeout_s=150
        )
        assert done.returncode == 2, (spec, done.stderr)
        assert took < 60, (spec, took)
        assert "Traceback" not in done.stderr, done.stderr


def test_score_notices_its_workers_died(tmp_path):
    """A worker that dies mid-batch (its scorer kills the process) is noticed in seconds, not at --timeout
    (the bound is half of it, as above)."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"data_source": "test", "response": "poison", "ground_truth": "1"}\n')
    scorer = "python:tests/data/reliability_scorers.py:slow"
    done, took = stream_reward_cli(
        "score", str(src), "--scorer", scorer, "--processes", "1", "--timeout-s", "120", timeout_s=150
    )
    assert done.returncode == 2 and took < 60, (done.returncode, took, done.stderr)
    assert "worker" in done.stderr and "Traceback" not in done.stderr, done.stderr
