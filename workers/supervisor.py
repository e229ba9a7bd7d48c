"""Runs N worker processes on one host and keeps them running.

A worker that dies is started again (its pending entries are reclaimed by its
peers meanwhile, so nothing waits on the restart). SIGTERM is passed on to every
worker, which drains and exits; a second SIGTERM kills them.
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import time
from types import FrameType

from stream_reward.ops.worker_cli import worker_argv

__all__ = ["supervise"]

log = logging.getLogger(__name__)

_RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)


def supervise(args: argparse.Namespace) -> int:
    n = args.processes
    children: dict[int, subprocess.Popen[bytes]] = {}
    restarts = [0] * n
    state = {"signals": 0}

    def spawn(slot: int) -> None:
        consumer = f"{args.consumer}-{slot}" if args.consumer else None
        children[slot] = subprocess.Popen(worker_argv(args, consumer=consumer, slot=slot))

    def on_signal(signum: int, frame: FrameType | None) -> None:
        state["signals"] += 1
        for child in children.values():
            if child.poll() is None:
                try:
                    child.send_signal(signal.SIGTERM if state["signals"] == 1 else signal.SIGKILL)
                except ProcessLookupError:
                    pass

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    for slot in range(n):
        spawn(slot)
    log.info("supervising %d worker processes", n)
    failed = False
    while children:
        time.sleep(0.2)
        for slot, child in list(children.items()):
            code = child.poll()
            if code is None:
                continue
            del children[slot]
            if state["signals"] or args.burst:
                failed |= code != 0 and not state["signals"]
                continue
            delay = _RESTART_BACKOFF_S[min(restarts[slot], len(_RESTART_BACKOFF_S) - 1)]
            restarts[slot] += 1
            log.warning("worker %d exited with %s; restarting in %.1fs", slot, code, delay)
            time.sleep(delay)
            spawn(slot)
    return 1 if failed or state["signals"] > 1 else 0
