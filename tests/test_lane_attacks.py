"""Adversarial tests of the lane (wire/lane.py) and of its two users, the producer's pushes
and the listener's result reads: replies matched to the right caller under random cancels,
error and multi-MB replies; cancels and close() during the first connect (one connection on
the server afterwards, none after close, no unclosed transport); server restarts, CLIENT KILL
and a proxy that loses a reply after the command ran; the clients the lane must refuse."""

from __future__ import annotations

import asyncio
import gc
import os
import random
import warnings

import pytest
from helpers import CutProxy, lane_of
from redis.asyncio import Redis
from redis.credentials import UsernamePasswordCredentialProvider
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

from stream_reward import ProducerConfig, RolloutProducer, Trajectory
from stream_reward.errors import BackpressureError, BrokerError
from stream_reward.ops.embedded import EmbeddedServer
from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys
from stream_reward.wire.lane import Lane
from stream_reward.wire.packed import pack_command

pytestmark = pytest.mark.anyio


async def named_connections(admin, name: str) -> int:
    return sum(1 for c in await admin.client_list() if c.get("name") == name)


async def settle_named(admin, name: str, want: int, within_s: float = 3.0) -> int:
    """The count of connections named ``name`` once it reaches ``want`` (or the last seen)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        n = await named_connections(admin, name)
        if n == want or loop.time() > deadline:
            return n
        await asyncio.sleep(0.05)


def no_unclosed_transports() -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
        gc.collect()
    return [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]


# ------------------------------------------------------------------ the lane alone
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


# ------------------------------------------------------------------ what for_client refuses
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


@pytest.mark.parametrize("kind", ["single", "resp3"])
async def test_the_producer_pushes_through_redis_py_on_clients_the_lane_refuses(redis_url, namespace, kind) -> None:
    keys = Keys(namespace)
    if kind == "single":
        client = Redis.from_url(redis_url, single_connection_client=True)
    else:
        client = connect(redis_url, protocol=3)
    admin = connect(redis_url)
    try:
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace), client=client) as producer:
            await producer.open_batch("b", 8, 4)
            await asyncio.gather(*(producer.push(Trajectory("b", i, "test", response="r")) for i in range(4)))
            assert await producer.push_many([Trajectory("b", i, "test", response="r") for i in range(4, 8)]) == 4
            assert producer._lane is None, "a lane was made for a client it must refuse"
        assert int(await admin.hget(keys.pushed(0), "samples")) == 8
    finally:
        await client.aclose()
        await admin.aclose()


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


# ------------------------------------------------------------------ through the producer
async def test_a_push_whose_reply_is_lost_after_it_ran_lands_once(redis_url, namespace) -> None:
    """The proxy passes the push on and drops the connection instead of the reply: the push
    ran, the producer cannot know. Sent again on a new connection it must count once."""
    keys = Keys(namespace)
    admin = connect(redis_url)
    try:
        async with CutProxy(redis_url[len("unix://") :]) as proxy:
            async with RolloutProducer(proxy.url, ProducerConfig(namespace=namespace)) as producer:
                await producer.open_batch("c", 6, 4)
                await producer.push(Trajectory("c", 0, "test", response="a"))
                for i in range(1, 4):
                    proxy.arm(b"EVALSHA")
                    await asyncio.wait_for(producer.push(Trajectory("c", i, "test", response="a")), 10)
                    assert proxy.cuts == i, "the reply was not lost: nothing tested"
                proxy.arm(b"EVALSHA")
                n = await asyncio.wait_for(
                    producer.push_many([Trajectory("c", i, "test", response="a") for i in (4, 5)]), 10
                )
                assert n == 2 and proxy.cuts == 4
        assert int(await admin.hget(keys.pushed(0), "samples")) == 6
        assert await admin.xlen(keys.stream()) == 5
    finally:
        await admin.aclose()


async def test_a_score_whose_push_reply_is_lost_gets_its_result(redis_url, namespace, spawn_workers) -> None:
    spawn_workers(1)
    keys = Keys(namespace)
    admin = connect(redis_url)
    try:
        async with CutProxy(redis_url[len("unix://") :]) as proxy:
            async with RolloutProducer(proxy.url, ProducerConfig(namespace=namespace)) as producer:
                await producer.open_batch("s", 4, 4)
                for i in range(4):
                    if i % 2:
                        proxy.arm(b"EVALSHA")
                    traj = Trajectory("s", i, "openai/gsm8k", response=f"#### {i}", ground_truth="2")
                    result = await asyncio.wait_for(producer.score(traj, timeout_s=30), 40)
                    assert (result.index, result.status, result.score) == (i, "ok", 1.0 if i == 2 else 0.0)
                assert proxy.cuts == 2
        assert int(await admin.hget(keys.pushed(0), "samples")) == 4
    finally:
        await admin.aclose()


async def test_max_backlog_control_without_lost_replies(redis_url, namespace) -> None:
    """The control of the next test: the same pushes without a lost reply hit max_backlog."""
    config = ProducerConfig(namespace=namespace, max_backlog=3, on_backlog="raise", backlog_poll_s=60)
    async with RolloutProducer(redis_url, config) as producer:
        await producer.open_batch("m", 8, 4)
        for i in range(3):
            await producer.push(Trajectory("m", i, "test", response="a"))
        with pytest.raises(BackpressureError):
            await producer.push(Trajectory("m", 3, "test", response="a"))


async def test_max_backlog_holds_when_push_replies_are_lost(redis_url, namespace) -> None:
    config = ProducerConfig(namespace=namespace, max_backlog=3, on_backlog="raise", backlog_poll_s=60)
    async with CutProxy(redis_url[len("unix://") :]) as proxy:
        async with RolloutProducer(proxy.url, config) as producer:
            await producer.open_batch("m", 8, 4)
            for i in range(3):
                proxy.arm(b"EVALSHA")
                await producer.push(Trajectory("m", i, "test", response="a"))
            assert proxy.cuts == 3
            assert await producer.backlog() == 3
            with pytest.raises(BackpressureError):
                await producer.push(Trajectory("m", 3, "test", response="a"))


async def test_client_kill_storm_during_concurrent_pushes_counts_each_sample_once(redis_url, namespace) -> None:
    """CLIENT KILL of the producer's lane every few ms while 300 samples are pushed by 60
    concurrent callers: every push returns or raises BrokerError; those that raised are
    pushed again; in the end each sample is counted once."""
    keys = Keys(namespace)
    name = f"pkill-{namespace}"
    admin = connect(redis_url)
    stop = asyncio.Event()
    kills = 0

    async def killer() -> None:
        nonlocal kills
        while not stop.is_set():
            for c in await admin.client_list():
                if c.get("name") == name:
                    try:
                        await admin.client_kill_filter(_id=c["id"])
                        kills += 1
                    except ResponseError:
                        pass
            await asyncio.sleep(random.random() * 0.01)

    try:
        url = f"{redis_url}?client_name={name}"
        async with RolloutProducer(url, ProducerConfig(namespace=namespace)) as producer:
            await producer.open_batch("k", 300, 4)
            await producer.push(Trajectory("k", 0, "test", response="a"))
            killing = asyncio.ensure_future(killer())
            failed: list[int] = []

            async def pusher(lo: int) -> None:
                for i in range(lo, 300, 60):
                    if i == 0:
                        continue
                    try:
                        await asyncio.wait_for(producer.push(Trajectory("k", i, "test", response="a")), 20)
                    except BrokerError:
                        failed.append(i)

            await asyncio.gather(*(pusher(lo) for lo in range(60)))
            stop.set()
            await killing
            assert kills > 0, "no connection was killed: nothing tested"
            for i in failed:
                await producer.push(Trajectory("k", i, "test", response="a"))
        assert int(await admin.hget(keys.pushed(0), "samples")) == 300
    finally:
        stop.set()
        await admin.aclose()


async def test_a_server_restarted_mid_push_loses_nothing_and_counts_once(namespace) -> None:
    """With AOF (fsync always): a push held by CLIENT PAUSE WRITE when the server is
    SIGKILLed and restarted either lands (the lane's retry, NOSCRIPT reload) or raises
    BrokerError and is pushed again; each sample is counted once."""
    server = EmbeddedServer(appendonly=True, extra_args=["--appendfsync", "always"]).start()
    keys = Keys(namespace)
    loop = asyncio.get_running_loop()
    try:
        async with RolloutProducer(server.url, ProducerConfig(namespace=namespace)) as producer:
            await producer.open_batch("r", 10, 4)
            for i in range(3):
                await producer.push(Trajectory("r", i, "test", response="a"))
            for i in range(3, 6):
                admin = connect(server.url)
                await admin.execute_command("CLIENT", "PAUSE", 2000, "WRITE")
                await admin.aclose()
                pushing = asyncio.ensure_future(producer.push(Trajectory("r", i, "test", response="a")))
                await asyncio.sleep(0.1)
                assert not pushing.done()
                await loop.run_in_executor(None, server.restart)
                try:
                    await asyncio.wait_for(pushing, 20)
                except BrokerError:
                    await asyncio.wait_for(producer.push(Trajectory("r", i, "test", response="a")), 20)
            await producer.push(Trajectory("r", 6, "test", response="a"))
        admin = connect(server.url)
        try:
            assert int(await admin.hget(keys.pushed(0), "samples")) == 7
            assert await admin.xlen(keys.stream()) == 7
        finally:
            await admin.aclose()
    finally:
        server.stop()


async def test_a_push_in_flight_when_the_server_dies_for_good_raises_broker_error(namespace) -> None:
    server = EmbeddedServer().start()
    loop = asyncio.get_running_loop()
    try:
        async with RolloutProducer(server.url, ProducerConfig(namespace=namespace)) as producer:
            await producer.open_batch("g", 4, 4)
            await producer.push(Trajectory("g", 0, "test", response="a"))
            admin = connect(server.url)
            await admin.execute_command("CLIENT", "PAUSE", 5000, "WRITE")
            await admin.aclose()
            pushing = asyncio.ensure_future(producer.push(Trajectory("g", 1, "test", response="b")))
            scoring = asyncio.ensure_future(
                producer.score(Trajectory("g", 2, "openai/gsm8k", response="#### 2", ground_truth="2"), timeout_s=5)
            )
            await asyncio.sleep(0.1)
            await loop.run_in_executor(None, server.kill)
            with pytest.raises(BrokerError):
                await asyncio.wait_for(pushing, 15)
            with pytest.raises(BrokerError):
                await asyncio.wait_for(scoring, 15)
            with pytest.raises(BrokerError):
                await asyncio.wait_for(producer.push(Trajectory("g", 3, "test", response="c")), 15)
    finally:
        server.stop()


# ------------------------------------------------------------------ the listener
async def test_score_calls_get_their_own_results_while_the_listeners_lane_is_killed_again_and_again(
    own_url, namespace, spawn_workers
) -> None:
    # Its own server: the killer kills every XREAD client, and on the shared one those
    # include the tests running beside it.
    spawn_workers(1, url=own_url)
    admin = connect(own_url)
    stop = asyncio.Event()
    kills = 0

    async def killer() -> None:
        nonlocal kills
        while not stop.is_set():
            for c in await admin.client_list():
                if c.get("cmd") == "xread":
                    try:
                        await admin.client_kill_filter(_id=c["id"])
                        kills += 1
                    except ResponseError:
                        pass
            await asyncio.sleep(0.005 + random.random() * 0.03)

    try:
        async with RolloutProducer(own_url, ProducerConfig(namespace=namespace)) as producer:
            await producer.open_batch("L", 200, 4)
            warm = await producer.score(Trajectory("L", 0, "openai/gsm8k", response="#### 2", ground_truth="2"))
            assert warm.status == "ok"
            killing = asyncio.ensure_future(killer())
            rng = random.Random(5)

            async def one(i: int):
                await asyncio.sleep(rng.random() * 2)
                answer = str(i % 7)
                traj = Trajectory("L", i, "openai/gsm8k", response=f"#### {answer}", ground_truth=str(i % 3))
                return i, await producer.score(traj, timeout_s=60)

            results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(1, 200))), 90)
            stop.set()
            await killing
            assert kills >= 5, f"only {kills} kills: nothing tested"
            for i, result in results:
                want = 1.0 if str(i % 7) == str(i % 3) else 0.0
                assert (result.index, result.status, result.score) == (i, "ok", want), (i, result)
    finally:
        stop.set()
        await admin.aclose()


async def test_listener_results_survive_lost_xread_replies(redis_url, namespace, spawn_workers) -> None:
    """The proxy swallows XREAD replies (results in them) after the server sent them: the
    listener must read them again, from the same cursor, on a new connection."""
    spawn_workers(1)
    async with CutProxy(redis_url[len("unix://") :]) as proxy:
        async with RolloutProducer(proxy.url, ProducerConfig(namespace=namespace)) as producer:
            await producer.open_batch("X", 20, 4)
            await producer.score(Trajectory("X", 0, "openai/gsm8k", response="#### 2", ground_truth="2"))
            proxy.arm(b"XREAD", times=6)
            trajs = [
                Trajectory("X", i, "openai/gsm8k", response=f"#### {i % 2}", ground_truth="1") for i in range(1, 20)
            ]
            results = await asyncio.wait_for(
                asyncio.gather(*(producer.score(t, timeout_s=40) for t in trajs)),
                60,
            )
            assert proxy.cuts >= 1, "no XREAD reply was lost: nothing tested"
            for t, r in zip(trajs, results):
                assert (r.index, r.status, r.score) == (t.index, "ok", float(t.index % 2))


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


async def test_a_multi_partition_flush_whose_reply_is_lost_counts_each_sample_once(redis_url, namespace) -> None:
    """One flush of several EVALSHA calls (3 partitions, pipelined): the replies are lost
    after all ran; the retry finds every sample a duplicate and nothing is counted twice."""
    config = ProducerConfig(namespace=namespace, partitions=3)
    keys = Keys(namespace, 3)
    admin = connect(redis_url)
    try:
        async with CutProxy(redis_url[len("unix://") :]) as proxy:
            async with RolloutProducer(proxy.url, config) as producer:
                await producer.open_batch("p", 60, 4)
                await producer.push_many([Trajectory("p", i, "test", response="a") for i in range(30)])
                proxy.arm(b"EVALSHA")
                n = await asyncio.wait_for(
                    producer.push_many([Trajectory("p", i, "test", response="a") for i in range(30, 60)]), 10
                )
                assert n == 30 and proxy.cuts == 1
        counts = [int(await admin.hget(keys.pushed(p), "samples") or 0) for p in range(3)]
        assert sum(counts) == 60 and sum(1 for c in counts if c) >= 2, counts
    finally:
        await admin.aclose()


async def test_closing_the_producer_leaves_no_connection_of_its_lanes(redis_url, namespace, spawn_workers) -> None:
    spawn_workers(1)
    name = f"bye-{namespace}"
    admin = connect(redis_url)
    try:
        async with RolloutProducer(f"{redis_url}?client_name={name}", ProducerConfig(namespace=namespace)) as p:
            await p.open_batch("z", 4, 4)
            results = await asyncio.gather(
                *(
                    p.score(Trajectory("z", i, "openai/gsm8k", response="#### 2", ground_truth="2"), timeout_s=30)
                    for i in range(4)
                )
            )
            assert [r.score for r in results] == [1.0] * 4
            assert p._lane is not None and p._lane._protocol is not None
            (reader,) = p._listener._readers.values()
            assert reader.lane is not None and reader.lane._protocol is not None
        assert await settle_named(admin, name, 0) == 0
    finally:
        await admin.aclose()
    assert no_unclosed_transports() == []
