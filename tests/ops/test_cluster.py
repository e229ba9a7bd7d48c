"""Partitioned namespaces, on a single node and across a local 3-master Redis Cluster."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator

import pytest
from helpers import done_results, refusals_of_pushes_that_fit, samples_of, wait_until

from stream_reward import ProducerConfig, RewardAggregator, RolloutProducer, Trajectory
from stream_reward.config import ConsumerConfig
from stream_reward.ops.cluster import LocalCluster
from stream_reward.ops.deadletters import list_dead_letters, redrive_dead_letters
from stream_reward.scoring.registry import RuleScorer
from stream_reward.wire.codec import encode_trajectory
from stream_reward.wire.connection import connect
from stream_reward.wire.entries import entry_fields
from stream_reward.wire.keys import Keys, key_slot
from stream_reward.worker.consumer import Worker

pytestmark = pytest.mark.anyio

ECHO = "python:tests/data/cluster_scorers.py:echo_slow"
HOLD_ENV = "SR_TEST_HOLD_FILE"  # as in tests/data/cluster_scorers.py
GROUP_SIZE = 5


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(masters=3) as local:
        yield local


def echo_batch(batch_id: str, n: int, sleep_s: float = 0.0, holdable: int = 0) -> tuple[list[Trajectory], list[float]]:
    """Samples in GRPO groups of GROUP_SIZE whose score is their own number; with
    ``holdable`` k, every k-th is marked holdable (see tests/data/cluster_scorers.py)."""
    trajs, expected = [], []
    for i in range(n):
        score = round((i * 37 % 101) / 100, 2)
        trajs.append(
            Trajectory(
                batch_id,
                i,
                "test/echo",
                response=str(score),
                valid_response_length=1 + i % 7,
                group=f"{batch_id}-g{i // GROUP_SIZE}",
                extra_info={"sleep_s": sleep_s, **({"holdable": True} if holdable and i % holdable == 0 else {})},
            )
        )
        expected.append(score)
    return trajs, expected


async def ledger_uids(client, keys: Keys, batch_id: str) -> list[set[str]]:
    """The uids in each partition's write-once ledger of the batch, after checking
    that its done stream holds exactly one entry per ledger entry."""
    out = []
    for p in range(keys.partitions):
        ledger = await client.hgetall(keys.results(batch_id, p))
        done = await done_results(client, keys.done(batch_id, p))
        assert sorted(r.uid for r in done) == sorted(u.decode() for u in ledger)
        out.append({u.decode() for u in ledger})
    return out


def test_partition_tags_spread_one_namespace_over_every_master(cluster):
    for namespace in ("sr", "bench", "t0123456789"):
        for partitions in (3, 6, 12):
            keys = Keys(namespace, partitions)
            masters = [cluster.node_of_slot(key_slot(keys.stream(p))) for p in range(partitions)]
            assert sorted(masters.count(port) for port in cluster.ports) == [partitions // 3] * 3, (
                namespace,
                partitions,
            )
            for p in range(partitions):  # every key of a partition is in its stream's slot
                slot = key_slot(keys.stream(p))
                assert {
                    key_slot(k)
                    for k in (keys.results("b", p), keys.done("b", p), keys.dead_letters(p), keys.quarantine(p))
                } == {slot}
    assert Keys("sr", 3).tag(0) == Keys("sr").tag(0) == "{sr}"


async def test_groups_stay_in_one_partition_and_the_aggregator_gathers_them_all(redis_url, namespace):
    n, partitions = 200, 3
    trajs, expected = echo_batch("single", n)
    keys = Keys(namespace, partitions)
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace, partitions=partitions)) as producer:
        await producer.open_batch("single", n, 8)
        await producer.push_many(trajs)
        groups_by_partition = []
        for p in range(partitions):
            entries = await producer.client.xrange(keys.stream(p))
            groups_by_partition.append({t.group or "" for _, f in entries for t in samples_of(f)})
    # Every partition got work, and no GRPO group is split between two of them.
    assert all(groups_by_partition)
    assert sum(len(g) for g in groups_by_partition) == n // GROUP_SIZE
    from stream_reward.config import ManagerConfig
    from stream_reward.scoring.registry import build_scorer

    worker = Worker(
        redis_url,
        build_scorer(ManagerConfig(scorer=ECHO)),
        ConsumerConfig(namespace=namespace, partitions=partitions, block_ms=50),
    )
    try:
        await asyncio.wait_for(worker.run(burst=True), 30)
    finally:
        await worker.aclose()
    async with RewardAggregator(redis_url, namespace=namespace) as agg:  # partitions from the batch meta
        landed = [r.group async for r in agg.stream("single", timeout_s=10)]
        rewards = await agg.collect("single", timeout_s=10)
    assert rewards.scores == expected and rewards.status == ["ok"] * n
    assert len(landed) == n
    client = connect(redis_url)
    try:
        ledgers = await ledger_uids(client, keys, "single")
    finally:
        await client.aclose()
    for p, uids in enumerate(ledgers):
        assert uids == {t.uid for t in trajs if keys.partition_of(t.uid, t.group) == p}


@pytest.mark.parametrize("late", [False, True], ids=["holding-entries", "half-scored"])
async def test_cluster_workers_lose_nothing_when_one_is_killed_mid_batch(
    cluster, namespace, spawn_workers, late, tmp_path, monkeypatch
):
    n, partitions = 300, 3
    keys = Keys(namespace, partitions)
    args = ("--partitions", str(partitions), "--scorer", ECHO, "--reclaim-idle-ms", "800", "--concurrency", "30")
    # The victim (only it) holds every 4th sample until it is killed: it has entries pending
    # from its first held sample on, however late the kill comes. With the batch's 1.25 s of
    # scoring free, a loaded test could poll past its end (victim_is_busy never true again),
    # or the survivor could score all of it while the victim was still starting.
    hold = tmp_path / "hold"
    hold.touch()
    monkeypatch.setenv(HOLD_ENV, str(hold))
    (victim,) = spawn_workers(1, *args, "--consumer", "victim", url=cluster.url)
    monkeypatch.delenv(HOLD_ENV)
    (survivor,) = spawn_workers(1, *args, "--consumer", "survivor", url=cluster.url)
    trajs, expected = echo_batch("kill", n, sleep_s=0.25, holdable=4)
    client = connect(cluster.url)
    try:

        async def both_joined() -> bool:  # heartbeats in: neither is still starting
            return await client.hlen(keys.workers()) >= 2

        await wait_until(both_joined, timeout_s=30)
        async with (
            RolloutProducer(cluster.url, ProducerConfig(namespace=namespace, partitions=partitions)) as producer,
            RewardAggregator(cluster.url, namespace=namespace) as agg,
        ):
            await producer.open_batch("kill", n, 8)
            await producer.push_many(trajs)

            async def victim_pending() -> int:
                total = 0
                for p in range(partitions):
                    summary = await client.xpending(keys.stream(p), "scorers")
                    total += sum(c["pending"] for c in summary["consumers"] if c["name"] == b"victim")
                return total

            async def victim_is_busy() -> bool:
                if late:  # it holds samples handed back and entries partly settled by now
                    scored = sum([await client.hlen(keys.results("kill", p)) for p in range(partitions)])
                    if scored < n // 2:
                        return False
                return await victim_pending() >= 1  # entries (of up to 16 samples, or one handed back)

            await wait_until(victim_is_busy)
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            stranded = await victim_pending()
            assert stranded > 0
            rewards = await agg.collect("kill", timeout_s=60)

        assert rewards.status == ["ok"] * n
        assert rewards.indices == list(range(n))
        assert rewards.scores == expected  # every sample got its own score, none another's
        assert survivor.pid in set(rewards.reward_extra_info["pid"])
        ledgers = await ledger_uids(client, keys, "kill")
        # One result per uid in all, each in the partition of its group: none lost, none twice.
        assert sum(len(u) for u in ledgers) == n
        for p, uids in enumerate(ledgers):
            assert uids == {t.uid for t in trajs if keys.partition_of(t.uid, t.group) == p}

        # Every entry, the victim's included, is acked. An entry's ack can trail its samples'
        # results: the last of them may have been scored from a copy a worker handed back.
        async def all_acked() -> bool:
            return all([(await client.xpending(keys.stream(p), "scorers"))["pending"] == 0 for p in range(partitions)])

        await wait_until(all_acked, timeout_s=20)
        beats = await client.hgetall(keys.workers())
        assert b"survivor" in beats
    finally:
        await client.aclose()


async def test_dead_letters_status_and_redrive_on_a_cluster(cluster, namespace):
    from stream_reward.ops.status import read_status

    partitions = 6
    keys = Keys(namespace, partitions)
    good = [
        Trajectory("dl", i, "openai/gsm8k", response=f"#### {i}", ground_truth=str(i), group=f"g{i}") for i in range(11)
    ]
    async with RolloutProducer(cluster.url, ProducerConfig(namespace=namespace, partitions=partitions)) as producer:
        await producer.open_batch("dl", 12, 4)
        await producer.push_many(good)
        bad_partition = keys.partition_of("dl/11", "g11")
        await producer.client.xadd(keys.stream(bad_partition), entry_fields(b"\xc1garbage", "dl", 11, "dl/11"))
        status = await read_status(cluster.url, namespace, partitions=partitions)
    assert status["partitions"] == partitions
    assert sum(s["samples_pushed"] for s in status["streams"]) == 11  # the garbled one went past the producer
    assert sum(s["length"] for s in status["streams"]) >= 2
    # The lag in samples, read per partition on the node that owns it: every stamped entry
    # pushed is undelivered (the garbled one, XADDed by hand, is in no count).
    rows = [(s, g) for s in status["streams"] for g in s["groups"]]
    assert rows and all(g["lag_samples"] is not None for _, g in rows)
    assert all(g["lag_samples"] == s["samples_pushed"] for s, g in rows if g["lag_samples_exact"])
    worker = Worker(cluster.url, RuleScorer(), ConsumerConfig(namespace=namespace, partitions=partitions, block_ms=50))
    try:
        await asyncio.wait_for(worker.run(burst=True), 30)
    finally:
        await worker.aclose()
    assert worker.stats.scored == 11 and worker.stats.dead_letters == 1
    async with RewardAggregator(cluster.url, namespace=namespace) as agg:
        rewards = await agg.collect("dl", timeout_s=10)
    assert rewards.status == ["ok"] * 11 + ["failed"] and rewards.results[11].reason == "malformed"
    letters = await list_dead_letters(cluster.url, namespace=namespace, partitions=partitions)
    assert [(d.partition, d.reason) for d in letters] == [(bad_partition, "malformed")]
    assert await redrive_dead_letters(cluster.url, namespace=namespace, partitions=partitions) == 1
    assert await list_dead_letters(cluster.url, namespace=namespace, partitions=partitions) == []
    client = connect(cluster.url)
    try:
        assert await client.xlen(keys.stream(bad_partition)) >= 1  # back on its own partition's stream
        assert encode_trajectory  # the codec is the one the workers use
    finally:
        await client.aclose()


async def test_a_master_killed_and_restarted_mid_batch_loses_nothing(namespace, spawn_workers):
    n, partitions = 240, 3
    keys = Keys(namespace, partitions)
    with LocalCluster(masters=3, appendonly=True) as local:
        spawn_workers(
            2,
            "--partitions",
            str(partitions),
            "--scorer",
            ECHO,
            "--reclaim-idle-ms",
            "1000",
            "--concurrency",
            "10",
            url=local.url,
        )
        trajs, expected = echo_batch("outage", n, sleep_s=0.2)
        in_partition_1 = sum(1 for t in trajs if keys.partition_of(t.uid, t.group) == 1)
        async with (
            RolloutProducer(local.url, ProducerConfig(namespace=namespace, partitions=partitions)) as producer,
            RewardAggregator(local.url, namespace=namespace) as agg,
        ):
            await producer.open_batch("outage", n, 8)
            await producer.push_many(trajs)
            client = connect(local.url)
            try:

                async def some_scored() -> bool:
                    return await client.hlen(keys.results("outage", 1)) >= 5

                await wait_until(some_scored)
                assert await client.hlen(keys.results("outage", 1)) < in_partition_1  # mid-batch
                victim = local.ports.index(local.node_of_slot(key_slot(keys.stream(1))))
                local.kill_node(victim)  # partition 1's master, with entries pending on it
                await asyncio.sleep(1.5)
                await asyncio.get_running_loop().run_in_executor(None, local.restart_node, victim)
                rewards = await agg.collect("outage", timeout_s=60)
                ledgers = await ledger_uids(client, keys, "outage")
            finally:
                await client.aclose()
    assert rewards.status == ["ok"] * n and rewards.scores == expected
    assert sum(len(u) for u in ledgers) == n


async def test_a_cluster_client_never_loses_the_node_its_url_named(cluster):
    """redis-py drops a startup node on each connection error; with every one dropped
    (a killed master under concurrent commands) it never reconnects (redis-py#3693)."""
    from stream_reward.wire.connection import connect

    client = connect(cluster.url)
    try:
        await client.ping()
        startup = client.nodes_manager.startup_nodes
        for name in list(startup):
            startup.pop(name, None)  # what a burst of connection errors does
        await client.nodes_manager.initialize()  # finds the cluster again from the URL's node
        assert await client.ping()
    finally:
        await client.aclose()


async def test_a_push_landing_during_a_backlog_reading_is_counted_once_on_a_cluster(cluster, namespace):
    """As tests/trainer/test_backlog.py on one node: there each partition's reading and push
    go to the partition's own master, and a push's reply still places it against the reading."""
    refused = await refusals_of_pushes_that_fit(cluster.url, namespace, partitions=3, rounds=8)
    assert not refused, f"{len(refused)} of 8 rounds refused a push that fit: {refused[:3]}"


async def test_a_push_one_master_refused_for_memory_records_every_length(cluster, namespace, caplog):
    """One master at ``maxmemory`` refuses its partition's part of a push while the others
    land. The retry finds those as duplicates: their response lengths are still recorded
    (a sample resolved by a deadline keeps the right last column)."""
    partitions = 3
    keys = Keys(namespace, partitions)
    victim = connect(f"redis://127.0.0.1:{cluster.node_of_slot(key_slot(keys.stream(1)))}")
    client = connect(cluster.url)
    trajs = [Trajectory("b", i, "test", response="r", ground_truth="r", valid_response_length=i + 1) for i in range(12)]
    assert len({keys.partition_of(t.uid) for t in trajs}) == partitions
    try:
        async with RolloutProducer(cluster.url, ProducerConfig(namespace=namespace, partitions=partitions)) as producer:
            await producer.open_batch("b", len(trajs), 16)
            await victim.config_set("maxmemory", 1)  # below what is used: this master refuses writes
            push = asyncio.ensure_future(producer.push_many(trajs))

            async def refused() -> bool:
                return push.done() or any("OutOfMemoryError" in r.getMessage() for r in caplog.records)

            await wait_until(refused)
            assert not push.done(), push.exception()
            await victim.config_set("maxmemory", 0)
            await asyncio.wait_for(push, 30)
            lengths = await client.hgetall(keys.lengths("b"))
        recorded = {int(k): int(v) for k, v in lengths.items() if k.isdigit()}  # (other fields: the batch's own)
        assert recorded == {i: i + 1 for i in range(len(trajs))}
    finally:
        await victim.config_set("maxmemory", 0)
        await victim.aclose()
        await client.aclose()
