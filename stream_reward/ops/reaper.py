"""Cleans up after a process that may die without running its own cleanup.

A process SIGKILLed, or ended by its host going down (a Ray actor when ``ray.shutdown()``
stops the node), runs no ``finally``, no atexit: its children get SIGTERM from
PR_SET_PDEATHSIG, but their process groups (a worker's scorer children) and its temp
dirs stay. A ``Reaper`` is a tiny process of its own session that the owner tells, over
a pipe, what to clean up. The pipe's write end lives only in the owner: when the owner
dies, however it dies, the reaper reads EOF and terminates every recorded process group
(SIGTERM, then SIGKILL after ``grace_s``) and removes every recorded dir. An owner that
cleaned up itself closes the pipe the same way; the reaper then finds nothing left.

A recorded process is identified by its pid and its start time, so a pid the kernel
reused for somebody else's process is left alone. Linux only (``/proc``), as
PR_SET_PDEATHSIG is.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys

__all__ = ["Reaper", "start_time"]

# Runs in a bare interpreter (-I -S): stdlib only, starts in ~20 ms.
_CODE = r"""
import os, shutil, signal, sys, time

signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
grace_s = float(sys.argv[1])

def started(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None

groups, dirs = [], []
for line in sys.stdin:
    kind, _, rest = line.rstrip("\n").partition(" ")
    if kind == "group":
        pid, start = rest.split(" ", 1)
        groups.append((int(pid), start))
    elif kind == "dir":
        dirs.append(rest)

def alive(pid, start):
    return started(pid) == start

def signal_group(pid, start, sig):
    if alive(pid, start):
        try:
            os.killpg(pid, sig)  # the process and what it started in its group
        except OSError:
            try:
                os.kill(pid, sig)  # not a group leader
            except OSError:
                pass

for pid, start in groups:
    signal_group(pid, start, signal.SIGTERM)
end = time.monotonic() + grace_s
while time.monotonic() < end and any(alive(p, s) for p, s in groups):
    time.sleep(0.02)
for pid, start in groups:
    signal_group(pid, start, signal.SIGKILL)
for path in dirs:
    shutil.rmtree(path, ignore_errors=True)
"""


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class Reaper:
    """``reaper = Reaper(); reaper.group(proc.pid); reaper.directory(path); ...; reaper.close()``."""

    def __init__(self, grace_s: float = 2.0) -> None:
        # A session of its own: a signal to the owner's process group (a Ctrl-C, Ray
        # stopping its workers) does not reach the one process meant to outlive them.
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _CODE, str(grace_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        assert self._proc.stdin is not None
        self._pipe = self._proc.stdin

    @property
    def pid(self) -> int:
        return self._proc.pid

    def group(self, pid: int) -> None:
        """Terminate the process group led by ``pid`` (or the process) if the owner dies first."""
        start = start_time(pid)
        if start is not None:
            self._send(f"group {pid} {start}")

    def directory(self, path: str) -> None:
        """Remove ``path`` once the owner is gone."""
        self._send(f"dir {path}")

    def _send(self, line: str) -> None:
        with contextlib.suppress(OSError, ValueError):  # a reaper gone already: nothing to record
            self._pipe.write(line.encode() + b"\n")
            self._pipe.flush()

    def close(self, timeout_s: float = 5.0) -> None:
        """The owner cleaned up itself: let the reaper check and exit."""
        with contextlib.suppress(OSError, ValueError):
            self._pipe.close()
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
