"""The producer's flush (trainer/flush.py): a coalesced group of pushes sent in one round trip.

It promises: each sample is queued exactly once whatever path the flush took (packed on
the producer's lane, or a redis-py pipeline for clients the lane refuses), whatever went
wrong around it: a connection killed mid-flush or a reply lost after the script ran (sent
again, found as a duplicate), a server answering LOADING, refusing for now (OOM at
maxmemory, BUSY under a long script: waited out), a server that lost its scripts (loaded
again) or restarted mid-push; a server gone for good is a BrokerError.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from helpers import CutProxy, lane_client_id, queued, stream_samples, traj, wait_until
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from stream_reward import ProducerConfig, RolloutProducer, Trajectory
from stream_reward.errors import BrokerError, PushConflictError
from stream_reward.ops.embedded import EmbeddedServer
from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys
from stream_reward.wire.packed import pack_command

pytestmark = pytest.mark.anyio


async def test_a_push_after_the_server_lost_its_scripts_loads_them_again(redis_url, namespace) -> None:
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
        await producer.open_batch("b", 300, 8)
        await producer.push_many([traj("b", i) for i in range(100)])
        client = connect(redis_url)
        try:
            await client.script_flush()
        finally:
            await client.aclose()
        await producer.push_many([traj("b", i) for i in range(100, 300)])  # two script calls, both NOSCRIPT
        assert await stream_samples(redis_url, producer) == [(f"b/{i}", i) for i in range(300)]


async def test_the_pipeline_path_of_a_single_connection_client_queues_once(redis_url, namespace) -> None:
    """A client with a pinned connection takes redis-py's pipeline, not the packed send: the same verdicts."""
    import redis.asyncio as aredis

    client = aredis.Redis.from_url(redis_url, single_connection_client=True)
    try:
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace), client=client) as p:
            await p.open_batch("s", 600, 8)
            await p.push_many([traj("s", i) for i in range(300)])
            await client.script_flush()
            async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace), client=client) as q:
                with pytest.raises(PushConflictError, match="index 5"):
                    await q.push_many([traj("s", i) for i in range(200, 600)] + [traj("s", 5, uid="z")])
            assert sorted(i for _, _, i in await queued(redis_url, p.keys)) == list(range(600))
    finally:
        await client.aclose()


async def test_connections_killed_under_pushes_queue_each_sample_once(redis_url, namespace) -> None:
    """CLIENT KILL TYPE normal from another thread, over and over, while large pushes are in flight."""
    import threading

    import redis

    config = ProducerConfig(namespace=namespace)
    stop = threading.Event()
    kills = [0]

    def killer() -> None:
        admin = redis.Redis.from_url(redis_url)
        try:
            while not stop.is_set():
                kills[0] += admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
                stop.wait(0.01)
        finally:
            admin.close()

    async with RolloutProducer(redis_url, config) as p:
        await p.open_batch("k", 3000, 8)
        thread = threading.Thread(target=killer)
        thread.start()
        failures: list[BaseException] = []
        try:
            for lo in range(0, 3000, 300):
                chunk = [traj("k", i, response="x" * 4000) for i in range(lo, lo + 300)]
                for _attempt in range(200):
                    try:
                        await p.push_many(chunk)
                        break
                    except BrokerError as exc:  # a retry of the whole call is safe
                        failures.append(exc)
                else:
                    raise AssertionError(f"never pushed: {failures[-1]!r}")
        finally:
            stop.set()
            thread.join()
        got = await queued(redis_url, p.keys)
    assert kills[0] > 0
    assert sorted(i for _, _, i in got) == list(range(3000)), (len(got), len(set(got)), kills, failures[:3])


async def test_script_flush_before_a_slow_path_call_is_recovered(redis_url, namespace) -> None:
    config = ProducerConfig(namespace=namespace)
    async with RolloutProducer(redis_url, config) as a, RolloutProducer(redis_url, config) as b:
        await a.open_batch("f", 600, 8)
        await a.push_many([traj("f", i) for i in range(300)])
        await b.push_many([traj("f", 0)])  # b's script is loaded
        admin = connect(redis_url)
        try:
            await admin.script_flush()
        finally:
            await admin.aclose()
        # duplicates + fresh + a conflict, over two script calls, after the cache is gone
        call = [traj("f", i) for i in range(250, 600)] + [traj("f", 1, uid="z")]
        with pytest.raises(PushConflictError, match="index 1"):
            await b.push_many(call)
        got = await queued(redis_url, a.keys)
        assert sorted(i for _, _, i in got) == list(range(600))


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


async def _memory_refusals(admin: Redis) -> int:
    """How many commands the server has refused with OOM since it started."""
    stats = await admin.info("errorstats")
    return int(stats.get("errorstat_OOM", {}).get("count", 0))


async def test_a_push_refused_for_memory_lands_once_memory_is_back(own_url, namespace) -> None:
    """``OOM command not allowed`` (noeviction at maxmemory) is the server's "not now", not
    a failed step: the push waits it out with backoff and lands once memory frees, each
    sample once."""
    admin = connect(own_url)
    try:
        async with RolloutProducer(own_url, ProducerConfig(namespace=namespace)) as producer:
            await producer.push_many([traj("warm", 0)])  # scripts loaded, groups made
            await admin.config_set("maxmemory", 1)  # below what is used: every write is refused
            push = asyncio.ensure_future(producer.push_many([traj("m", i) for i in range(3)]))

            async def refused_twice() -> bool:
                return push.done() or await _memory_refusals(admin) >= 2

            await wait_until(refused_twice)
            assert not push.done(), push.exception()
            await admin.config_set("maxmemory", 0)
            await asyncio.wait_for(push, 30)
            assert [s for s in await stream_samples(own_url, producer) if s[0].startswith("m")] == [
                (f"m/{i}", i) for i in range(3)
            ]
    finally:
        await admin.aclose()


async def test_a_push_refused_by_a_busy_script_lands_once_the_script_ends(own_url, namespace, caplog) -> None:
    """A script running past ``busy-reply-threshold`` makes the server answer ``BUSY`` to
    everyone else: the push waits it out, logging the server's words, and lands once the
    script is killed."""
    admin = connect(own_url)
    hog = connect(own_url, timeout_s=None)  # its script runs until killed
    loop_forever = None
    try:
        await admin.config_set("busy-reply-threshold", 50)
        async with RolloutProducer(own_url, ProducerConfig(namespace=namespace)) as producer:
            await producer.push_many([traj("warm", 0)])  # scripts loaded, groups made
            loop_forever = asyncio.ensure_future(hog.eval("while true do end", 0))

            async def busy() -> bool:
                try:
                    await admin.ping()
                except ResponseError as exc:
                    return str(exc).startswith("BUSY")
                return False

            await wait_until(busy)
            push = asyncio.ensure_future(producer.push_many([traj("b", i) for i in range(3)]))

            async def refused() -> bool:
                return push.done() or any("BUSY" in r.getMessage() for r in caplog.records)

            await wait_until(refused)
            assert not push.done(), push.exception()
            await admin.script_kill()
            await asyncio.wait_for(push, 30)
            assert [s for s in await stream_samples(own_url, producer) if s[0].startswith("b")] == [
                (f"b/{i}", i) for i in range(3)
            ]
    finally:
        if loop_forever is not None:
            with contextlib.suppress(ResponseError):
                await admin.script_kill()  # NOTBUSY once it is gone
            await asyncio.gather(loop_forever, return_exceptions=True)
        await admin.aclose()
        await hog.aclose()
