"""Signals whose raise Python loses must still stop the CLI.

A Ctrl-C or SIGTERM raises from wherever the main thread stands, and some places
drop what is raised there: torch's C extension, and the at-fork hooks subprocess
runs in the parent after each fork ("Exception ignored in: _releaseLock").

A Ctrl-C that landed while the demo imported torch was lost, and the demo ran on.

``cmd_demo`` imports torch in the main thread, before the event loop, so that a
Ctrl-C interrupts it at once. But torch's C extension (``torch._C``) imports
numpy from its module init and clears whatever that import raised: a
KeyboardInterrupt raised inside numpy's import (the Ctrl-C landing then) was
swallowed, ``import torch`` returned normally, and the demo went on to run its
whole generation (60 s here) as if no Ctrl-C had come (now the kept signal cancels it as the loop starts). On a loaded 2-core machine
torch's import takes 5-9 s, which is how a Ctrl-C 8-10 s after start hit it.

The test sends a real SIGINT to the demo's process group at that moment: from an
import hook, the first time numpy is imported before torch's C extension is
loaded (no sleep that guesses the moment).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import start_in_own_group

ROOT = Path(__file__).resolve().parent.parent


def run_to_end(proc: subprocess.Popen[bytes], timeout: float = 40) -> tuple[int | None, str]:
    """Its exit status and stderr; status None for a program still running at ``timeout``
    (the signal was lost), which is then killed."""
    try:
        _, err = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        code = None
        proc.kill()
        _, err = proc.communicate()
    return code, err.decode(errors="replace")


def said(stderr: str) -> list[str]:
    """The lines a program said on stderr, blank ones left out."""
    return [line for line in stderr.splitlines() if line.strip()]


# The CLI, with a terminal's Ctrl-C (SIGINT to the foreground group) sent the moment
# numpy's import starts inside the demo, before torch's C extension is loaded (today:
# from torch._C's own init). A marker file says the hook fired.
LAUNCH = r"""
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
    argv = [sys.executable, "-c", LAUNCH, str(mark), "demo", "--n", "200000", "--generation-s", "60"]
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
    # Before the fix: code None (still running at 30 s; left alone it finishes the 60 s demo and exits 0).
    assert code == 130, (code, round(took, 1), mark.read_text(), stderr[-2000:])
    lines = said(stderr)
    assert lines == ["stream-reward demo: interrupted"], stderr


# The same for SIGTERM, sent from an at-fork hook in the parent: the first fork after
# `score` starts (its private server's or a worker's spawn). Python reports what the hook
# raised as "Exception ignored" and goes on; CI's py310 job hit this by chance, when a
# SIGTERM to `score` came as it started its worker, and `score` ran its sample to the end.
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
    scorer = "python:tests/data/failwell_scorers.py:slow"
    argv = [sys.executable, "-c", LAUNCH_FORK, "score", str(src), "--scorer", scorer, "--processes", "1"]
    proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    code, stderr = run_to_end(proc)
    assert code == 143, (code, stderr[-2000:])
    assert "Traceback" not in stderr, stderr


# A Ctrl-C whose KeyboardInterrupt leaves code run by exec() or eval() of source text:
# dataclasses' and namedtuple's generated methods, and parts of torch's import, run that
# way. Python then marks the KeyboardInterrupt unhandled for good. Run as
# `python -m stream_reward.cli`, once main() had caught it, printed "interrupted" and
# returned 130, the interpreter killed itself with SIGINT at exit: status -2. (The
# `stream-reward` script exits through sys.exit's own path and was spared.) CI's default
# job hit it with the 6 s Ctrl-C of a large demo; so did 2 of the first 4 Ctrl-Cs sent at
# random moments of a demo's start. Here `status`'s command is replaced by one that runs
# its work through exec(), the Ctrl-C sent from inside it, and the CLI is run with -m.
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
    # Before the fix: -2, after the one line below.
    assert code == 130, (code, stderr[-2000:])
    lines = said(stderr)
    assert lines == ["stream-reward status: interrupted"], stderr


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
    # Before the fix: -2 and a traceback through the imports.
    assert code == code_and_line[0], (code, stderr[-2000:])
    lines = said(stderr)
    assert lines == ([code_and_line[1]] if code_and_line[1] else []), stderr


# helper-30's find: a Ctrl-C can be dropped, not raised. After each import, importlib runs
# a weakref callback in Python (`_get_module_lock.<locals>.cb`); a KeyboardInterrupt
# raised in it is "Exception ignored" and gone. Before main() installed its handler,
# nothing kept that Ctrl-C: a demo Ctrl-C'd 0.44 s after its start ran on to its end.
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
    # Before the fix: 2, "Exception ignored in: <function _get_module_lock.<locals>.cb", then
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
        # Before: the kept Ctrl-C stopped it as it started (exit 0, not a line said).
        assert "retrying" in "".join(seen) and proc.poll() is None, (proc.poll(), seen)
    finally:
        guard.cancel()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
