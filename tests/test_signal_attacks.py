"""Signals at the moments the CLI's "SIGTERM/Ctrl-C at any moment" promise missed.

Each test runs the real CLI in a process group of its own, with a real signal sent
(``os.kill``/``os.killpg``) from a small launcher at one precise moment instead of a
sleep that guesses it: an import hook, or a wrapper around one asyncio call. Every
run gets a TMPDIR of its own, so its private server's temp dir can be looked for.

1. A signal whose raise torch's import loses *while numpy's C extension initialises*
   (numpy's ``_multiarray_umath`` imports ``numpy.exceptions`` etc. from its module
   init) leaves numpy half-imported: torch's next ``import numpy`` fails with
   ``ImportError: cannot load module more than once per process`` (3.11) or
   ``RuntimeError: CPU dispatcher tracer already initlized`` (3.10). ``main`` treated
   that as a bug (its ``except Exception`` did not look at ``_received``): a traceback
   and exit 1. Hit by a plain time sweep too (SIGTERM 1.44 s after torch's import began).
2. A signal as asyncio.run's loop starts (before the command's coroutine runs) went out
   of ``asyncio.run`` with that coroutine never started: "coroutine ... was never
   awaited".
3. A SIGTERM as the loop closed, when the loop held the signals: its
   ``remove_signal_handler`` left SIG_DFL before ``_on_signal`` was put back, and the
   SIGTERM killed the process outright: no exit 143 and the private server's temp dir
   stayed behind.

Not here: a Ctrl-C in the first 0.3-0.6 s, while ``stream_reward.cli`` itself is being
imported, before ``main`` installs any handler, still ends in Python's own
KeyboardInterrupt traceback (exit -2); a SIGTERM there kills the process (-15).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

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
LAUNCH = r"""
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
        [sys.executable, "-c", LAUNCH, *trigger, *cli_args],
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


DEMO = ["demo", "--n", "200000", "--generation-s", "60", "--processes", "1"]


@pytest.mark.parametrize(("sig", "who"), [("SIGTERM", "proc"), ("SIGINT", "group")], ids=["sigterm", "ctrl-c"])
def test_signal_while_torch_imports_numpys_extension_is_not_a_traceback(tmp_path, sig, who):
    """The signal lands inside numpy's C extension init (its import of numpy.exceptions),
    inside torch._C's import of numpy, which drops the raise. Before the fix: exit 1 and
    'ImportError: cannot load module more than once per process' (3.11) or
    'RuntimeError: CPU dispatcher tracer already initlized' (3.10), with a traceback."""
    pytest.importorskip("torch")
    pytest.importorskip("numpy")
    # The first module numpy's extension init imports: numpy.exceptions (numpy 2), or
    # numpy.core._exceptions (numpy 1.24, the floor's).
    trigger = "numpy.exceptions,numpy.core._exceptions"
    code, took, stderr, left = run_cli(tmp_path, ["import", trigger, sig, who], DEMO)
    assert_clean_exit(code, took, stderr, left, sig, "demo")


SCORE_SLOW = ["--scorer", "python:tests/data/failwell_scorers.py:slow", "--processes", "1"]


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
    run. It raised there and left 'RuntimeWarning: coroutine 'read_status' was never
    awaited' (and '_bounded', 'cmd_collect.<locals>.run', 'run_demo',
    'LocalPipeline.guard') on stderr."""
    code, took, stderr, left = run_cli(tmp_path, ["loop-start", "-", sig, who], command)
    assert_clean_exit(code, took, stderr, left, sig, command[0])


def test_sigterm_as_the_loop_closes_exits_143_and_removes_the_temp_dir(tmp_path):
    """A demo that finished, its loop closing. When the loop held the signals,
    ``remove_signal_handler`` left SIG_DFL before _on_signal was put back: a SIGTERM then
    killed the process (returncode -15) and left the private server's stream-reward-* dir
    in TMPDIR."""
    code, took, stderr, left = run_cli(
        tmp_path, ["loop-close", "-", "SIGTERM", "proc"], ["demo", "--n", "200", "--processes", "1"]
    )
    assert_clean_exit(code, took, stderr, left, "SIGTERM", "demo")
