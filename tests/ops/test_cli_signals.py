"""The CLI's promise: a SIGTERM or a Ctrl-C at any moment of a command's life stops it as
docs/operations.md says. SIGTERM exits 143 and says nothing; Ctrl-C exits 130 with the one
line ``stream-reward CMD: interrupted``; the private server, its temp dir and the local
workers go with the command; no traceback, "Exception ignored", "never awaited" or abort.
``stream-reward worker`` stopped before it becomes the worker program exits 0 quietly, as
a worker stopped before it starts; ``server`` exits 0 (or 143) and leaves nothing behind.

Python loses the raise of a signal handler in some places: torch's C extension (its own
import of numpy), the at-fork hooks subprocess runs in the parent, code run by exec() of
source text. The CLI keeps each signal and raises it again at the next safe point; through
torch's import it holds them, since a raise inside torch's C++ callbacks aborts the process.

Each test runs the real CLI and sends a real signal at one precise moment, from a small
launcher: an import hook, a profile hook on torch's C calls, or a wrapper around one call
(asyncio's loop start and close, ``os.execv``), instead of a sleep that guesses it. Where
the moment is a span (a score at work, a large demo), the signal comes at fixed offsets
from a moment the test sees (the private server's temp dir, the first push on the stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import (
    one_line,
    read_err,
    run_in_own_session,
    run_to_end,
    said,
    start_in_own_group,
    timed_wait,
    wait_until,
)

from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]
SLOW = "python:tests/data/failwell_scorers.py:slow"
SCORE_SLOW = ["--scorer", SLOW, "--processes", "1"]
DEMO = ["demo", "--n", "200000", "--generation-s", "60", "--processes", "1"]


NOISE = (
    "terminate called",
    "Traceback",
    "Exception ignored",
    "never retrieved",
    "never awaited",
    "Fatal Python",
    "was destroyed",
)


# argv: <trigger kind> <trigger arg> <SIGTERM|SIGINT> <proc|group> <cli args...>
#   import <modules>: the first time one of <modules> (comma-separated) is looked up while the pipeline module is
#                    loaded and torch's C extension is not (torch's import under way)
#   cli-import <module>: the first time <module> is looked up (the CLI's own import)
#   loop-start -: as asyncio.run's loop starts, before the command's coroutine runs
#   loop-close -: as asyncio.run closes its loop, the command's coroutine done
#   torch-c <function>: at the first Python call torch's C function torch._C.<function> makes
#                       (torch's import runs it; C++ is on the stack below that Python code)
MOMENT_LAUNCH = r"""
import os, signal, sys

KIND, ARG, SIG, WHO = sys.argv[1:5]
del sys.argv[1:5]
SIG = getattr(signal, SIG)


def fire():
    open(os.path.join(os.environ["TMPDIR"], "fired"), "w").close()
    if WHO == "group":
        os.killpg(os.getpgid(0), SIG)
    else:
        os.kill(os.getpid(), SIG)


state = {"fired": False}


class Hook:
    def find_spec(self, name, path=None, target=None):
        if state["fired"] or name not in ARG.split(","):
            return None
        if KIND == "import" and ("stream_reward.ops.pipeline" not in sys.modules or "torch._C" in sys.modules):
            return None
        if KIND in ("import", "cli-import"):
            state["fired"] = True
            fire()
        return None


sys.meta_path.insert(0, Hook())

c_calls = []


def profile(frame, event, arg):
    if event == "c_call":
        c_calls.append(arg)
    elif event in ("c_return", "c_exception"):
        if c_calls:
            c_calls.pop()
    elif event == "call" and c_calls and not state["fired"]:
        caller = c_calls[-1]
        if getattr(caller, "__module__", None) == "torch._C" and getattr(caller, "__name__", None) == ARG:
            state["fired"] = True
            sys.setprofile(None)
            fire()


class TorchImport:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not state["fired"]:
            sys.setprofile(profile)  # from torch's import on: its C calls are watched
        return None


if KIND == "torch-c":
    sys.meta_path.insert(0, TorchImport())

if KIND in ("loop-start", "loop-close"):
    import asyncio.base_events as be

    name = "run_until_complete" if KIND == "loop-start" else "close"
    original = getattr(be.BaseEventLoop, name)

    def patched(self, *args):
        if not state["fired"]:
            state["fired"] = True
            fire()
        return original(self, *args)

    setattr(be.BaseEventLoop, name, patched)

from stream_reward.cli import main

sys.exit(main(sys.argv[1:]))
"""


def run_cli(tmp_path: Path, trigger: list[str], cli_args: list[str], limit_s: float = 30) -> tuple:
    """(exit code or None, seconds, stderr, temp dirs left in the run's TMPDIR)."""
    # Short: the private server's unix socket lives under it (xdist's tmp_path is too long).
    tmpdir = Path(tempfile.mkdtemp(prefix="sr-"))
    tmp_path.joinpath("tmpdir").write_text(str(tmpdir))
    proc = subprocess.Popen(
        [sys.executable, "-c", MOMENT_LAUNCH, *trigger, *cli_args],
        cwd=ROOT,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "TMPDIR": str(tmpdir)},
    )
    started = time.monotonic()
    try:
        try:
            _, err = proc.communicate(timeout=limit_s)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
            proc.kill()
            _, err = proc.communicate()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    took = time.monotonic() - started
    time.sleep(0.5)  # a private server's temp dir is removed before the exit, not after
    left = sorted(p.name for p in tmpdir.glob("stream-reward-*"))
    fired = tmpdir.joinpath("fired").exists()
    shutil.rmtree(tmpdir, ignore_errors=True)
    assert fired, f"the signal was never sent (the trigger {trigger} never came): {err.decode(errors='replace')}"
    return code, round(took, 1), err.decode(errors="replace"), left


def assert_clean_exit(code, took, stderr, left, sig, command):
    assert not any(word in stderr for word in NOISE), (code, took, stderr[-3000:])
    lines = [line for line in stderr.splitlines() if line.strip()]
    if sig == "SIGINT":
        assert code == 130 and lines == [f"stream-reward {command}: interrupted"], (code, took, stderr[-3000:])
    else:
        assert code == 143 and lines == [], (code, took, stderr[-3000:])
    assert not left, left


# ---------------------------------------------------------------------- torch's import
# The CLI, with a terminal's Ctrl-C (SIGINT to the foreground group) sent the moment
# numpy's import starts inside the demo, before torch's C extension is loaded (torch._C
# imports numpy from its own init and drops what that import raised: the Ctrl-C was lost
# and the demo ran its whole generation). A marker file says the hook fired.
CTRL_C_AT_NUMPY_LAUNCH = r"""
import os, signal, sys

MARK = sys.argv.pop(1)

class CtrlCWhileTorchImportsNumpy:
    fired = False

    def find_spec(self, name, path=None, target=None):
        if (
            not CtrlCWhileTorchImportsNumpy.fired
            and name == "numpy"
            and "stream_reward.ops.demo" in sys.modules  # cmd_demo is running
            and "torch._C" not in sys.modules
        ):
            CtrlCWhileTorchImportsNumpy.fired = True
            with open(MARK, "w") as f:
                f.write("torch" if "torch" in sys.modules else "-")
            os.killpg(os.getpgid(0), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlCWhileTorchImportsNumpy())
from stream_reward.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_while_the_demo_imports_torch_is_not_lost(tmp_path, redis_url, namespace):
    pytest.importorskip("torch")
    pytest.importorskip("numpy")
    mark = tmp_path / "fired"
    argv = [sys.executable, "-c", CTRL_C_AT_NUMPY_LAUNCH, str(mark), "demo", "--n", "200000", "--generation-s", "60"]
    argv += ["--processes", "1", "--redis", redis_url, "--namespace", namespace]
    proc = start_in_own_group(argv)
    try:
        started = time.monotonic()
        code, stderr = run_to_end(proc, timeout=30)
        took = time.monotonic() - started
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a worker the demo left behind
    assert mark.exists(), f"the Ctrl-C was never sent (numpy imported before the demo started?): {stderr}"
    # A lost Ctrl-C: code None (still running at 30 s; left alone it finishes the 60 s demo and exits 0).
    assert code == 130, (code, round(took, 1), mark.read_text(), stderr[-2000:])
    lines = said(stderr)
    assert lines == ["stream-reward demo: interrupted"], stderr


@pytest.mark.parametrize(("sig", "who"), [("SIGTERM", "proc"), ("SIGINT", "group")], ids=["sigterm", "ctrl-c"])
def test_signal_while_torch_imports_numpys_extension_is_not_a_traceback(tmp_path, sig, who):
    """The signal lands inside numpy's C extension init (its import of numpy.exceptions),
    inside torch._C's import of numpy. A raise there leaves numpy half imported, and
    torch's next import of numpy fails: 'ImportError: cannot load module more than once
    per process' (3.11) or 'RuntimeError: CPU dispatcher tracer already initlized' (3.10),
    a traceback and exit 1."""
    pytest.importorskip("torch")
    pytest.importorskip("numpy")
    # The first module numpy's extension init imports: numpy.exceptions (numpy 2), or
    # numpy.core._exceptions (numpy 1.24, the floor's).
    trigger = "numpy.exceptions,numpy.core._exceptions"
    code, took, stderr, left = run_cli(tmp_path, ["import", trigger, sig, who], DEMO)
    assert_clean_exit(code, took, stderr, left, sig, "demo")


@pytest.mark.parametrize("function", ["_c10d_init", "_multiprocessing_init"])
@pytest.mark.parametrize(("sig", "who"), [("SIGTERM", "proc"), ("SIGINT", "group")], ids=["sigterm", "ctrl-c"])
def test_signal_while_torchs_c_extension_calls_python_exits_as_documented(tmp_path, sig, who, function):
    """torch's import runs C++ functions of its extension (``torch._C._autograd_init``,
    ...) that call back into Python. A signal whose handler raises in that Python code
    comes back into C++ as an exception it cannot pass on: ``terminate called after
    throwing an instance of 'python_error'`` (or pybind11's ``error_already_set``), abort,
    exit -6, no drain, the private server's temp dir left behind. ``score`` imports torch
    once its pipeline is up, so the signal lands with a server and a worker to stop."""
    pytest.importorskip("torch")
    src = tmp_path / "in.jsonl"
    src.write_text('{"data_source": "test", "response": "ok", "extra_info": {"sleep_s": 60}}\n')
    code, took, stderr, left = run_cli(tmp_path, ["torch-c", function, sig, who], ["score", str(src), *SCORE_SLOW])
    assert_clean_exit(code, took, stderr, left, sig, "score")


# ---------------------------------------------------------------------- raises Python drops
# The same for SIGTERM, sent from an at-fork hook in the parent: the first fork after
# `score` starts (its private server's or a worker's spawn). Python reports what the hook
# raised as "Exception ignored" and goes on: a SIGTERM to `score` as it started its worker
# was lost, and `score` ran its sample to the end.
LAUNCH_FORK = r"""
import os, signal, sys

def after_fork_in_parent():
    if "stream_reward.ops.pipeline" in sys.modules and not getattr(after_fork_in_parent, "fired", False):
        after_fork_in_parent.fired = True
        os.kill(os.getpid(), signal.SIGTERM)

os.register_at_fork(after_in_parent=after_fork_in_parent)
from stream_reward.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_sigterm_raised_inside_an_at_fork_hook_still_stops_score(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"data_source": "test", "response": "ok", "extra_info": {"sleep_s": 60}}\n')
    argv = [sys.executable, "-c", LAUNCH_FORK, "score", str(src), *SCORE_SLOW]
    proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    code, stderr = run_to_end(proc)
    assert code == 143, (code, stderr[-2000:])
    assert "Traceback" not in stderr, stderr


# A Ctrl-C whose KeyboardInterrupt leaves code run by exec() or eval() of source text:
# dataclasses' and namedtuple's generated methods, and parts of torch's import, run that
# way. Python then marks the KeyboardInterrupt unhandled for good. Run as
# `python -m stream_reward.cli`, once main() had caught it, printed "interrupted" and
# returned 130, the interpreter killed itself with SIGINT at exit: status -2 (the
# `stream-reward` script exits through sys.exit's own path and is spared). A Ctrl-C early in
# a demo's start lands in such code often. Here `status`'s command is replaced by one that
# runs its work through exec(), the Ctrl-C sent from inside it, and the CLI is run with -m.
LAUNCH_EXEC = """
import sys
import stream_reward.cli as cli

def cmd_status(args):
    exec("import os, signal, time\\nos.killpg(os.getpgid(0), signal.SIGINT)\\ntime.sleep(30)")
    return 0

cli.cmd_status = cmd_status
if __name__ == "__main__":
    sys.exit(cli.main())
"""


def test_ctrl_c_raised_inside_exec_of_source_text_still_exits_130(tmp_path):
    (tmp_path / "launch_exec.py").write_text(LAUNCH_EXEC)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    argv = [sys.executable, "-m", "launch_exec", "status", "--redis", f"unix://{tmp_path}/nothing.sock"]
    proc = start_in_own_group(argv, env=env)
    code, stderr = run_to_end(proc)
    # Python's own SIGINT at exit would make it -2, after the one line below.
    assert code == 130, (code, stderr[-2000:])
    lines = said(stderr)
    assert lines == ["stream-reward status: interrupted"], stderr


# ---------------------------------------------------------------------- asyncio.run's start and close
@pytest.mark.parametrize(
    ("sig", "who", "command"),
    [
        ("SIGTERM", "proc", ["status", "--redis", "unix:///nonexistent"]),
        ("SIGINT", "group", ["collect", "--redis", "unix:///nonexistent", "--batch", "b", "--timeout-s", "30"]),
        ("SIGTERM", "proc", DEMO),
    ],
    ids=["status-sigterm", "collect-ctrl-c", "demo-sigterm"],
)
def test_signal_as_the_loop_starts_leaves_no_unawaited_coroutine(tmp_path, sig, who, command):
    """The signal lands as asyncio.run's loop starts, before the command's coroutine has
    run. Raised there, it leaves 'RuntimeWarning: coroutine 'read_status' was never
    awaited' (and '_bounded', 'cmd_collect.<locals>.run', 'run_demo',
    'LocalPipeline.guard') on stderr."""
    code, took, stderr, left = run_cli(tmp_path, ["loop-start", "-", sig, who], command)
    assert_clean_exit(code, took, stderr, left, sig, command[0])


def test_sigterm_as_the_loop_closes_exits_143_and_removes_the_temp_dir(tmp_path):
    """A demo that finished, its loop closing. Were the signals handed to the loop,
    ``remove_signal_handler`` would leave SIG_DFL before _on_signal was put back: a SIGTERM
    then kills the process (returncode -15) and leaves the private server's
    stream-reward-* dir in TMPDIR."""
    code, took, stderr, left = run_cli(
        tmp_path, ["loop-close", "-", "SIGTERM", "proc"], ["demo", "--n", "200", "--processes", "1"]
    )
    assert_clean_exit(code, took, stderr, left, "SIGTERM", "demo")


# ---------------------------------------------------------------------- score at work
def start_score(tmp_path: Path, sleep_s: float, env: dict[str, str] | None = None) -> subprocess.Popen:
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"data_source": "test", "response": "ok", "extra_info": {"sleep_s": sleep_s}}) + "\n")
    return subprocess.Popen(
        [sys.executable, "-m", "stream_reward.cli", "score", str(src), "--scorer", SLOW, "--processes", "1"],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )


def private_server_dirs(pid: int) -> list[Path]:
    found = []
    for path in Path(tempfile.gettempdir()).glob("stream-reward-*"):
        with contextlib.suppress(OSError):
            if (path / "owner.pid").read_text() == str(pid):
                found.append(path)
    return found


def sigterm_once_started(proc: subprocess.Popen, after_s: float) -> tuple[int | None, float, str, list[Path]]:
    """SIGTERM ``after_s`` after the private server's temp dir appears: (exit code, seconds
    to the exit, stderr, the temp dirs it owned)."""
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not private_server_dirs(proc.pid) and proc.poll() is None:
            time.sleep(0.02)
        mine = private_server_dirs(proc.pid)
        time.sleep(after_s)
        proc.send_signal(signal.SIGTERM)
        code, waited = timed_wait(proc, 40)
        return code, waited, read_err(proc), mine
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_to_score_removes_its_temp_dir(tmp_path):
    """The private server's temp dir (socket, owner.pid) goes with a SIGTERM'd score: the
    signal unwinds the command's with-blocks, where a death by signal would leave it."""
    code, waited, stderr, mine = sigterm_once_started(start_score(tmp_path, sleep_s=30), 3.0)  # the worker is scoring
    assert mine, stderr
    assert not any(path.exists() for path in mine), (code, waited, stderr)


@pytest.mark.parametrize("after_s", [0.0, 0.7, 1.4, 2.1, 3.0])
def test_sigterm_to_score_at_any_moment_exits_143_without_a_traceback(tmp_path, after_s):
    """Counted from the private server's start: the signal lands while the trajectories
    are pushed, while torch imports, or while the worker scores.
    A SystemExit raised wherever Python stands would come out, inside a task that is not
    the loop's main one, as "Task exception was never retrieved" and a traceback."""
    code, waited, stderr, _ = sigterm_once_started(start_score(tmp_path, sleep_s=30), after_s)
    assert code == 143, (code, waited, stderr)
    assert "Traceback" not in stderr and "never retrieved" not in stderr, stderr


def test_sigterm_to_score_does_not_wait_out_its_workers_drain(tmp_path):
    """A drain hands in-flight samples back to other workers. The server of a plain
    ``score`` is private and goes with it, so nobody is left to take them: waiting out a
    60 s drain (or the 15 s the pipeline gives its workers) saves nothing."""
    proc = start_score(tmp_path, sleep_s=300, env={"STREAM_REWARD_CONSUMER_DRAIN_TIMEOUT_S": "60"})
    # 6 s: the sample is with the worker (a later moment only makes the exit shorter).
    code, waited, stderr, mine = sigterm_once_started(proc, 6.0)
    assert mine, stderr
    # About 2 s here; 14 s is CI's slack, under the 15 s after which the pipeline kills.
    assert code == 143 and waited < 14, (code, waited, stderr)
    assert not any(path.exists() for path in mine)


# ---------------------------------------------------------------------- demo at work
def demo_argv(n: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "stream_reward.cli", "demo", "--n", str(n), "--generation-s", "60", *args]


def ctrl_c(proc: subprocess.Popen) -> tuple[int | None, float, str]:
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: the demo and its workers
    code, waited = timed_wait(proc, 40)
    return code, waited, read_err(proc)


# A demo of 2,000,000 samples: whatever setup grows with n (making the samples, their
# finish times) must not stand between a Ctrl-C and the exit. 20 s is CI's slack for a
# loaded machine; here the exit takes about 2 s. Made up front, the samples alone took
# 30 s of CPU that no Ctrl-C could cut short.
@pytest.mark.parametrize("after_s", [1.5, 6.0], ids=["while_starting", "after_6s"])
def test_ctrl_c_on_a_large_demo_is_one_line_and_prompt(after_s):
    proc = start_in_own_group(demo_argv(2_000_000))
    try:
        time.sleep(after_s)
        code, waited, stderr = ctrl_c(proc)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a worker the demo left behind
    assert code == 130 and waited < 20, (code, waited, stderr)
    assert "interrupted" in one_line(stderr)


async def test_ctrl_c_on_a_demo_while_rollouts_stream_is_one_line(redis_url, namespace):
    """The signal lands once pushes are on the stream (seen there, not guessed by a sleep)."""
    proc = start_in_own_group(demo_argv(200_000, "--redis", redis_url, "--namespace", namespace))
    try:
        client = await connect(redis_url)
        try:
            stream = Keys(namespace).stream()

            async def streaming() -> bool:
                return await client.xlen(stream) > 0 or proc.poll() is not None

            await wait_until(streaming, timeout_s=60)
        finally:
            await client.aclose()
        assert proc.poll() is None, read_err(proc)
        code, waited, stderr = await asyncio.to_thread(ctrl_c, proc)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a demo or a worker still there
        proc.wait()
    assert code == 130 and waited < 20, (code, waited, stderr)
    assert "interrupted" in one_line(stderr)


# ---------------------------------------------------------------------- worker and server commands


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
    """After ``main`` gave back the kept signals (``worker`` gets no ``_on_signal``) and
    before ``cmd_worker``'s ``os.execv``, a Ctrl-C would be ``main``'s ``except
    KeyboardInterrupt`` (one line and 130) and a SIGTERM SIG_DFL (a death by signal, -15);
    a worker stopped before it started exits 0 quietly (``_stopped_early``)."""
    rc, took, err, left = run_in_own_session(
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
    """``server`` puts its handlers in before it imports the embedded server: a SIGTERM
    there, with SIG_DFL still in place, would be a death by signal (-15)."""
    rc, took, err, left = run_in_own_session(
        CLI_HOOK_LAUNCH, ["stream_reward.ops.embedded", "SIGTERM", "server"], 30, env={"TMPDIR": str(tmp_path)}
    )
    assert rc in (0, 143), (rc, took, err[-3000:], left)
    assert not left, left
    assert not list(tmp_path.glob("stream-reward-*"))
