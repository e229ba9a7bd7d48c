"""``bench verl_loop --loop-workers K`` at a tiny size: K RewardLoopWorker processes per
side, stream-reward's sharing one server and one worker pool, scoring as verl does,
and nothing of it left running after. Here, not in tests/bench: importing verl under
the project's filterwarnings=error fails, and the bench would only report ``skipped``."""

from __future__ import annotations

import json
import os

import psutil
import pytest

from stream_reward.bench import verl_loop


def children() -> set[int]:
    """This process's descendants, but multiprocessing's resource tracker (it lives as long as we do)."""
    out = set()
    for proc in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(proc.cmdline()):
                out.add(proc.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_loop_workers_in_processes_share_one_pipeline_and_score_as_verl(capsys: pytest.CaptureFixture[str]) -> None:
    before = children()
    argv = ["--n", "32", "--repeats", "1", "--loop-workers", "2", "--scorers", "verifier", "--json"]
    assert verl_loop.main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["loop_workers"] == 2 and r["n"] == 32
    # The shared workers score with the function the children's config names, as verl does.
    assert r["verifier"]["scores_agree"] == 32
    assert r["verifier"]["verifier_requests"] == 2 * 32 * 2  # both sides, the warm-up round and one more
    assert r["verifier"]["verl_samples_per_s"] > 0 and r["verifier"]["stream_reward_samples_per_s"] > 0
    assert r["goals"]["verifier: same scores as verl"] is True
    assert "verifier: ratio >= 1.2 vs verl's naive manager at loop_workers=2" in r["goals"]
    # The loop-worker processes, the stream-reward workers, the server and the verifier are gone.
    assert children() <= before
