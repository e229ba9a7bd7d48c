"""StreamRewardLoopManager when its pipeline fails under it: every local worker or the
server killed, or an external deployment's server killed or stopped. run_single raises a clear error within 60 s, so verl fails the step,
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


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_an_external_redis_gone_raises_within_a_minute(compose, tokenizer, namespace, fault) -> None:
    """``reward_kwargs.redis_url``: a deployment the manager does not supervise. Its
    server killed or stopped, run_single raises naming Redis, in time for verl to fail
    the step."""
    import subprocess

    from helpers import worker_program_argv

    from stream_reward.ops.embedded import EmbeddedServer

    server = EmbeddedServer().start()
    worker = subprocess.Popen(worker_program_argv(server.url, namespace), stderr=subprocess.DEVNULL)
    overrides = (f"+reward.reward_kwargs.redis_url='{server.url}'", f"+reward.reward_kwargs.namespace={namespace}")
    loop_worker = RewardLoopWorker(compose(*STREAM_OVERRIDES, *overrides))
    try:
        data = make_batch(tokenizer, ROWS)
        assert score_one(loop_worker, data, 0)["reward_extra_info"]["reward_status"] == "ok"
        assert server.pid is not None
        os.kill(server.pid, fault)
        assert_raises_in_time(loop_worker, data, "Redis")
    finally:
        if server.pid is not None and fault == signal.SIGSTOP:
            os.kill(server.pid, signal.SIGCONT)
        loop_worker.reward_manager.close()
        worker.kill()
        worker.wait()
        server.stop()
