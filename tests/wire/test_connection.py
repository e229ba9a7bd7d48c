"""Connections (wire/connection.py): ``connect()``'s clients retry a command whose
connection was lost under it (short commands get a few quick retries inside redis-py),
and a server that stays away still fails the command within the retries.
"""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from stream_reward.ops.embedded import EmbeddedServer
from stream_reward.wire.connection import connect

pytestmark = pytest.mark.anyio


async def _blocked_on(admin, command: str) -> int:
    for _ in range(200):
        for c in await admin.client_list():
            if c.get("cmd") == command:
                return int(c["id"])
        await asyncio.sleep(0.01)
    raise AssertionError(f"no client blocked in {command}")


async def test_a_command_whose_connection_is_killed_mid_command_is_sent_again(namespace) -> None:
    # Its own server: it kills whichever client blocks in BLPOP.
    server = EmbeddedServer().start()
    client = connect(server.url)
    admin = connect(server.url)
    key = f"{namespace}:list"
    try:
        blocked = asyncio.ensure_future(client.blpop([key], timeout=5))
        victim = await _blocked_on(admin, "blpop")
        await admin.client_kill_filter(_id=victim)
        await _blocked_on(admin, "blpop")  # sent again, on a new connection
        await admin.rpush(key, "x")
        assert list(await asyncio.wait_for(blocked, 10)) == [key.encode(), b"x"]
    finally:
        await client.aclose()
        await admin.aclose()
        server.stop()


async def test_a_server_that_stays_away_still_fails_the_command_within_the_retries() -> None:
    client = connect("redis://127.0.0.1:1")
    try:
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(RedisConnectionError):
            await asyncio.wait_for(client.ping(), 30)
        assert loop.time() - start < 10
    finally:
        await client.aclose()
