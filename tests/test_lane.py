"""The lane (wire/lane.py): the trainer's own pipelined connection for pushes and result
reads. Tried against a real server where one can do it: replies reach the right caller
under concurrency, a caller that gives up mid-call leaves the connection in step, the
server killing the connection, error replies in place, a password and a database, TCP,
and the clients it must leave to redis-py. A loopback server that answers garbage
stands in for a broken peer (the one thing a real server will not do)."""

from __future__ import annotations

import asyncio
import random
import socket

import pytest
from helpers import lane_of
from redis.asyncio import Redis
from redis.exceptions import AuthenticationError, NoScriptError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from stream_reward import ProducerConfig, RolloutProducer, Trajectory
from stream_reward.errors import BrokerError
from stream_reward.ops.embedded import EmbeddedServer
from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys
from stream_reward.wire.lane import Lane
from stream_reward.wire.packed import pack_command

pytestmark = pytest.mark.anyio


async def lane_client_id(lane: Lane) -> int:
    (cid,) = await lane.call([pack_command("CLIENT", "ID")])
    return int(cid)


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


# ------------------------------------------------------------------ through the producer
async def test_a_push_whose_connection_the_server_kills_mid_flush_lands_once(own_url, namespace) -> None:
    """The server pauses writes, the producer's lane is killed with its push queued: the push
    is sent again on a new connection (redis-py's retry), and the sample is queued once."""
    keys = Keys(namespace)
    admin = connect(own_url)
    try:
        async with RolloutProducer(own_url, ProducerConfig(namespace=namespace)) as producer:
            await producer.open_batch("k", 2, 4)
            await producer.push(Trajectory("k", 0, "test", response="a"))
            lane = producer._lane
            assert lane is not None, "the producer does not push on a lane"
            victim = await lane_client_id(lane)
            await admin.execute_command("CLIENT", "PAUSE", 300, "WRITE")
            pushing = asyncio.ensure_future(producer.push(Trajectory("k", 1, "test", response="b")))
            await asyncio.sleep(0.1)
            await admin.client_kill_filter(_id=victim)
            await asyncio.wait_for(pushing, 10)
            assert await lane_client_id(lane) != victim
        assert await admin.xlen(keys.stream()) == 2
        assert int(await admin.hget(keys.pushed(0), "samples")) == 2
    finally:
        await admin.aclose()


async def test_a_push_to_a_server_gone_for_good_raises_broker_error(namespace) -> None:
    server = EmbeddedServer().start()
    url = server.url
    try:
        async with RolloutProducer(url, ProducerConfig(namespace=namespace)) as producer:
            await producer.open_batch("g", 2, 4)
            await producer.push(Trajectory("g", 0, "test", response="a"))
            server.stop()
            with pytest.raises(BrokerError, match="push of 1 trajectories failed"):
                await asyncio.wait_for(producer.push(Trajectory("g", 1, "test", response="b")), 30)
    finally:
        server.stop()


async def test_score_gets_its_result_when_the_listeners_connection_is_killed_mid_read(
    redis_url, namespace, spawn_workers
) -> None:
    admin = connect(redis_url)
    spawn_workers(1)
    try:
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
            await producer.open_batch("r", 4, 4)
            first = await producer.score(Trajectory("r", 0, "openai/gsm8k", response="#### 1", ground_truth="1"))
            assert first.status == "ok"
            (reader,) = producer._listener._readers.values()
            assert reader.lane is not None, "the listener does not read on a lane"
            for i in (1, 2):
                victim = await lane_client_id(reader.lane) if i == 1 else None
                scoring = asyncio.ensure_future(
                    producer.score(
                        Trajectory("r", i, "openai/gsm8k", response="#### 2", ground_truth="2"), timeout_s=30
                    )
                )
                if victim is not None:
                    await admin.client_kill_filter(_id=victim)
                result = await asyncio.wait_for(scoring, 30)
                assert (result.index, result.status, result.score) == (i, "ok", 1.0)
    finally:
        await admin.aclose()


async def test_a_push_answered_loading_is_sent_again(namespace) -> None:
    """A restarted server replaying its AOF answers -LOADING: redis-py raises that as a
    ConnectionError and retries it; the producer's lane sends the push again as well."""
    answered: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.read(65536):
                reply = b"-LOADING Redis is loading the dataset in memory\r\n" if not answered else b":1\r\n"
                answered.append(reply)
                writer.write(reply)
                await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    producer = RolloutProducer(f"redis://127.0.0.1:{port}", ProducerConfig(namespace=namespace))
    try:
        assert await producer._send_packed([pack_command("EVALSHA", "0" * 40, 0)]) == [1]
        assert len(answered) == 2
    finally:
        await producer.aclose()
        server.close()
        await server.wait_closed()


async def test_closing_a_producer_with_a_backlog_reading_in_flight_leaves_no_connection_open(namespace) -> None:
    """A push starts a backlog reading in the background and returns; the producer closes
    at once. The reading must end with it: left running it reached for a client after the close
    (a new one, or redis-py's retry reconnecting the closed one), a connection nobody closes."""
    with EmbeddedServer() as server:
        admin = connect(server.url)
        try:
            (mine,) = [c["id"] for c in await admin.client_list()]
            for k in range(10):
                producer = RolloutProducer(server.url, ProducerConfig(namespace=namespace, backlog_poll_s=0.001))
                await producer.open_batch(f"b{k}", 1, 4)
                await producer.push(Trajectory(f"b{k}", 0, "test", response="a"))
                # As a push that finds the last reading stale starts one, and returns.
                reading = producer._start_backlog_reading()
                for _ in range(k % 3):
                    await asyncio.sleep(0)
                await producer.aclose()
                assert reading is not None and reading.done(), "a backlog reading outlived its producer"
            await asyncio.sleep(0.3)
            assert [c["id"] for c in await admin.client_list()] == [mine]
        finally:
            await admin.aclose()
