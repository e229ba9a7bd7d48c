"""The reaper: what a SIGKILLed owner recorded (a process group, a dir) goes within a
second or two; an owner that cleaned up itself leaves the reaper nothing to do, and a
recorded pid that now names somebody else's process is left alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

from ops_support import _alive

from stream_reward.ops.reaper import Reaper

# The owner: a reaper, a child in a group of its own with a grandchild in it (a worker
# and its scorer child), a dir; it prints what it made and waits to be killed.
OWNER = """
import os, subprocess, sys, tempfile, time
from stream_reward.ops.reaper import Reaper
reaper = Reaper(grace_s=1.0)
child = subprocess.Popen(
    [sys.executable, "-c", "import subprocess, sys, time; "
     "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
     "print(g.pid, flush=True); time.sleep(600)"],
    stdout=subprocess.PIPE, text=True, start_new_session=True,
)
grandchild = int(child.stdout.readline())
path = tempfile.mkdtemp(prefix="reaper-test-")
reaper.group(child.pid)
reaper.directory(path)
print(reaper.pid, child.pid, grandchild, path, flush=True)
time.sleep(600)
"""


def wait_gone(pids: list[int], path: str, timeout_s: float = 10.0) -> float:
    start = time.monotonic()
    while any(_alive(pid) for pid in pids) or os.path.exists(path):
        assert time.monotonic() - start < timeout_s, [pid for pid in pids if _alive(pid)]
        time.sleep(0.02)
    return time.monotonic() - start


def test_a_sigkilled_owners_process_groups_and_dirs_go_with_it():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    reaper, child, grandchild, path = owner.stdout.readline().split()
    pids = [int(reaper), int(child), int(grandchild)]
    assert all(_alive(pid) for pid in pids) and os.path.isdir(path)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    owner.stdout.close()
    wait_gone(pids, path)


def test_an_owner_that_cleaned_up_closes_the_reaper_and_a_reused_pid_is_spared():
    path = tempfile.mkdtemp(prefix="reaper-test-")
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        reaper = Reaper(grace_s=1.0)
        # A pid whose recorded start time is not the running process's: the kernel gave
        # the pid to somebody else after the recorded process exited.
        reaper._send(f"group {bystander.pid} 1")
        reaper.directory(path)
        start = time.monotonic()
        reaper.close()
        assert time.monotonic() - start < 5.0
        assert not _alive(reaper.pid) and not os.path.exists(path)
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
