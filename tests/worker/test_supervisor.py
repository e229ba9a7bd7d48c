"""The worker pool (stream_reward.worker.supervisor): a child that is killed is started
again under its own name, so that it takes back what it held.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from helpers import wait_until

from stream_reward.wire.connection import connect
from stream_reward.wire.heartbeat import decode_heartbeat
from stream_reward.wire.keys import Keys

pytestmark = pytest.mark.anyio


async def test_the_supervisor_restarts_a_killed_child_under_its_name(redis_url, namespace, spawn_workers) -> None:
    """``worker --processes 2 --consumer sup``: children sup-0 and sup-1. A SIGKILLed child
    leaves its heartbeat; the restarted one must take its name after ~2 intervals, not exit 2."""
    c = connect(redis_url)
    key = Keys(namespace, 1).workers()
    (sup,) = spawn_workers(1, "--processes", "2", "--consumer", "sup")
    try:

        async def beat(name):
            raw = await c.hget(key, name)
            return decode_heartbeat(raw) if raw else None

        async def both():
            return await beat("sup-0") and await beat("sup-1")

        await wait_until(both, 10)
        old = (await beat("sup-0"))["pid"]
        os.kill(old, signal.SIGKILL)

        async def back():
            b = await beat("sup-0")
            return b and b["pid"] != old

        t0 = time.monotonic()
        await wait_until(back, 9)
        assert sup.poll() is None
        assert time.monotonic() - t0 < 8
    finally:
        await c.aclose()
