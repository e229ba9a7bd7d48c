"""``import_torch`` holds SIGINT and SIGTERM through torch's first import.

torch's C extension calls Python code from C++ while it imports. A signal handler that
raises there (Python's own Ctrl-C, the CLI's SIGTERM) comes back into C++ as an
exception nothing catches: ``terminate called after throwing an instance of
'python_error'`` and an abort (exit -6). The signal is sent here from inside
``torch._C._c10d_init``: at the first Python call it makes, found with a profile hook
(no sleep that guesses the moment).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# argv: <SIGTERM|SIGINT>. The handler in place is the CLI's way for SIGTERM (raise
# SystemExit(143)) and Python's own for Ctrl-C (KeyboardInterrupt).
LAUNCH = r"""
import os, signal, sys

SIG = getattr(signal, sys.argv[1])
fired = []
c_calls = []


def profile(frame, event, arg):
    if event == "c_call":
        c_calls.append(arg)
    elif event in ("c_return", "c_exception"):
        if c_calls:
            c_calls.pop()
    elif event == "call" and c_calls and not fired:
        caller = c_calls[-1]
        if getattr(caller, "__module__", None) == "torch._C" and getattr(caller, "__name__", None) == "_c10d_init":
            fired.append(True)
            sys.setprofile(None)
            os.kill(os.getpid(), SIG)


def on_sigterm(signum, frame):
    print("handled with torch", "imported" if hasattr(sys.modules.get("torch"), "zeros") else "half imported")
    raise SystemExit(143)


signal.signal(signal.SIGTERM, on_sigterm)
from stream_reward.trainer.tensors import import_torch

sys.setprofile(profile)
try:
    import_torch()
except KeyboardInterrupt:
    print("interrupted with torch", "imported" if hasattr(sys.modules.get("torch"), "zeros") else "half imported")
    sys.exit(130)
finally:
    sys.setprofile(None)
    print("fired" if fired else "never fired")
"""


@pytest.mark.parametrize(("sig", "code", "said"), [("SIGTERM", 143, "handled"), ("SIGINT", 130, "interrupted")])
def test_a_signal_inside_torchs_import_reaches_its_handler_once_torch_is_imported(sig, code, said):
    pytest.importorskip("torch")
    proc = subprocess.run(
        [sys.executable, "-c", LAUNCH, sig],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert "terminate called" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:2] == [f"{said} with torch imported", "fired"], (proc.stdout, proc.stderr[-3000:])
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])


def test_torch_imported_from_another_thread_leaves_the_signals_alone():
    """Handlers can be set in the main thread only; from another, the import just runs."""
    pytest.importorskip("torch")
    code = (
        "import signal, threading\n"
        "from stream_reward.trainer.tensors import import_torch\n"
        "before = signal.getsignal(signal.SIGINT)\n"
        "t = threading.Thread(target=import_torch); t.start(); t.join()\n"
        "import sys; assert 'torch' in sys.modules and signal.getsignal(signal.SIGINT) is before\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
