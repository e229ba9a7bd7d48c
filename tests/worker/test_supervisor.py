"""The supervisor (``python -m workers --processes N``): one drain for a Ctrl-C or a SIGTERM
to its process group, every sample handed on and exit 0; a stop while it joins the
namespace (Redis away) or while it spawns a worker exits 0 and leaves no worker behind;
a child whose scorer cannot load is not restarted (exit 2, naming the scorer); a child that
is killed is started again under its own name, so that it takes back what it held.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest
from helpers import (
    pending_samples,
    read_err,
    run_in_own_session,
    sleepy_batch,
    start_in_own_group,
    timed_wait,
    wait_until,
    worker_program_argv,
)

from stream_reward import ProducerConfig, RolloutProducer
from stream_reward.wire.connection import connect
from stream_reward.wire.heartbeat import decode_heartbeat
from stream_reward.wire.keys import Keys

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]

SLOW = "python:tests/data/failwell_scorers.py:slow"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm-to-group"])
async def test_ctrl_c_to_the_supervisors_process_group_is_one_drain(redis_url, namespace, sig):
    n = 20
    proc = subprocess.Popen(
        worker_program_argv(redis_url, namespace, "--processes", "2", "--scorer", SLOW, "--drain-timeout-s", "15"),
        cwd=ROOT,
        start_new_session=True,  # its own process group, as a shell gives a foreground job
        stderr=subprocess.PIPE,
    )
    try:
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
            await producer.open_batch("ctrlc", n, 4)
            await producer.push_many(sleepy_batch("ctrlc", n, 1.5))

            async def busy() -> bool:
                return await pending_samples(redis_url, namespace) == n

            await wait_until(busy, timeout_s=20)
        os.killpg(proc.pid, sig)  # what the terminal does on Ctrl-C; systemd's KillMode=control-group
        code, _ = timed_wait(proc, 30)
        stderr = read_err(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, (code, stderr)
    assert "exiting now" not in stderr and "Traceback" not in stderr, stderr
    assert await pending_samples(redis_url, namespace) == 0  # every sample drained, none left on a stale consumer


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm-to-group"])
def test_a_supervisor_stopped_while_redis_is_away_exits_0_without_a_traceback(tmp_path, namespace, sig):
    """A pool of 2 joins the namespace before it starts its workers, retrying while Redis
    is away. An operator's Ctrl-C then was a KeyboardInterrupt traceback (status -2); a
    SIGTERM killed it without a word (-15). A stop is a stop: 0, as from a drain."""
    nowhere = f"unix://{tmp_path}/nothing.sock"
    argv = [*worker_program_argv(nowhere, namespace, "--processes", "2"), "--log-level", "INFO"]
    proc = start_in_own_group(argv)
    guard = threading.Timer(60, proc.kill)  # a pool that never says "retrying" ends the read
    guard.start()
    try:
        assert proc.stderr is not None
        seen = []
        for raw in proc.stderr:  # until it says it is retrying: the stop lands in the join
            seen.append(raw.decode(errors="replace"))
            if "retrying" in seen[-1]:
                break
        assert "retrying" in "".join(seen), seen
        os.killpg(proc.pid, sig)
        code, waited = timed_wait(proc, 30)
        stderr = "".join(seen) + read_err(proc)
    finally:
        guard.cancel()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 0 and waited < 10, (code, waited, stderr)
    assert "Traceback" not in stderr, stderr


def test_supervisor_stops_restarting_a_child_with_an_unloadable_scorer(redis_url, namespace):
    proc = subprocess.Popen(
        worker_program_argv(redis_url, namespace, "--processes", "2", "--scorer", "python:missing.py:f"),
        cwd=ROOT,
        stderr=subprocess.PIPE,
    )
    code, waited = timed_wait(proc, 60)
    stderr = read_err(proc)
    # The wait includes the start-up of the supervisor and its children (their imports: up to
    # ~11 s beside two CPU hogs); a supervisor that restarts the child goes on for ever.
    assert code == 2 and waited < 30, (code, waited, stderr)
    assert "restarting" not in stderr, stderr
    assert "missing.py" in stderr


# argv: <SIGTERM|SIGINT> <worker args...>. The first subprocess.Popen (the supervisor
# spawning worker 0) gets the signal once the child is forked, before Popen returns.
POOL_LAUNCH = r"""
import os, signal, subprocess, sys

SIG = getattr(signal, sys.argv[1])
del sys.argv[1]
real = subprocess.Popen
state = {"fired": False}


class Popen(real):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not state["fired"]:
            state["fired"] = True
            os.kill(os.getpid(), SIG)  # as if it came while Popen waited on the exec


subprocess.Popen = Popen

from stream_reward.worker.main import main

sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_pool_stopped_while_it_spawns_a_worker_exits_0_and_leaves_no_worker(redis_url, namespace, sig):
    """The signal comes while the supervisor is inside ``subprocess.Popen`` for a worker (the
    child forked and exec'ing): the supervisor signals the children it knows, and one still
    being spawned must be among them, or the pool waits for it forever."""
    rc, took, err, left = run_in_own_session(
        POOL_LAUNCH,
        [sig, "--redis", redis_url, "--namespace", namespace, "--processes", "2", "--drain-timeout-s", "2"],
        limit_s=30,
    )
    assert rc == 0, (rc, took, err[-3000:], left)
    assert "Traceback" not in err, err[-3000:]
    assert not left, left


async def test_the_supervisor_restarts_a_killed_child_under_its_name(redis_url, namespace, spawn_workers) -> None:
    """``worker --processes 2 --consumer sup``: children sup-0 and sup-1. A SIGKILLed child
    leaves its heartbeat; the restarted one must take its name after ~2 intervals, not exit 2."""
    c = connect(redis_url)
    key = Keys(namespace, 1).workers()
    (sup,) = spawn_workers(1, "--processes", "2", "--consumer", "sup")
    try:

        async def beat(name):
            raw = await c.hget(key, name)
            return decode_heartbeat(raw) if raw else None

        async def both():
            return await beat("sup-0") and await beat("sup-1")

        await wait_until(both, 10)
        old = (await beat("sup-0"))["pid"]
        os.kill(old, signal.SIGKILL)

        async def back():
            b = await beat("sup-0")
            return b and b["pid"] != old

        # The restart's wall time includes the new child's start-up (its imports: seconds on a
        # loaded machine); its own heartbeat times the name guard alone, from the worker's
        # start to its beat: about two intervals (2 s each) and a half, one interval more if
        # the first beat was overwritten before it was read.
        await wait_until(back, 60)
        assert sup.poll() is None
        b = await beat("sup-0")
        assert b["seen"] - b["started"] < 2 * 2.0 + 0.5 + 2.0 + 1.5, b
    finally:
        await c.aclose()
