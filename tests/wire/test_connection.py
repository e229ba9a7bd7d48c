"""Connections (wire/connection.py): ``connect()``'s clients retry a command whose
connection was lost under it (short commands get a few quick retries inside redis-py),
and a server that stays away still fails the command within the retries. An outage is a
few log lines, not one per retry of every caller, and a wrong password is permanent at
once, not retried as an outage.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from helpers import read_err, timed_wait, wait_until, worker_program_argv
from redis.exceptions import BusyLoadingError, OutOfMemoryError, ReadOnlyError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from stream_reward.errors import BrokerError, RedisUnavailableError
from stream_reward.ops.embedded import EmbeddedServer
from stream_reward.wire.connection import connect, fault_text, is_refusal, with_reconnect
from stream_reward.wire.keys import Keys

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


ROOT = Path(__file__).resolve().parents[2]


async def test_redis_outage_logs_a_few_lines_not_a_flood(namespace):
    with EmbeddedServer() as server:
        proc = subprocess.Popen(
            worker_program_argv(server.url, namespace, "--drain-timeout-s", "1"), cwd=ROOT, stderr=subprocess.PIPE
        )
        try:
            # Joined: its heartbeat is in. A fixed 2.5 s raced the worker's start on a loaded
            # machine; started after the kill, it gave up at start-up (exit 2) and the
            # test passed without a running worker ever seeing the outage.
            client = connect(server.url)
            try:
                await wait_until(lambda: client.hlen(Keys(namespace).workers()), timeout_s=30)
            finally:
                await client.aclose()
            server.kill()
            await asyncio.sleep(5)
            proc.send_signal(signal.SIGTERM)
            timed_wait(proc, 20)
        finally:
            if proc.poll() is None:
                proc.kill()
        stderr = read_err(proc)
    lines = [line for line in stderr.splitlines() if "WARNING" in line]
    assert len(lines) <= 6, stderr  # was one every 200 ms: ~25 in 5 s


async def test_many_callers_retrying_through_one_outage_log_one_warning(caplog):
    """The quota check of every in-flight sample retried on its own: one warning each, every ~30 ms."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from stream_reward.errors import BrokerError
    from stream_reward.wire.connection import with_reconnect

    async def refused() -> None:
        raise RedisConnectionError("Connection refused")

    async def one() -> None:
        with pytest.raises(BrokerError):
            await with_reconnect(refused, what="quota check (test)", give_up_after_s=1.0)

    with caplog.at_level("WARNING", logger="stream_reward.wire.connection"):
        await asyncio.gather(*(one() for _ in range(50)))
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) <= 2, len(caplog.records)


async def test_wrong_password_is_permanent_in_with_reconnect(namespace):
    from stream_reward.errors import BrokerError
    from stream_reward.wire.connection import with_reconnect

    with EmbeddedServer(extra_args=["--requirepass", "pw"]) as server:
        client = connect(f"unix://:wrong@{server.socket_path}")
        try:
            started = time.monotonic()
            with pytest.raises(BrokerError, match="authentication"):
                await with_reconnect(lambda: client.ping(), what="ping", give_up_after_s=None)
            assert time.monotonic() - started < 3
        finally:
            await client.aclose()


async def test_a_black_holed_command_times_out_instead_of_hanging(redis_url):
    """A server that stops answering: each round trip ends after timeout_s, not never."""
    from helpers import CutProxy
    from redis.exceptions import TimeoutError as RedisTimeoutError

    from stream_reward.wire.connection import connect

    async with CutProxy(redis_url[len("unix://") :]) as proxy:
        client = connect(proxy.url, timeout_s=0.5)
        try:
            await client.ping()
            proxy.black = True
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(RedisTimeoutError):
                await asyncio.wait_for(client.set(b"k", b"v"), 30)  # the old client: TimeoutError here after 30s
            assert loop.time() - start < 10  # one timeout, not redis-py's retries of it
        finally:
            await client.aclose()


async def test_a_stopped_server_costs_one_timeout_on_connect_not_one_per_retry(namespace):
    """A server that accepts the connection and never answers its first command: redis-py
    8.1 wraps that reply's timeout in a ConnectionError, which its retries sent again."""
    from redis.exceptions import TimeoutError as RedisTimeoutError

    with EmbeddedServer() as server:  # its own server: the session's is never stopped
        client = connect(server.url, timeout_s=1.0)
        assert server.pid is not None
        os.kill(server.pid, signal.SIGSTOP)
        try:
            loop = asyncio.get_running_loop()
            start = loop.time()
            # redis-py 6.2 raises the connect's timeout as a ConnectionError (outside its
            # retry); later releases as the TimeoutError it is. Either way: one timeout.
            with pytest.raises((RedisTimeoutError, RedisConnectionError)):
                await asyncio.wait_for(client.time(), 30)
            assert loop.time() - start < 3.0  # one timeout; four with the retries
        finally:
            os.kill(server.pid, signal.SIGCONT)
            await client.aclose()


async def test_a_connect_whose_reply_timed_out_is_not_retried():
    """Whatever redis-py release wraps the timeout: the retry gives up at once."""
    from redis.exceptions import TimeoutError as RedisTimeoutError

    client = connect("redis://127.0.0.1:1")
    calls: list[int] = []

    async def stalled() -> None:
        calls.append(1)
        try:
            raise RedisTimeoutError("Timeout reading from 127.0.0.1:1")
        except RedisTimeoutError as exc:
            raise RedisConnectionError(exc) from exc

    async def fail(_error: Exception) -> None:
        return None

    try:
        with pytest.raises(RedisTimeoutError):
            await client.get_retry().call_with_retry(stalled, fail)
        assert calls == [1]
    finally:
        await client.aclose()


async def test_the_process_default_timeout_reaches_every_client_connect_builds(redis_url):
    """What the CLI and the worker program set from ``connection.timeout_s``: a client
    built without a ``timeout_s`` of its own takes it (the lane included)."""
    from helpers import CutProxy
    from redis.exceptions import TimeoutError as RedisTimeoutError

    from stream_reward.wire.connection import DEFAULT_TIMEOUT_S, set_default_timeout
    from stream_reward.wire.entries import read_streams
    from stream_reward.wire.lane import Lane

    async with CutProxy(redis_url[len("unix://") :]) as proxy:
        set_default_timeout(0.5)
        client = connect(proxy.url)
        lane = Lane.for_client(client)
        assert lane is not None
        set_default_timeout(DEFAULT_TIMEOUT_S)
        try:
            await client.ping()
            proxy.black = True
            loop = asyncio.get_running_loop()
            for call in (client.set(b"k", b"v"), read_streams(client, {"s": "0"}, count=1, block=None, lane=lane)):
                start = loop.time()
                with pytest.raises(RedisTimeoutError):
                    await asyncio.wait_for(call, 30)
                assert loop.time() - start < 3.0  # 0.5 s; the default is 5 s
        finally:
            set_default_timeout(DEFAULT_TIMEOUT_S)
            lane.close()
            await client.aclose()


async def test_a_black_holed_lane_call_times_out_instead_of_hanging(redis_url):
    """The lane (the hot path's own connection) has the same deadline per call."""
    from helpers import CutProxy
    from redis.exceptions import TimeoutError as RedisTimeoutError

    from stream_reward.wire.connection import connect
    from stream_reward.wire.lane import Lane
    from stream_reward.wire.packed import pack_command

    async with CutProxy(redis_url[len("unix://") :]) as proxy:
        client = connect(proxy.url, timeout_s=0.5)
        lane = Lane.for_client(client)
        assert lane is not None
        try:
            assert await lane.call([pack_command("PING")]) == [b"PONG"]
            proxy.black = True
            with pytest.raises(RedisTimeoutError):
                await asyncio.wait_for(lane.call([pack_command("PING")]), 30)
            proxy.black = False
            assert await lane.call([pack_command("PING")]) == [b"PONG"]  # connects again
        finally:
            lane.close()
            await client.aclose()


@pytest.mark.parametrize("on_lane", [False, True])
async def test_a_blocking_read_is_not_cut_by_the_reply_timeout(redis_url, namespace, on_lane):
    """XREAD BLOCK longer than timeout_s waits out its BLOCK: the deadline is BLOCK + timeout_s."""
    from stream_reward.wire.connection import connect
    from stream_reward.wire.entries import read_streams
    from stream_reward.wire.lane import Lane

    client = connect(redis_url, timeout_s=0.3)
    lane = Lane.for_client(client) if on_lane else None
    try:
        reply = await read_streams(client, {f"{namespace}:nothing": "$"}, count=1, block=1200, lane=lane)
        assert reply in (None, [])
    finally:
        if lane is not None:
            lane.close()
        await client.aclose()


async def test_a_finite_give_up_raises_redis_unavailable_naming_what(caplog):
    from redis.exceptions import TimeoutError as RedisTimeoutError

    from stream_reward.errors import RedisUnavailableError
    from stream_reward.wire.connection import with_reconnect

    async def silent() -> None:
        raise RedisTimeoutError("no reply from Redis within 5s")

    with pytest.raises(RedisUnavailableError, match="open batch b1"):
        await with_reconnect(silent, what="open batch b1", give_up_after_s=0.3)


async def test_a_refusal_outlasting_the_give_up_is_the_servers_words_not_unreachable(own_url: str) -> None:
    """A server that keeps answering ``OOM command not allowed`` is there: past the give-up
    the caller reads a BrokerError with its words and for how long, never "unreachable"."""
    admin = connect(own_url)
    try:
        await admin.config_set("maxmemory", 1)  # below what is used: every write is refused
        with pytest.raises(BrokerError) as info:
            await with_reconnect(lambda: admin.set("k", "v"), what="write k", give_up_after_s=0.3, refusals_only=True)
        assert not isinstance(info.value, RedisUnavailableError)
        text = str(info.value)
        assert text.startswith("write k: for ") and "OutOfMemoryError" in text and "unreachable" not in text, text
    finally:
        await admin.config_set("maxmemory", 0)
        await admin.aclose()


async def test_refusals_only_leaves_an_unreachable_server_to_the_caller() -> None:
    """With ``refusals_only``, a lost server is raised at the first attempt: the caller's
    own reply deadline bounds it, not a second wait on top."""
    server = EmbeddedServer().start()
    url = server.url
    server.stop()  # nothing answers at its address any more
    client = connect(url)
    calls = 0

    async def ping() -> object:
        nonlocal calls
        calls += 1
        return await client.ping()

    try:
        with pytest.raises(RedisConnectionError):
            await with_reconnect(ping, what="ping", give_up_after_s=30.0, refusals_only=True)
        assert calls == 1
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    ("exc", "refusal"),
    [
        (OutOfMemoryError("command not allowed when used memory > 'maxmemory'."), True),
        (ReadOnlyError("You can't write against a read only replica."), True),
        (BusyLoadingError("Redis is loading the dataset in memory"), True),
        (ResponseError("BUSY Redis is busy running a script."), True),
        (ResponseError("TRYAGAIN Multiple keys request during rehashing of slot"), True),
        (
            ResponseError("Command # 4 (HSET k f v) of pipeline caused error: BUSY Redis is busy running a script."),
            True,
        ),
        (ResponseError("Command # 2 (EVALSHA x 0) of pipeline caused error: ERR Error running script"), False),
        (ResponseError("CLUSTERDOWN The cluster is down"), True),
        (ResponseError("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'."), True),
        (ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"), False),
        (ResponseError("NOPERM this user has no permissions to run the 'xadd' command"), False),
        (RedisConnectionError("Connection refused"), False),
        (RedisTimeoutError("Timeout reading from socket"), False),
    ],
)
def test_a_refusal_for_now_is_told_from_no_answer_and_from_a_lasting_error(exc: Exception, refusal: bool) -> None:
    """What a caller waits out with ``refusals_only``: the server answered "not now"."""
    assert is_refusal(exc) is refusal
    if refusal:  # logged in the server's words, not as an unreachable server
        assert "refused it for now" in fault_text(exc) and "unreachable" not in fault_text(exc)


async def test_retrying_calls_keep_a_bounded_number_of_log_limiters() -> None:
    """Callers name a batch or a sample in ``what``: a run of many batches keeps no log
    limiter for a call that never failed, and a bounded number for those that did."""
    from stream_reward.wire import connection

    before = dict(connection._LIMITERS)

    async def fine() -> int:
        return 1

    await asyncio.gather(*(with_reconnect(fine, what=f"open_batch 'b{i}'") for i in range(1000)))
    assert connection._LIMITERS == before

    def refused_once() -> Callable[[], Awaitable[int]]:
        calls = 0

        async def op() -> int:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")
            return calls

        return op

    got = await asyncio.gather(
        *(with_reconnect(refused_once(), what=f"forgetting batch 'b{i}'", refusals_only=True) for i in range(1000))
    )
    assert got == [2] * 1000
    assert len(connection._LIMITERS) <= connection._LIMITERS_MAX
