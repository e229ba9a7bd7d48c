"""Signals at random moments of a command's life (a "signal storm"), made deterministic.

Each test runs the real program in a session of its own and sends a real signal
(``os.kill``) at one precise moment, found by a random-delay storm, from a small
launcher that wraps one call instead of a sleep that guesses it.

1. A pool (``python -m workers --processes 2``) sent SIGTERM (or Ctrl-C) while the
   supervisor is inside ``subprocess.Popen`` for a worker (the child is forked and
   exec'ing, ``Popen`` waits on its error pipe) never stops that worker: ``on_signal``
   signals the children it knows, and the one being spawned is not in ``children``
   yet (``stream_reward/worker/supervisor.py`` ``spawn``: ``children[slot] = subprocess.Popen(...)``).
   The supervisor then waits for that worker forever: a hang, not a drain and exit 0.
2. A worker (``python -m workers --processes 1``) sent SIGTERM or Ctrl-C after
   ``stream_reward.worker.main.main`` gave back the signals kept through its imports
   (``early_signals.release()``) and before ``run_worker`` installs its loop handlers
   (``_install_signal_handlers``): argparse, ``resolve_args``, ``asyncio.run``'s set-up and
   ``run_worker``'s own ``from stream_reward.worker.consumer import Worker``. SIGTERM there is
   SIG_DFL, a death by signal (-15) with nothing drained; Ctrl-C there is asyncio.Runner's
   SIGINT handler, which cancels the main task: a ``KeyboardInterrupt`` traceback out of
   ``asyncio.run`` (exit -2). The SIGTERM storm hit it in 5/25 runs of ``--processes 1``.
   Likewise a pool (``--processes 2``) before ``_join_unless_stopped`` puts its loop
   handlers in: ``run_from_args``'s ``from stream_reward.worker.supervisor import supervise`` (and, not
   tested here, from the join's loop teardown until ``supervise``'s ``signal.signal``).
3. ``stream-reward worker`` sent SIGTERM or Ctrl-C after ``main`` gave back the kept
   signals (``early_signals.release()``; ``worker`` gets no ``_on_signal``) and before
   ``cmd_worker``'s ``os.execv``: Ctrl-C is ``main``'s ``except KeyboardInterrupt``, one
   line ``stream-reward worker: interrupted`` and 130, where a worker stopped before it
   started exits 0 quietly (``_stopped_early``, docs/operations.md); SIGTERM is SIG_DFL,
   a death by signal (-15).
4. ``stream-reward server`` sent SIGTERM while it imports its embedded server, before
   it puts in its handlers: SIG_DFL, a death by signal (-15).

Not taken up: a signal after ``main()`` returned (sent from an atexit callback) is kept
by nobody and the command exits with its own status. Its work is done by then; raised
there, the signal was an "Exception ignored" traceback or a death by signal instead.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _session_procs(sid: int) -> list[tuple[int, str]]:
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
            rest = stat[stat.rindex(")") + 2 :].split()
            if int(rest[3]) == sid and rest[0] != "Z":
                cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
                out.append((int(p), cmd))
        except (OSError, ValueError, IndexError):
            pass
    return out


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _run(code: str, args: list[str], limit_s: float, env: dict | None = None) -> tuple:
    """(exit code or None on a hang, seconds, stderr, processes of its session left)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})},
        # As from a terminal: a SIGINT ignored by whoever runs the tests (a background job
        # of a non-interactive shell) would be inherited, and Python keeps it ignored.
        preexec_fn=_default_sigint,
    )
    started = time.monotonic()
    try:
        try:
            _, err = proc.communicate(timeout=limit_s)
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
        took = time.monotonic() - started
        time.sleep(0.5)
        left = _session_procs(proc.pid)
    finally:
        for pid, _ in _session_procs(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.returncode is None:
            _, err = proc.communicate()
    return rc, round(took, 1), err.decode(errors="replace"), left


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
    rc, took, err, left = _run(
        POOL_LAUNCH,
        [sig, "--redis", redis_url, "--namespace", namespace, "--processes", "2", "--drain-timeout-s", "2"],
        limit_s=30,
    )
    assert rc == 0, (rc, took, err[-3000:], left)
    assert "Traceback" not in err, err[-3000:]
    assert not left, left


# argv: <module> <SIGTERM|SIGINT> <worker args...>: as ``python -m workers``, with the
# signal sent the first time <module> is looked up by an import.
WORKER_LAUNCH = r"""
import os, signal, sys

MOD, SIG = sys.argv[1], getattr(signal, sys.argv[2])
del sys.argv[1:3]
from stream_reward.ops import early_signals

early_signals.keep()
state = {"fired": False}


class Hook:
    def find_spec(self, name, path=None, target=None):
        if not state["fired"] and name == MOD:
            state["fired"] = True
            os.kill(os.getpid(), SIG)
        return None


sys.meta_path.insert(0, Hook())
from stream_reward.worker.main import main

sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
@pytest.mark.parametrize(
    ("module", "processes"),
    [("stream_reward.worker.consumer", "1"), ("stream_reward.worker.supervisor", "2")],
    ids=["worker-imports-consumer", "pool-imports-supervisor-before-join"],
)
def test_worker_or_pool_stopped_between_its_handlers_exits_0_quietly(redis_url, namespace, sig, module, processes):
    rc, took, err, left = _run(
        WORKER_LAUNCH,
        [module, sig, "--redis", redis_url, "--namespace", namespace, "--processes", processes],
        limit_s=30,
    )
    assert rc == 0, (rc, took, err[-3000:], left)
    assert "Traceback" not in err, err[-3000:]
    assert not left, left


# argv: <SIGTERM|SIGINT> <cli args...>: the signal comes as cmd_worker calls os.execv.
CLI_EXEC_LAUNCH = r"""
import os, signal, sys

SIG = getattr(signal, sys.argv[1])
del sys.argv[1]
real = os.execv


def execv(*args):
    os.kill(os.getpid(), SIG)  # as if it came in cmd_worker's resolve_args, just before
    return real(*args)


os.execv = execv
from stream_reward.ops import early_signals

early_signals.keep()  # as `stream-reward` and `python -m stream_reward.cli` do before their imports
from stream_reward.cli import main

sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_cli_worker_stopped_before_it_execs_the_worker_exits_0_quietly(redis_url, namespace, sig):
    rc, took, err, left = _run(
        CLI_EXEC_LAUNCH, [sig, "worker", "--redis", redis_url, "--namespace", namespace, "--processes", "1"], limit_s=30
    )
    assert (rc, err.strip()) == (0, ""), (rc, took, err[-3000:], left)
    assert not left, left


# argv: <module> <SIGTERM|SIGINT> <cli args...>: the signal is sent the first time <module>
# is looked up once stream_reward.cli is imported (while main() runs the command).
CLI_HOOK_LAUNCH = r"""
import os, signal, sys

MOD, SIG = sys.argv[1], getattr(signal, sys.argv[2])
del sys.argv[1:3]
from stream_reward.ops import early_signals

early_signals.keep()  # as `python -m stream_reward.cli` does before its imports
state = {"armed": False, "fired": False}


class Hook:
    def find_spec(self, name, path=None, target=None):
        if state["armed"] and not state["fired"] and name == MOD:
            state["fired"] = True
            os.kill(os.getpid(), SIG)
        return None


sys.meta_path.insert(0, Hook())
import stream_reward.cli as cli

state["armed"] = True
sys.exit(cli.main(sys.argv[1:]))
"""


def test_server_sigterm_as_it_imports_the_embedded_server_is_not_a_death_by_signal(tmp_path):
    rc, took, err, left = _run(
        CLI_HOOK_LAUNCH, ["stream_reward.ops.embedded", "SIGTERM", "server"], 30, env={"TMPDIR": str(tmp_path)}
    )
    assert rc in (0, 143), (rc, took, err[-3000:], left)
    assert not left, left
    assert not list(tmp_path.glob("stream-reward-*"))
