"""``worker --check``: healthy (exit 0) while a worker of the group (or the named consumer)
beat within three heartbeat intervals, the interval from the config; no heartbeat, only
old ones, or no Redis is exit 1 with the reason.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from helpers import worker_heartbeat

from stream_reward.cli import main
from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys

pytestmark = pytest.mark.usefixtures("clean_env", "restore_logging")


def test_worker_check_both_ways(redis_url: str, namespace: str, capsys: pytest.CaptureFixture[str]) -> None:
    keys = Keys(namespace)
    check = ["worker", "--check", "--redis", redis_url, "--namespace", namespace]

    async def beat(name: str, seen: float) -> None:
        client = connect(redis_url)
        await client.hset(keys.workers(), name, worker_heartbeat(name, seen))
        await client.aclose()

    assert main(check) == 1
    assert "no worker heartbeat" in capsys.readouterr().err

    asyncio.run(beat("old", time.time() - 7))  # older than 3 x 2 s
    assert main(check) == 1
    assert "no live worker" in capsys.readouterr().err

    asyncio.run(beat("fresh", time.time() - 1))
    assert main(check) == 0
    assert main([*check, "--consumer", "fresh"]) == 0
    assert main([*check, "--consumer", "old"]) == 1
    assert main([*check, "--group", "other-pool"]) == 1
    capsys.readouterr()

    # The interval comes from the config: with 5 s beats, 7 s old is still alive.
    os.environ["STREAM_REWARD_CONSUMER_HEARTBEAT_INTERVAL_S"] = "5"
    try:
        assert main([*check, "--consumer", "old"]) == 0
    finally:
        del os.environ["STREAM_REWARD_CONSUMER_HEARTBEAT_INTERVAL_S"]
    assert main(["worker", "--check", "--redis", "redis://127.0.0.1:1", "--namespace", namespace]) == 1


def _check_in_child(url: str, namespace: str, *, clock_shift_s: float = 0.0) -> tuple[int, str, float]:
    """``worker --check`` in its own process (its ``time.time`` shifted by ``clock_shift_s``):
    exit code, stderr, seconds it took."""
    import subprocess
    import sys

    code = (
        "import sys, time\n"
        f"real = time.time; time.time = lambda: real() + {clock_shift_s!r}\n"
        "from stream_reward.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", code, "worker", "--check", "--redis", url, "--namespace", namespace],
        capture_output=True,
        timeout=120,  # the old check: ~82 s through a black hole
    )
    return proc.returncode, proc.stderr.decode(errors="replace"), time.monotonic() - start


@pytest.mark.anyio
async def test_worker_check_through_a_black_hole_is_unhealthy_within_10s(redis_url: str, namespace: str) -> None:
    from helpers import CutProxy

    async with CutProxy(redis_url[len("unix://") :]) as proxy:
        proxy.black = True
        rc, err, took = await asyncio.to_thread(_check_in_child, proxy.url, namespace)
    assert rc == 1, err
    assert "cannot reach Redis at redis://127.0.0.1" in err and "no reply within 5s" in err, err
    assert took < 10, took


def test_worker_check_of_a_stopped_server_is_unhealthy_within_10s(namespace: str) -> None:
    import signal

    from stream_reward.ops.embedded import EmbeddedServer

    with EmbeddedServer() as server:  # its own server: the session's is never stopped
        assert server.pid is not None
        url = server.url
        os.kill(server.pid, signal.SIGSTOP)
        try:
            rc, err, took = _check_in_child(url, namespace)
        finally:
            os.kill(server.pid, signal.SIGCONT)
    assert rc == 1, err
    # A stopped server stalls the connect or the reply, whichever comes first: the cause
    # is named either way ("no reply within 5s", or the failed connection).
    assert f"cannot reach Redis at {url}" in err, err
    assert took < 10, took


@pytest.mark.parametrize("shift_s", [3600.0, -3600.0])
def test_worker_check_judges_heartbeats_on_the_server_clock(redis_url: str, namespace: str, shift_s: float) -> None:
    """A checker an hour off: a fresh heartbeat is alive, an old one is not."""
    keys = Keys(namespace)

    async def beat(name: str, age_s: float) -> None:
        client = connect(redis_url)
        seconds, micros = await client.time()
        await client.hset(keys.workers(), name, worker_heartbeat(name, seconds + micros / 1e6 - age_s))
        await client.aclose()

    asyncio.run(beat("fresh", 1.0))
    rc, err, _ = _check_in_child(redis_url, namespace, clock_shift_s=shift_s)
    assert rc == 0, err
    asyncio.run(beat("fresh", 60.0))
    rc, err, _ = _check_in_child(redis_url, namespace, clock_shift_s=shift_s)
    assert rc == 1 and "no live worker" in err, err
