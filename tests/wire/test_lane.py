"""The lane (wire/lane.py): a pipelined connection of its own for the hot round trips.

It promises: replies reach the right caller under concurrency, random cancels, error
replies (in their place, raised as redis-py raises them) and multi-MB replies; a caller
that gives up, mid-call or mid-reply, leaves the connection in step; a connection the
server kills or a peer that breaks the protocol fails the calls in flight and the next
call reconnects; cancels and ``close()`` during the first connect leave one connection
(none after close) and no unclosed transport; it honours a password, a database, TCP and
a client name as redis-py sends them, and leaves to redis-py the clients it cannot speak
for. A real server where one can do it; a loopback server that answers garbage stands in
for a broken peer (the one thing a real server will not do). Its users' promises under
the same faults are in tests/trainer/test_flush.py and test_listener.py.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket

import pytest
from helpers import lane_client_id, lane_of, named_connections, no_unclosed_transports, settle_named
from redis.asyncio import Redis
from redis.credentials import UsernamePasswordCredentialProvider
from redis.exceptions import AuthenticationError, NoScriptError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from stream_reward import ProducerConfig, RolloutProducer, Trajectory
from stream_reward.ops.embedded import EmbeddedServer
from stream_reward.wire.connection import connect
from stream_reward.wire.lane import Lane
from stream_reward.wire.packed import pack_command

pytestmark = pytest.mark.anyio


# Against a real server


async def test_concurrent_calls_each_get_their_own_replies(redis_url) -> None:
    client = connect(redis_url)
    lane = lane_of(client)
    rng = random.Random(3)

    async def one(k: int) -> None:
        await asyncio.sleep(rng.random() * 0.01)
        values = [f"{k}-{j}".encode() * rng.randint(1, 2000) for j in range(rng.randint(1, 4))]
        assert await lane.call([pack_command("ECHO", v) for v in values]) == values

    try:
        await asyncio.gather(*(one(k) for k in range(300)))
    finally:
        lane.close()
        await client.aclose()


async def test_a_caller_that_gives_up_leaves_the_connection_in_step(redis_url, namespace) -> None:
    """A blocking call given up: its reply still comes, is read and dropped, and the next
    caller gets its own reply on the same connection (redis-py must drop such a one)."""
    client = connect(redis_url)
    lane = lane_of(client)
    try:
        before = await lane_client_id(lane)
        blocked = asyncio.ensure_future(lane.call([pack_command("BLPOP", f"{namespace}:nothing", "0.3")]))
        await asyncio.sleep(0.05)
        blocked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await blocked
        assert await lane.call([pack_command("ECHO", "after")]) == [b"after"]
        assert await lane_client_id(lane) == before, "the connection was replaced"
    finally:
        lane.close()
        await client.aclose()


async def test_a_connection_the_server_kills_fails_the_calls_in_flight_and_the_next_call_reconnects(
    redis_url, namespace
) -> None:
    client = connect(redis_url)
    lane = lane_of(client)
    try:
        first = await lane_client_id(lane)
        blocked = asyncio.ensure_future(lane.call([pack_command("BLPOP", f"{namespace}:nothing", "5")]))
        await asyncio.sleep(0.05)
        await client.client_kill_filter(_id=first)
        with pytest.raises(RedisConnectionError):
            await asyncio.wait_for(blocked, 2)
        assert await lane.call([pack_command("ECHO", "again")]) == [b"again"]
        assert await lane_client_id(lane) != first
    finally:
        lane.close()
        await client.aclose()


async def test_error_replies_come_back_in_their_place_as_redis_py_raises_them(redis_url, namespace) -> None:
    client = connect(redis_url)
    lane = lane_of(client)
    try:
        await client.set(f"{namespace}:s", "text")
        replies = await lane.call(
            [
                pack_command("EVALSHA", "0" * 40, 0),
                pack_command("ECHO", "between"),
                pack_command("INCR", f"{namespace}:s"),
            ]
        )
        assert isinstance(replies[0], NoScriptError)
        assert replies[1] == b"between"
        assert isinstance(replies[2], ResponseError) and "not an integer" in str(replies[2])
        assert await lane.call([pack_command("ECHO", "still in step")]) == [b"still in step"]
    finally:
        lane.close()
        await client.aclose()


async def test_a_password_and_a_database_are_honoured_and_a_wrong_password_is_refused() -> None:
    with EmbeddedServer(extra_args=["--requirepass", "pw-1"]) as server:
        client = connect(f"unix://:pw-1@{server.socket_path}?db=3")
        lane = lane_of(client)
        other = connect(f"unix://:pw-1@{server.socket_path}?db=0")
        bad = connect(f"unix://:wrong@{server.socket_path}")
        bad_lane = lane_of(bad)
        try:
            assert await lane.call([pack_command("SET", "k", "in-3")]) == [b"OK"]
            assert await client.get("k") == b"in-3"
            assert await other.get("k") is None
            with pytest.raises(AuthenticationError):
                await bad_lane.call([pack_command("PING")])
        finally:
            lane.close()
            bad_lane.close()
            for c in (client, other, bad):
                await c.aclose()


async def test_a_tcp_node_and_a_client_name() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with EmbeddedServer(extra_args=["--port", str(port), "--bind", "127.0.0.1"]):
        client = connect(f"redis://127.0.0.1:{port}/0?client_name=trainer-lane")
        lane = lane_of(client)
        try:
            assert await lane.call([pack_command("CLIENT", "GETNAME")]) == [b"trainer-lane"]
        finally:
            lane.close()
            await client.aclose()


async def test_clients_it_cannot_speak_for_are_left_to_redis_py(redis_url) -> None:
    cluster = connect("redis+cluster://127.0.0.1:1")
    tls = connect("rediss://127.0.0.1:1")
    single = Redis.from_url(redis_url, single_connection_client=True)
    resp3 = connect(redis_url, protocol=3)
    try:
        for client in (cluster, tls, single, resp3):
            assert Lane.for_client(client) is None, client
    finally:
        for client in (tls, single, resp3):
            await client.aclose()


async def test_close_fails_the_calls_in_flight_and_refuses_more(redis_url, namespace) -> None:
    client = connect(redis_url)
    lane = lane_of(client)
    try:
        await lane.call([pack_command("PING")])
        blocked = asyncio.ensure_future(lane.call([pack_command("BLPOP", f"{namespace}:nothing", "5")]))
        await asyncio.sleep(0.05)
        lane.close()
        with pytest.raises(RedisConnectionError):
            await asyncio.wait_for(blocked, 2)
        with pytest.raises(RedisConnectionError):
            await lane.call([pack_command("PING")])
    finally:
        await client.aclose()


async def test_a_peer_that_breaks_the_protocol_fails_the_call_and_the_next_call_reconnects() -> None:
    handlers: list[asyncio.Task] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.append(asyncio.current_task())
        garbage = len(handlers) == 1
        try:
            while await reader.read(65536):
                writer.write(b"!not resp\r\n" if garbage else b"+PONG\r\n")
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = connect(f"redis://127.0.0.1:{port}")
    lane = lane_of(client)
    try:
        with pytest.raises(RedisConnectionError, match="protocol"):
            await asyncio.wait_for(lane.call([pack_command("PING")]), 5)
        assert await asyncio.wait_for(lane.call([pack_command("PING")]), 5) == [b"PONG"]
        assert len(handlers) == 2
    finally:
        lane.close()
        await client.aclose()
        server.close()
        await asyncio.wait_for(asyncio.gather(*handlers, return_exceptions=True), 5)
        await server.wait_closed()


# Adversarial callers, connects and peers


async def test_a_storm_of_callers_with_random_cancels_errors_and_multi_mb_replies(redis_url, namespace) -> None:
    """400 callers start before the lane is connected; a quarter are cancelled at random
    moments (before their write, while connecting, mid-reply of a multi-MB value). Every
    caller not cancelled gets exactly its own replies, error replies in place; one
    connection on the server throughout, none after close."""
    name = f"storm-{namespace}"
    template = connect(f"{redis_url}?client_name={name}")
    admin = connect(redis_url)
    lane = lane_of(template)
    rng = random.Random(11)
    big = {f"{namespace}:big{j}": os.urandom((1 + j) * 1_500_000) for j in range(3)}
    try:
        for key, value in big.items():
            await admin.set(key, value)
        await admin.set(f"{namespace}:str", "text")

        async def one(k: int) -> int:
            r = random.Random(k)
            if r.random() < 0.5:
                await asyncio.sleep(r.random() * 0.05)
            cmds, want = [], []
            for j in range(r.randint(1, 5)):
                kinds = ["echo", "echo", "echo", "err", "noscript", "blpop"]
                if k % 8 == 0 and j < 2:  # multi-MB replies for some: read over many data_received
                    kinds += ["get", "bigecho"]
                kind = r.choice(kinds)
                if kind == "echo":
                    v = f"{k}:{j}:".encode() * r.randint(1, 500)
                    cmds.append(pack_command("ECHO", v))
                    want.append(v)
                elif kind == "bigecho":
                    v = f"[{k}.{j}]".encode() * r.randint(50_000, 200_000)
                    cmds.append(pack_command("ECHO", v))
                    want.append(v)
                elif kind == "get":
                    key = r.choice(sorted(big))
                    cmds.append(pack_command("GET", key))
                    want.append(big[key])
                elif kind == "err":
                    cmds.append(pack_command("INCR", f"{namespace}:str"))
                    want.append(ResponseError)
                elif kind == "noscript":
                    cmds.append(pack_command("EVALSHA", "f" * 40, 0))
                    want.append(NoScriptError)
                else:
                    cmds.append(pack_command("BLPOP", f"{namespace}:empty:{k}", "0.01"))
                    want.append(None)
            replies = await lane.call(cmds)
            assert len(replies) == len(want), k
            for j, (got, expected) in enumerate(zip(replies, want)):
                if isinstance(expected, type):
                    assert isinstance(got, expected), (k, j, got)
                else:
                    assert got == expected, (k, j, repr(got)[:80])
            return k

        tasks = [asyncio.ensure_future(one(k)) for k in range(400)]
        loop = asyncio.get_running_loop()
        doomed = rng.sample(range(400), 100)
        for at, k in enumerate(doomed):
            delay = 0.0 if at < 20 else rng.random() * 0.6  # the first 20 while the lane connects
            loop.call_later(delay, tasks[k].cancel)
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
        cancelled = sum(1 for t in tasks if t.cancelled())
        errors = [o for o in outcomes if isinstance(o, BaseException) and not isinstance(o, asyncio.CancelledError)]
        assert not errors, errors[:3]
        assert 20 <= cancelled <= 100 and len(tasks) - cancelled >= 300
        assert await lane.call([pack_command("ECHO", "after the storm")]) == [b"after the storm"]
        assert await named_connections(admin, name) == 1
        lane.close()
        assert await settle_named(admin, name, 0) == 0
    finally:
        lane.close()
        await template.aclose()
        await admin.delete(*big, f"{namespace}:str")
        await admin.aclose()
    assert no_unclosed_transports() == []


async def test_callers_giving_up_while_the_first_connect_hangs_leave_one_connection(own_url, namespace) -> None:
    """The server is paused, so the lane's handshake (CLIENT SETNAME) waits: six callers wait
    on that one connect, two give up. The other four get their replies once the pause ends,
    on the one connection the lane opened."""
    name = f"slowconn-{namespace}"
    template = connect(f"{own_url}?client_name={name}")
    admin = connect(own_url)
    lane = lane_of(template)
    try:
        await admin.execute_command("CLIENT", "PAUSE", 500, "ALL")
        calls = [asyncio.ensure_future(lane.call([pack_command("ECHO", f"c{i}")])) for i in range(6)]
        await asyncio.sleep(0.15)
        assert not any(c.done() for c in calls), "the connect did not wait: nothing tested"
        calls[0].cancel()
        calls[4].cancel()
        outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
        for i, outcome in enumerate(outcomes):
            if i in (0, 4):
                assert isinstance(outcome, asyncio.CancelledError)
            else:
                assert outcome == [f"c{i}".encode()]
        assert await named_connections(admin, name) == 1
        (cid,) = await lane.call([pack_command("CLIENT", "ID")])
        (again,) = await lane.call([pack_command("CLIENT", "ID")])
        assert cid == again
    finally:
        lane.close()
        await template.aclose()
        await admin.aclose()
    assert no_unclosed_transports() == []


async def test_every_caller_giving_up_during_connect_still_leaves_one_usable_connection(own_url, namespace) -> None:
    name = f"allgone-{namespace}"
    template = connect(f"{own_url}?client_name={name}")
    admin = connect(own_url)
    lane = lane_of(template)
    try:
        await admin.execute_command("CLIENT", "PAUSE", 300, "ALL")
        calls = [asyncio.ensure_future(lane.call([pack_command("PING")])) for _ in range(3)]
        await asyncio.sleep(0.1)
        for c in calls:
            c.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        assert all(c.cancelled() for c in calls)
        assert await settle_named(admin, name, 1) == 1
        # the next callers share that connection, it was not opened again
        await asyncio.gather(*(lane.call([pack_command("PING")]) for _ in range(5)))
        assert await named_connections(admin, name) == 1
    finally:
        lane.close()
        await template.aclose()
        await admin.aclose()
    assert no_unclosed_transports() == []


async def test_close_while_the_first_connect_hangs_leaves_no_connection(own_url, namespace) -> None:
    name = f"closeconn-{namespace}"
    template = connect(f"{own_url}?client_name={name}")
    admin = connect(own_url)
    lane = lane_of(template)
    try:
        await admin.execute_command("CLIENT", "PAUSE", 400, "ALL")
        calls = [asyncio.ensure_future(lane.call([pack_command("PING")])) for _ in range(3)]
        await asyncio.sleep(0.1)
        calls[1].cancel()
        lane.close()
        outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 5)
        assert isinstance(outcomes[1], asyncio.CancelledError)
        for outcome in (outcomes[0], outcomes[2]):
            assert isinstance(outcome, RedisConnectionError), outcome
        assert await settle_named(admin, name, 0) == 0
        with pytest.raises(RedisConnectionError):
            await lane.call([pack_command("PING")])
    finally:
        lane.close()
        await template.aclose()
        await admin.aclose()
    assert no_unclosed_transports() == []


async def test_close_twice_with_calls_in_flight_and_calls_after(redis_url, namespace) -> None:
    name = f"close2-{namespace}"
    template = connect(f"{redis_url}?client_name={name}")
    admin = connect(redis_url)
    lane = lane_of(template)
    try:
        await lane.call([pack_command("PING")])
        inflight = [
            asyncio.ensure_future(lane.call([pack_command("BLPOP", f"{namespace}:none{i}", "5")])) for i in range(5)
        ]
        await asyncio.sleep(0.05)
        lane.close()
        lane.close()
        outcomes = await asyncio.wait_for(asyncio.gather(*inflight, return_exceptions=True), 3)
        assert all(isinstance(o, RedisConnectionError) for o in outcomes), outcomes
        for _ in range(2):
            with pytest.raises(RedisConnectionError):
                await asyncio.wait_for(lane.call([pack_command("PING")]), 3)
        assert await settle_named(admin, name, 0) == 0
    finally:
        lane.close()
        await template.aclose()
        await admin.aclose()
    assert no_unclosed_transports() == []


async def test_a_call_of_no_commands_returns_at_once_and_leaves_the_lane_usable(redis_url) -> None:
    client = connect(redis_url)
    lane = lane_of(client)
    try:
        await lane.call([pack_command("PING")])
        assert await asyncio.wait_for(lane.call([]), 2) == []
        assert await asyncio.wait_for(lane.call([pack_command("ECHO", "x")]), 2) == [b"x"]
    finally:
        lane.close()
        await client.aclose()


async def test_server_restarts_under_the_lane(namespace) -> None:
    """Killed and restarted on the same socket: the call in flight fails, the next connects
    again; calls while the server is down fail at once (no hang) and the lane recovers."""
    server = EmbeddedServer().start()
    name = f"restart-{namespace}"
    try:
        template = connect(f"{server.url}?client_name={name}")
        lane = lane_of(template)
        loop = asyncio.get_running_loop()
        for _ in range(3):
            blocked = asyncio.ensure_future(lane.call([pack_command("BLPOP", "nothing", "10")]))
            await asyncio.sleep(0.05)
            await loop.run_in_executor(None, server.restart)
            with pytest.raises(RedisConnectionError):
                await asyncio.wait_for(blocked, 5)
            assert await asyncio.wait_for(lane.call([pack_command("ECHO", "up")]), 5) == [b"up"]
        await loop.run_in_executor(None, server.kill)
        for _ in range(3):
            with pytest.raises(RedisConnectionError):
                await asyncio.wait_for(lane.call([pack_command("PING")]), 5)
        await loop.run_in_executor(None, server.start)
        assert await asyncio.wait_for(lane.call([pack_command("PING")]), 5) == [b"PONG"]
        admin = connect(server.url)
        try:
            assert await named_connections(admin, name) == 1
        finally:
            await admin.aclose()
        lane.close()
        await template.aclose()
    finally:
        server.stop()
    assert no_unclosed_transports() == []


async def test_a_peer_closing_mid_reply_fails_the_call_and_a_split_reply_is_assembled() -> None:
    """A fake peer: its first connection answers half a bulk string then closes; the second
    answers every command with one reply dribbled a byte at a time."""
    handlers: list[asyncio.Task] = []
    reply = b"*3\r\n$5\r\nhello\r\n:42\r\n*2\r\n$-1\r\n+OK\r\n"

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.append(asyncio.current_task())
        first = len(handlers) == 1
        try:
            while await reader.read(65536):
                if first:
                    writer.write(b"$100\r\nhalf of it")
                    await writer.drain()
                    return
                for b in reply:
                    writer.write(bytes([b]))
                    await writer.drain()
                    await asyncio.sleep(0)
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = connect(f"redis://127.0.0.1:{port}")
    lane = lane_of(client)
    try:
        with pytest.raises(RedisConnectionError):
            await asyncio.wait_for(lane.call([pack_command("GET", "k")]), 5)
        got = await asyncio.wait_for(lane.call([pack_command("X")]), 5)
        assert got == [[b"hello", 42, [None, b"OK"]]]
    finally:
        lane.close()
        await client.aclose()
        server.close()
        await asyncio.wait_for(asyncio.gather(*handlers, return_exceptions=True), 5)
        await server.wait_closed()


async def test_for_client_refuses_a_credential_provider_and_foreign_connection_classes(redis_url) -> None:
    from redis.asyncio.connection import Connection, ConnectionPool

    class Custom(Connection):
        pass

    provider = Redis(
        unix_socket_path=redis_url[len("unix://") :],
        credential_provider=UsernamePasswordCredentialProvider("default", "x"),
    )
    custom = Redis(connection_pool=ConnectionPool(connection_class=Custom, host="127.0.0.1", port=1))
    plain = Redis(unix_socket_path=redis_url[len("unix://") :])
    try:
        assert Lane.for_client(provider) is None
        assert Lane.for_client(custom) is None
        assert Lane.for_client(plain) is not None  # the control: a plain client gets one
    finally:
        for c in (provider, custom, plain):
            await c.aclose()


async def test_an_empty_password_is_sent_as_redis_py_sends_it(redis_url, namespace) -> None:
    client = Redis(unix_socket_path=redis_url[len("unix://") :], password="")
    try:
        assert await client.ping()  # redis-py itself connects fine
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace), client=client) as producer:
            await producer.open_batch("e", 2, 4)
            await producer.push(Trajectory("e", 0, "test", response="a"))
    finally:
        await client.aclose()


async def test_an_empty_username_is_sent_as_redis_py_sends_it(namespace) -> None:
    with EmbeddedServer(extra_args=["--requirepass", "pw-2"]) as server:
        client = Redis(unix_socket_path=server.socket_path, username="", password="pw-2")
        try:
            assert await client.ping()  # redis-py itself connects fine
            async with RolloutProducer(server.url, ProducerConfig(namespace=namespace), client=client) as producer:
                await producer.open_batch("e", 2, 4)
                await producer.push(Trajectory("e", 0, "test", response="a"))
        finally:
            await client.aclose()


async def test_a_caller_cancelled_mid_reply_of_a_huge_value_leaves_the_next_in_step(redis_url, namespace) -> None:
    """Cancelled once the first chunk of a 24 MB reply has arrived: the rest is read and
    dropped, the call queued behind it gets its own reply, on the same connection."""
    client = connect(redis_url)
    lane = lane_of(client)
    key = f"{namespace}:huge"
    try:
        await client.set(key, os.urandom(24_000_000))
        (cid,) = await lane.call([pack_command("CLIENT", "ID")])
        protocol = lane._protocol
        assert protocol is not None
        first_chunk = asyncio.Event()
        chunks = 0
        original = protocol.data_received

        def spy(data: bytes) -> None:
            nonlocal chunks
            chunks += 1
            first_chunk.set()
            original(data)

        protocol.data_received = spy  # type: ignore[method-assign]
        huge = asyncio.ensure_future(lane.call([pack_command("GET", key)]))
        behind = asyncio.ensure_future(lane.call([pack_command("ECHO", "behind"), pack_command("CLIENT", "ID")]))
        await asyncio.wait_for(first_chunk.wait(), 5)
        assert not huge.done()
        huge.cancel()
        assert await asyncio.wait_for(behind, 10) == [b"behind", cid]
        assert chunks > 10, "the reply came in few chunks: not mid-reply"
        assert await lane.call([pack_command("ECHO", "next")]) == [b"next"]
    finally:
        lane.close()
        await client.delete(key)
        await client.aclose()


async def test_a_handshake_that_gets_no_reply_times_out_like_any_call(redis_url) -> None:
    """A server that takes the connection and never answers its AUTH: the lane's reply
    deadline bounds the handshake too, rather than a hang."""
    from helpers import CutProxy
    from redis.exceptions import TimeoutError as RedisTimeoutError

    async with CutProxy(redis_url[len("unix://") :]) as proxy:
        proxy.black = True
        client = connect(proxy.url.replace("redis://", "redis://:pw@"), timeout_s=0.5)
        lane = Lane.for_client(client)
        assert lane is not None
        try:
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(RedisTimeoutError):
                await asyncio.wait_for(lane.call([pack_command("PING")]), 30)
            assert loop.time() - start < 3.0
        finally:
            lane.close()
            await client.aclose()
