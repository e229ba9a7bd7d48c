"""``early_signals``: SIGINT and SIGTERM from a program's first instant, kept until it can act.

``keep()`` (called by ``stream-reward``, ``python -m stream_reward.cli`` and the worker
program before their imports) makes the two signals wait; ``release()`` gives back those
that came, first first, and puts back the handlers from before where nothing replaced
``keep``'s. A signal started ignored (``nohup``, a shell's ``&``) stays ignored. A Ctrl-C in
a program's first quarter second, while it imports (the redis client alone takes 0.14 s),
is then the command's one line, not Python's KeyboardInterrupt traceback (status -2), and a
SIGTERM there is the command's stop, not a death by signal.

The process tests send a real signal from an import hook that a ``sitecustomize`` installs
at Python's start: the moment the program looks up a given module.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import run_to_end, said, start_in_own_group

from stream_reward.ops import early_signals

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def signals_restored():
    """The test process's SIGINT and SIGTERM handlers, as they were, after the test."""
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield before
    early_signals.release()
    for signum, handler in before.items():
        signal.signal(signum, handler)


# ---------------------------------------------------------------------- keep and release
def test_kept_signals_are_given_back_first_first_and_the_handlers_before_return(signals_restored):
    early_signals.keep()
    assert not early_signals.pending()
    signal.raise_signal(signal.SIGTERM)
    signal.raise_signal(signal.SIGINT)
    assert early_signals.pending()
    assert early_signals.release() == [signal.SIGTERM, signal.SIGINT]
    assert {signum: signal.getsignal(signum) for signum in signals_restored} == signals_restored
    assert not early_signals.pending() and early_signals.release() == []


def test_a_handler_installed_while_kept_stays_and_an_ignored_signal_stays_ignored(signals_restored):
    def mine(signum: int, frame: object) -> None:
        pass

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    early_signals.keep()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    signal.signal(signal.SIGTERM, mine)
    assert early_signals.release() == []
    assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGINT) is signal.SIG_IGN


# ---------------------------------------------------------------------- a signal while a program imports
# A Ctrl-C in a program's first quarter second, while it imports what it needs (the redis
# client alone takes 0.14 s): it came out as a KeyboardInterrupt traceback and status -2,
# 9 of 30 Ctrl-Cs sent 0.25-0.8 s after a demo's start. Sent here the moment the CLI starts
# importing redis, from an import hook that `sitecustomize` installs at Python's start,
# in both ways the CLI is run: the installed `stream-reward` script and `python -m`.
SITECUSTOMIZE = """
import os, signal, sys

MARK = os.environ["CTRL_C_MARK"]

class CtrlCWhileTheCliImportsRedis:
    fired = False

    def find_spec(self, name, path=None, target=None):
        if not CtrlCWhileTheCliImportsRedis.fired and name == "redis":
            CtrlCWhileTheCliImportsRedis.fired = True
            open(MARK, "w").close()
            os.killpg(os.getpgid(0), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlCWhileTheCliImportsRedis())
"""


@pytest.mark.parametrize(
    "how, command, code_and_line",
    [
        ("script", "status", (130, "stream-reward status: interrupted")),
        ("module", "status", (130, "stream-reward status: interrupted")),
        # A worker stops as from a drain with nothing in flight: 0, and nothing to say.
        ("script", "worker", (0, None)),
        # The worker program itself, which `stream-reward worker` becomes (exec).
        ("workers", "", (0, None)),
    ],
)
def test_ctrl_c_while_the_cli_imports_is_one_line(tmp_path, how, command, code_and_line):
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    mark = tmp_path / "fired"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), "CTRL_C_MARK": str(mark)}
    script = Path(sys.executable).with_name("stream-reward")
    assert script.exists(), f"the install has no {script}"
    program = {
        "script": [str(script), command],
        "module": [sys.executable, "-m", "stream_reward.cli", command],
        "workers": [sys.executable, "-m", "workers"],
    }[how]
    proc = start_in_own_group([*program, "--redis", f"unix://{tmp_path}/nothing.sock"], env=env)
    code, stderr = run_to_end(proc)
    assert mark.exists(), f"the Ctrl-C was never sent (no import of redis?): {stderr}"
    # Unkept: -2 and a traceback through the imports.
    assert code == code_and_line[0], (code, stderr[-2000:])
    lines = said(stderr)
    assert lines == ([code_and_line[1]] if code_and_line[1] else []), stderr


# A Ctrl-C can be dropped, not raised. After each import, importlib runs
# a weakref callback in Python (`_get_module_lock.<locals>.cb`); a KeyboardInterrupt
# raised in it is "Exception ignored" and gone. Unless kept until main() installs its
# handler, that Ctrl-C is lost: a demo Ctrl-C'd 0.44 s after its start ran on to its end.
# Here the import lock of one module gets a second weakref whose callback is C (libc's
# killpg through ctypes) and runs first, so the SIGINT is pending as importlib's own
# callback starts: `stream_reward.cli`'s own lock for the script (it imports the module),
# redis's for `python -m` (it runs the module as __main__, without a lock). A dropped
# Ctrl-C lets `status` go on to its "Redis unreachable" line and exit 2.
SITECUSTOMIZE_LOCK = """
import ctypes, functools, os, signal, sys, weakref
import importlib._bootstrap as bootstrap

MARK = os.environ["CTRL_C_MARK"]
TARGET = os.environ["CTRL_C_LOCK"]
killpg = ctypes.CDLL(None, use_errno=True).killpg
killpg.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.py_object]  # the third: the weakref, ignored
ctrl_c = functools.partial(killpg, 0, int(signal.SIGINT))  # C all the way: no bytecode runs in it
armed = []

class CtrlCAsTheImportLockGoes:
    def find_spec(self, name, path=None, target=None):
        if name == TARGET and not armed:
            ref = bootstrap._module_locks.get(name)
            lock = ref() if ref is not None else None
            if lock is not None:
                armed.append(weakref.ref(lock, ctrl_c))
                del lock
                open(MARK, "w").close()
        return None

sys.meta_path.insert(0, CtrlCAsTheImportLockGoes())
"""


@pytest.mark.parametrize("how, lock", [("script", "stream_reward.cli"), ("module", "redis")])
def test_a_ctrl_c_dropped_in_an_import_lock_callback_is_kept(tmp_path, how, lock):
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE_LOCK)
    mark = tmp_path / "armed"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    env |= {"CTRL_C_MARK": str(mark), "CTRL_C_LOCK": lock}
    program = {
        "script": [str(Path(sys.executable).with_name("stream-reward"))],
        "module": [sys.executable, "-m", "stream_reward.cli"],
    }[how]
    proc = start_in_own_group([*program, "status", "--redis", f"unix://{tmp_path}/nothing.sock"], env=env)
    code, stderr = run_to_end(proc)
    assert mark.exists(), f"the Ctrl-C was never armed (no import lock for {lock}?): {stderr}"
    # A dropped Ctrl-C: 2, "Exception ignored in: <function _get_module_lock.<locals>.cb", then
    # status's "Redis unreachable" line.
    assert code == 130, (code, stderr[-2000:])
    lines = said(stderr)
    assert lines == ["stream-reward status: interrupted"], stderr


def test_a_worker_started_with_ctrl_c_ignored_still_ignores_it_while_it_imports(tmp_path):
    """`nohup` or a shell's `&` starts a program with SIGINT ignored; keeping signals
    through the imports must not make a Ctrl-C count there."""
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    mark = tmp_path / "fired"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), "CTRL_C_MARK": str(mark)}
    argv = [sys.executable, "-m", "workers", "--redis", f"unix://{tmp_path}/nothing.sock"]
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    guard = threading.Timer(60, proc.kill)  # a worker that never says "retrying" ends the read
    guard.start()
    try:
        assert proc.stderr is not None
        seen = []
        for raw in proc.stderr:  # running on, past its imports: it retries the absent server
            seen.append(raw.decode(errors="replace"))
            if "retrying" in seen[-1]:
                break
        assert mark.exists(), "".join(seen)
        # Kept although ignored, the Ctrl-C would stop it as it starts (exit 0, not a line said).
        assert "retrying" in "".join(seen) and proc.poll() is None, (proc.poll(), seen)
    finally:
        guard.cancel()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
