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
