"""Failing well (issue 14): bounded shutdown in every state, permanent errors fast, one clear line.

Each test drives a real process (a worker, a supervisor, the CLI) against a real
server and measures what an operator would: how long the process takes to go, its
exit code, and what it printed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stream_reward import ProducerConfig, RewardAggregator, RolloutProducer, Trajectory
from stream_reward.ops.embedded import EmbeddedServer
from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent
SLOW = "python:tests/data/failwell_scorers.py:slow"
BLOCKING = "python:tests/data/failwell_scorers.py:blocking"


def batch(batch_id: str, n: int, sleep_s: float) -> list[Trajectory]:
    return [
        Trajectory(batch_id, i, "test", response="ok", valid_response_length=1, extra_info={"sleep_s": sleep_s})
        for i in range(n)
    ]


async def pending_count(url: str, namespace: str) -> int:
    client = connect(url)
    try:
        return int((await client.xpending(Keys(namespace).stream(), "scorers"))["pending"])
    finally:
        await client.aclose()


async def wait_until(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached in time")


def worker_argv(url: str, namespace: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "workers", "--redis", url, "--namespace", namespace, "--log-level", "WARNING", *args]


def timed_wait(proc: subprocess.Popen, limit_s: float) -> tuple[int | None, float]:
    """(exit code or None if still running after limit_s, seconds waited); kills a survivor."""
    started = time.monotonic()
    try:
        code = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None, time.monotonic() - started
    return code, time.monotonic() - started


def read_err(proc: subprocess.Popen) -> str:
    with proc.stderr:
        return proc.stderr.read().decode()


def cli(*args: str, timeout_s: float = 60, **kwargs) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "stream_reward.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        **kwargs,
    )
    return done, time.monotonic() - started


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, stderr
    return lines[0]


# ---------------------------------------------------------------------- shutdown bounded in every state
async def test_sigterm_with_redis_down_exits_within_the_drain_timeout(namespace):
    with EmbeddedServer() as server:
        url = server.url
        proc = subprocess.Popen(
            worker_argv(url, namespace, "--scorer", SLOW, "--drain-timeout-s", "2", "--concurrency", "10"), cwd=ROOT
        )
        try:
            async with RolloutProducer(url, ProducerConfig(namespace=namespace)) as producer:
                await producer.open_batch("down", 4, 4)
                await producer.push_many(batch("down", 4, 1.0))

                async def in_flight() -> bool:
                    return await pending_count(url, namespace) == 4

                await wait_until(in_flight)
            server.kill()  # the samples finish with nowhere to write their results
            proc.send_signal(signal.SIGTERM)
            code, waited = timed_wait(proc, 20)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert code is not None, "worker still running 20 s after SIGTERM with Redis down"
    assert waited < 2 + 3, waited  # drain 2 s plus start-to-exit slack


async def test_saturated_worker_notices_sigterm_at_once(redis_url, namespace, spawn_workers):
    (proc,) = spawn_workers(1, "--scorer", SLOW, "--drain-timeout-s", "1", "--concurrency", "2")
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
        await producer.open_batch("full", 4, 4)
        await producer.push_many(batch("full", 4, 20.0))

        async def saturated() -> bool:
            return await pending_count(redis_url, namespace) == 2

        await wait_until(saturated)
        await asyncio.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    code, waited = timed_wait(proc, 30)
    assert code == 0 and waited < 1 + 2.5, (code, waited)  # not the 20 s a slot takes to free


async def test_ctrl_c_to_the_supervisors_process_group_is_one_drain(redis_url, namespace):
    n = 20
    proc = subprocess.Popen(
        worker_argv(redis_url, namespace, "--processes", "2", "--scorer", SLOW, "--drain-timeout-s", "15"),
        cwd=ROOT,
        start_new_session=True,  # its own process group, as a shell gives a foreground job
        stderr=subprocess.PIPE,
    )
    try:
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
            await producer.open_batch("ctrlc", n, 4)
            await producer.push_many(batch("ctrlc", n, 1.5))

            async def busy() -> bool:
                return await pending_count(redis_url, namespace) == n

            await wait_until(busy)
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        code, _ = timed_wait(proc, 30)
        stderr = read_err(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, (code, stderr)
    assert "exiting now" not in stderr and "Traceback" not in stderr, stderr
    assert await pending_count(redis_url, namespace) == 0  # every sample drained, none left on a stale consumer


# ---------------------------------------------------------------------- permanent errors fail fast
def test_supervisor_stops_restarting_a_child_with_an_unloadable_scorer(redis_url, namespace):
    proc = subprocess.Popen(
        worker_argv(redis_url, namespace, "--processes", "2", "--scorer", "python:missing.py:f"),
        cwd=ROOT,
        stderr=subprocess.PIPE,
    )
    code, waited = timed_wait(proc, 30)
    stderr = read_err(proc)
    assert code == 2 and waited < 10, (code, waited, stderr)
    assert "restarting" not in stderr, stderr
    assert "missing.py" in stderr


def test_score_with_an_unloadable_scorer_fails_in_seconds(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"data_source": "openai/gsm8k", "response": "#### 1", "ground_truth": "1"}\n' * 2)
    for spec in ("python:missing.py:f", "python:tests/data/failwell_scorers.py:nope", "no_such_module_x:f"):
        done, took = cli("score", str(src), "--scorer", spec, "--processes", "1", "--timeout", "120", timeout_s=150)
        assert done.returncode == 2, (spec, done.stderr)
        assert took < 15, (spec, took)
        assert "Traceback" not in done.stderr, done.stderr


def test_score_notices_its_workers_died(tmp_path):
    """A worker that dies mid-batch (its scorer kills the process) is noticed in seconds, not at --timeout."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"data_source": "test", "response": "poison", "ground_truth": "1"}\n')
    scorer = "python:tests/data/reliability_scorers.py:slow"
    done, took = cli("score", str(src), "--scorer", scorer, "--processes", "1", "--timeout", "120", timeout_s=150)
    assert done.returncode == 2 and took < 20, (done.returncode, took, done.stderr)
    assert "worker" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_wrong_password_is_permanent_one_line_and_fast(namespace):
    secret = "s3cret-pw-123"
    with EmbeddedServer(extra_args=["--requirepass", secret]) as server:
        bad = f"unix://:wrong-{secret}@{server.socket_path}"
        proc = subprocess.Popen(worker_argv(bad, namespace), cwd=ROOT, stderr=subprocess.PIPE)
        code, waited = timed_wait(proc, 30)
        stderr = read_err(proc)
        assert code == 2 and waited < 10, (code, waited, stderr)
        line = one_line(stderr)
        assert "auth" in line.lower() and secret not in line and "unreachable" not in line, line
        for args in (["status"], ["dlq", "list"]):
            done, took = cli(*args, "--redis", bad, timeout_s=30)
            assert done.returncode == 2 and took < 10, (args, done.returncode, took, done.stderr)
            line = one_line(done.stderr)
            assert "auth" in line.lower() and secret not in line, line
