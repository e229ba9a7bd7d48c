"""Runs N worker processes on one host and keeps them running.

A worker that dies is started again (its pending entries are reclaimed by its
peers meanwhile, so nothing waits on the restart), except one that fails at
start-up with a permanent error (exit code 2: an unloadable scorer, a wrong
password, a bad setting): starting it again cannot help, so the supervisor stops
the others and exits 2 itself.

Each worker runs in its own process group, so a Ctrl-C at the terminal or a
``kill -TERM -- -PGID`` (systemd's default) reaches the supervisor only, which
passes one SIGTERM to every worker: one stop is one drain. A second signal kills
them. No worker is started once a stop has begun.
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import time
from types import FrameType

from stream_reward.ops import early_signals
from stream_reward.ops.embedded import own_group_and_die_with_parent
from stream_reward.ops.worker_cli import worker_argv

__all__ = ["supervise"]

log = logging.getLogger(__name__)

_RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)
# The exit code a worker gives for a permanent error (see stream_reward.worker.main).
_PERMANENT_EXIT = 2
# A worker that exits within this long of its start failed at start-up.
_STARTUP_S = 10.0
_POLL_S = 0.1


def supervise(args: argparse.Namespace) -> int:
    n = args.processes
    children: dict[int, subprocess.Popen[bytes]] = {}
    started_at: dict[int, float] = {}
    restarts = [0] * n
    due: dict[int, float] = {}  # slot -> monotonic time of its restart
    state = {"signals": 0}

    def spawn(slot: int) -> None:
        consumer = f"{args.consumer}-{slot}" if args.consumer else None
        children[slot] = child = subprocess.Popen(
            worker_argv(args, consumer=consumer, slot=slot), preexec_fn=own_group_and_die_with_parent
        )
        started_at[slot] = time.monotonic()
        if state["signals"]:
            # A stop that came while Popen ran signalled the children it knew, not this
            # one: left alone, it ran on and the supervisor waited for it for ever.
            child.send_signal(signal.SIGTERM if state["signals"] == 1 else signal.SIGKILL)

    def signal_children(sig: int) -> None:
        for child in children.values():
            if child.poll() is None:
                try:
                    child.send_signal(sig)
                except ProcessLookupError:
                    pass

    def on_signal(signum: int, frame: FrameType | None) -> None:
        state["signals"] += 1
        due.clear()  # no restart once a stop has begun
        signal_children(signal.SIGTERM if state["signals"] == 1 else signal.SIGKILL)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    for signum in early_signals.release():  # kept since the worker program started
        on_signal(signum, None)
    for slot in range(n):
        if state["signals"]:
            break
        spawn(slot)
    log.info("supervising %d worker processes", n)
    failed = False
    permanent: int | None = None
    while children or due:
        time.sleep(_POLL_S)
        now = time.monotonic()
        for slot, child in list(children.items()):
            code = child.poll()
            if code is None:
                continue
            del children[slot]
            if state["signals"] or args.burst or permanent is not None:
                failed |= code != 0 and not state["signals"]
                continue
            if code == _PERMANENT_EXIT and now - started_at[slot] < _STARTUP_S:
                # Starting it again cannot help: stop the others and say so once.
                log.error("worker %d failed at start-up with a permanent error (exit 2); stopping", slot)
                permanent = code
                due.clear()
                signal_children(signal.SIGTERM)
                continue
            delay = _RESTART_BACKOFF_S[min(restarts[slot], len(_RESTART_BACKOFF_S) - 1)]
            restarts[slot] += 1
            log.warning("worker %d exited with %s; restarting in %.1fs", slot, code, delay)
            due[slot] = now + delay
        for slot, when in list(due.items()):
            if now >= when and not state["signals"] and permanent is None:
                del due[slot]
                spawn(slot)
    if permanent is not None:
        return permanent
    return 1 if failed or state["signals"] > 1 else 0
