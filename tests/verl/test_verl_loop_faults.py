"""StreamRewardLoopManager when its pipeline fails under it: every local worker or the
server killed. run_single raises a clear error within 60 s, so verl fails the step,
and never answers a 0.0 that would reach rm_scores as a score."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import psutil
import pytest
from verl.experimental.reward_loop import RewardLoopWorker
from verl_support import ROWS, STREAM_OVERRIDES, make_batch

from stream_reward.errors import StreamRewardError
from stream_reward.verl import StreamRewardLoopManager

DETECT_S = 60.0


@pytest.fixture
def ours(compose):
    worker = RewardLoopWorker(compose(*STREAM_OVERRIDES))
    yield worker
    manager = worker.reward_manager
    if isinstance(manager, StreamRewardLoopManager):
        manager.close()


def children(name: str) -> list[psutil.Process]:
    """This process's children whose command line holds ``name``."""
    return [p for p in psutil.Process(os.getpid()).children(recursive=True) if name in " ".join(p.cmdline())]


def score_one(worker: RewardLoopWorker, data: Any, i: int) -> Any:
    return worker.loop.run_until_complete(worker.reward_manager.run_single(data[i : i + 1]))


def assert_raises_in_time(worker: RewardLoopWorker, data: Any, match: str) -> float:
    start = time.monotonic()
    with pytest.raises(StreamRewardError, match=match):
        score_one(worker, data, 1)
    took = time.monotonic() - start
    assert took < DETECT_S, f"took {took:.1f} s"
    return took


def test_every_worker_killed_raises_instead_of_scoring_zero(ours, tokenizer) -> None:
    data = make_batch(tokenizer, ROWS)
    assert score_one(ours, data, 0)["reward_extra_info"]["reward_status"] == "ok"
    workers = children("stream_reward.worker")
    assert workers, "no local worker process found"
    for proc in workers:
        proc.send_signal(signal.SIGKILL)
    psutil.wait_procs(workers, timeout=10)
    assert_raises_in_time(ours, data, "worker")


def test_server_killed_raises_instead_of_scoring_zero(ours, tokenizer) -> None:
    data = make_batch(tokenizer, ROWS)
    assert score_one(ours, data, 0)["reward_extra_info"]["reward_status"] == "ok"
    servers = children("-server")
    assert servers, "no server process found"
    for proc in servers:
        proc.send_signal(signal.SIGKILL)
    psutil.wait_procs(servers, timeout=10)
    assert_raises_in_time(ours, data, "Redis|server")
