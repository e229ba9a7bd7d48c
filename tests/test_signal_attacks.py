"""Signals at the moments the CLI's "SIGTERM/Ctrl-C at any moment" promise misses.

Each test runs the real CLI in a process group of its own, with a real signal sent
(``os.kill``/``os.killpg``) from a small launcher at one precise moment instead of a
sleep that guesses it: an import hook, or a wrapper around one asyncio call. Every
run gets a TMPDIR of its own, so its private server's temp dir can be looked for.

1. A signal whose raise torch's import loses *while numpy's C extension initialises*
   (numpy's ``_multiarray_umath`` imports ``numpy.exceptions`` etc. from its module
   init) leaves numpy half-imported: torch's next ``import numpy`` fails with
   ``ImportError: cannot load module more than once per process`` (3.11) or
   ``RuntimeError: CPU dispatcher tracer already initlized`` (3.10). ``main`` treats
   that as a bug (``except Exception`` never looks at ``_received``): a traceback and
   exit 1. Hit by a plain time sweep too (SIGTERM 1.44 s after torch's import began).
2. A Ctrl-C while ``stream_reward.cli`` is still being imported (0.3-0.6 s of every
   start; ``main`` installs its handlers only after): Python's own KeyboardInterrupt
   traceback.
3. A signal that lands in ``_run_async`` before the loop's handlers are in place
   (asyncio.run's setup, the first step of its main task) goes out of ``asyncio.run``
   with the command's coroutine never started: "coroutine ... was never awaited".
4. A SIGTERM in ``_run_async``'s ``finally`` between ``loop.remove_signal_handler``
   (which leaves SIG_DFL) and ``signal.signal(SIGTERM, _on_signal)`` kills the
   process outright: no exit 143 and the private server's temp dir stays behind.
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

NOISE = ("Traceback", "Exception ignored", "never retrieved", "never awaited", "Fatal Python", "was destroyed")

# argv: <trigger kind> <trigger arg> <SIGTERM|SIGINT> <proc|group> <cli args...>
#   import <module>: the first time <module> is looked up while the pipeline module is
#                    loaded and torch's C extension is not (torch's import under way)
#   cli-import <module>: the first time <module> is looked up (the CLI's own import)
#   add_signal_handler -: just before the event loop's first signal handler is added
#   remove_signal_handler -: just after the loop's SIGTERM handler is removed
LAUNCH = r"""
import os, signal, sys

KIND, ARG, SIG, WHO = sys.argv[1:5]
del sys.argv[1:5]
SIG = getattr(signal, SIG)


def fire():
    if WHO == "group":
        os.killpg(os.getpgid(0), SIG)
    else:
        os.kill(os.getpid(), SIG)


state = {"fired": False}


class Hook:
    def find_spec(self, name, path=None, target=None):
        if state["fired"] or name != ARG:
            return None
        if KIND == "import" and ("stream_reward.ops.pipeline" not in sys.modules or "torch._C" in sys.modules):
            return None
        if KIND in ("import", "cli-import"):
            state["fired"] = True
            fire()
        return None


sys.meta_path.insert(0, Hook())

if KIND in ("add_signal_handler", "remove_signal_handler"):
    import asyncio.unix_events as ue

    original = getattr(ue._UnixSelectorEventLoop, KIND)

    def patched(self, sig, *args):
        if KIND == "add_signal_handler" and not state["fired"]:
            state["fired"] = True
            fire()
        result = original(self, sig, *args)
        if KIND == "remove_signal_handler" and sig == signal.SIGTERM and not state["fired"]:
            state["fired"] = True
            fire()
        return result

    setattr(ue._UnixSelectorEventLoop, KIND, patched)

from stream_reward.cli import main

sys.exit(main(sys.argv[1:]))
"""


def run_cli(tmp_path: Path, trigger: list[str], cli_args: list[str], limit_s: float = 30) -> tuple:
    """(exit code or None, seconds, stderr, temp dirs left in the run's TMPDIR)."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
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
    inside torch._C's import of numpy, which drops the raise. Today: exit 1 and
    'ImportError: cannot load module more than once per process' (3.11) or
    'RuntimeError: CPU dispatcher tracer already initlized' (3.10), with a traceback."""
    pytest.importorskip("torch")
    pytest.importorskip("numpy")
    code, took, stderr, left = run_cli(tmp_path, ["import", "numpy.exceptions", sig, who], DEMO)
    assert_clean_exit(code, took, stderr, left, sig, "demo")


def test_ctrl_c_while_the_cli_itself_imports_is_one_line(tmp_path):
    """Ctrl-C while ``from stream_reward.cli import main`` (the console script's first
    line) imports redis: 0.3-0.6 s of every start. Today: Python's KeyboardInterrupt
    traceback, exit -2."""
    code, took, stderr, left = run_cli(tmp_path, ["cli-import", "redis", "SIGINT", "group"], DEMO)
    assert_clean_exit(code, took, stderr, left, "SIGINT", "demo")


@pytest.mark.parametrize(
    ("sig", "who", "command"),
    [
        ("SIGTERM", "proc", ["status", "--redis", "unix:///nonexistent"]),
        ("SIGINT", "group", ["collect", "--redis", "unix:///nonexistent", "--batch", "b", "--timeout-s", "30"]),
        ("SIGTERM", "proc", DEMO),
    ],
    ids=["status-sigterm", "collect-ctrl-c", "demo-sigterm"],
)
def test_signal_before_the_loop_takes_the_signals_leaves_no_unawaited_coroutine(tmp_path, sig, who, command):
    """The signal lands in _run_async before loop.add_signal_handler has run. Today:
    'RuntimeWarning: coroutine 'read_status' was never awaited' (and '_bounded',
    'cmd_collect.<locals>.run', 'run_demo', 'LocalPipeline.guard') on stderr."""
    code, took, stderr, left = run_cli(tmp_path, ["add_signal_handler", "-", sig, who], command)
    assert_clean_exit(code, took, stderr, left, sig, command[0])


def test_sigterm_as_the_loop_gives_the_signals_back_exits_143_and_removes_the_temp_dir(tmp_path):
    """A demo that finished: _run_async's finally removes the loop's SIGTERM handler
    (SIG_DFL) before putting _on_signal back. Today: killed by the SIGTERM itself
    (returncode -15), the private server's stream-reward-* dir left in TMPDIR."""
    code, took, stderr, left = run_cli(
        tmp_path, ["remove_signal_handler", "-", "SIGTERM", "proc"], ["demo", "--n", "200", "--processes", "1"]
    )
    assert_clean_exit(code, took, stderr, left, "SIGTERM", "demo")
