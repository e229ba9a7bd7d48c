"""Attacks on entries of several samples (protocol 4): hand-back, ack with the last sample,
quarantine sample by sample, stops mid-entry, and max_backlog counted in samples."""

from __future__ import annotations

import asyncio
import functools
import random

import pytest
from helpers import Timed, exact_traj, identity_score, running_worker, samples_of, started, undelivered_samples

from stream_reward import ProducerConfig, RewardAggregator, RolloutProducer, Trajectory
from stream_reward.config import ConsumerConfig
from stream_reward.errors import BackpressureError
from stream_reward.scoring.scorer import Scored
from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys
from stream_reward.worker.consumer import Worker

pytestmark = pytest.mark.anyio


traj, expected, Ident = exact_traj, identity_score, Timed
# Its workers read with block_ms=50 and drain within 0.2 s.
running_worker = functools.partial(running_worker, block_ms=50, drain_timeout_s=0.2)


# ======================================================================================
# max_backlog counted in samples


async def test_backlog_of_a_producer_is_never_below_the_truth_when_another_pushes_bigger_entries(
    redis_url, namespace
) -> None:
    """Producer B queues 100 samples one per entry, then producer A 96 samples in entries of
    16. B's backlog() counts the newest lag entries as its own (1 sample each): it must still
    not report fewer samples than are queued, or it lets B run past max_backlog."""
    keys = Keys(namespace)
    client = connect(redis_url)
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as b,
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as a,
        ):
            await b.open_batch("x", 196, 8)
            for i in range(100):
                await b.push(traj("x", i))
            await a.push_many(traj("x", i) for i in range(100, 196))
            truth = await undelivered_samples(client, keys)
            assert truth == 196
            assert await a.backlog() >= truth
            assert await b.backlog() >= truth, "producer B under-counts the backlog"
    finally:
        await client.aclose()


async def test_max_backlog_is_not_exceeded_by_more_than_a_push_with_two_producers(redis_url, namespace) -> None:
    """No worker: B pushes one sample at a time with on_backlog='raise' until refused. The
    queued samples must not pass max_backlog by more than one push (1 sample)."""
    keys = Keys(namespace)
    client = connect(redis_url)
    limit = 200
    cfg = dict(namespace=namespace, max_backlog=limit, on_backlog="raise", backlog_poll_s=0.0)
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(**cfg, samples_per_entry=1)) as b,
            RolloutProducer(redis_url, ProducerConfig(**cfg, samples_per_entry=16)) as a,
        ):
            await b.open_batch("x", 1000, 8)
            for i in range(100):
                await b.push(traj("x", i))
            await a.push_many(traj("x", i) for i in range(100, 196))
            i = 196
            with pytest.raises(BackpressureError):
                while i < 1000:
                    await b.push(traj("x", i))
                    i += 1
            truth = await undelivered_samples(client, keys)
            assert truth <= limit + 1, f"{truth} samples queued with max_backlog={limit}"
    finally:
        await client.aclose()


# ======================================================================================
# Workers stopped mid-entry, hand-back under load


async def check_batch(redis_url: str, namespace: str, batch: str, n: int, agg: RewardAggregator, timeout_s: float):
    """Every sample once, with its own score; nothing pending; no dead letter."""
    from helpers import done_results

    from stream_reward.ops.deadletters import list_dead_letters

    rewards = await agg.collect(batch, timeout_s=timeout_s, on_timeout="resolve")
    bad = [(r.index, r.status, r.reason) for r in rewards.results if r.status != "ok"]
    assert not bad, bad
    assert rewards.indices == list(range(n))
    assert rewards.scores == [expected(traj(batch, i)) for i in range(n)], "a sample got another's score"
    keys = Keys(namespace)
    client = connect(redis_url)
    try:
        assert await client.hlen(keys.results(batch)) == n
        done = await done_results(client, keys.done(batch))
        uids = [r.uid for r in done]
        assert len(uids) == len(set(uids)) == n, "a sample reported twice"

        async def nothing_pending() -> bool:
            return (await client.xpending(keys.stream(), "scorers"))["pending"] == 0

        from helpers import wait_until

        await wait_until(nothing_pending, timeout_s=20)
    finally:
        await client.aclose()
    assert await list_dead_letters(redis_url, namespace=namespace) == []


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_a_worker_stopped_mid_entry_again_and_again_loses_and_repeats_nothing(redis_url, namespace, seed) -> None:
    """Entries of 16, a slow scorer, concurrency 3 (so every entry is mostly handed back), two
    workers; one is stopped at random moments and replaced by a fresh consumer."""
    rnd = random.Random(seed)
    n = 160
    base = dict(namespace=namespace, block_ms=20, concurrency=3, reclaim_idle_ms=1500, drain_timeout_s=0.3)
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await producer.open_batch("b", n, 8)
        await producer.push_many(traj("b", i) for i in range(n))
        steady_stop = asyncio.Event()
        steady = Worker(redis_url, Ident(0.01, 0.03), ConsumerConfig(consumer="steady", **base))
        steady_task = asyncio.ensure_future(steady.run(steady_stop))
        try:
            for round_ in range(6):
                stop = asyncio.Event()
                w = Worker(redis_url, Ident(0.01, 0.05), ConsumerConfig(consumer=f"flaky{round_}", **base))
                task = asyncio.ensure_future(w.run(stop))
                await asyncio.sleep(rnd.uniform(0.05, 0.5))
                stop.set()
                await asyncio.wait_for(task, 20)
                await w.aclose()
            await check_batch(redis_url, namespace, "b", n, agg, timeout_s=40)
        finally:
            steady_stop.set()
            await asyncio.wait_for(steady_task, 20)
            await steady.aclose()


async def test_a_stop_releases_every_entry_of_the_last_read_not_only_the_opened_ones(redis_url, namespace) -> None:
    """The first read of a worker with concurrency 3 asks for 3 entries (it guesses 1 sample
    an entry) and gets 3 entries of 16. A stop while it waits for room for the second entry's
    first sample: the third entry was delivered to it but never opened. It must be released
    too (as main released every entry of a read), not left pending until reclaim_idle_ms."""
    keys = Keys(namespace)
    n = 48
    client = connect(redis_url)
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await producer.open_batch("b", n, 8)
            await producer.push_many(traj("b", i) for i in range(n))
            assert await client.xlen(keys.stream()) == 3
            base = dict(namespace=namespace, block_ms=20, concurrency=3, reclaim_idle_ms=60_000, drain_timeout_s=3)
            stop = asyncio.Event()
            w = Worker(redis_url, Ident(0.5), ConsumerConfig(consumer="first", **base))
            task = asyncio.ensure_future(w.run(stop))

            async def busy() -> bool:
                return w.stats.in_flight >= 3

            from helpers import wait_until

            await wait_until(busy, timeout_s=10, every_s=0.005)
            await asyncio.sleep(0.05)
            stop.set()
            await asyncio.wait_for(task, 20)
            await w.aclose()
            # A burst worker takes what was released (idle at once) and what is in the stream.
            w2 = Worker(redis_url, Ident(), ConsumerConfig(consumer="second", **base))
            await asyncio.wait_for(w2.run(asyncio.Event(), burst=True), 30)
            await w2.aclose()
            left = await client.xpending_range(keys.stream(), "scorers", min="-", max="+", count=100)
            assert left == [], f"entries left pending under the stopped consumer: {left}"
            rewards = await agg.collect("b", timeout_s=3, on_timeout="resolve")
            assert rewards.status == ["ok"] * n
    finally:
        await client.aclose()


SLOW = "python:tests/data/reliability_scorers.py:slow"


def slow_traj(batch: str, i: int, sleep_s: float, poison: bool = False, hold: str | None = None) -> Trajectory:
    """``hold``: a file; the sample is not finished while it exists."""
    return Trajectory(
        batch,
        i,
        "test",
        response="poison" if poison else "ok",
        valid_response_length=1,
        extra_info={"sleep_s": sleep_s, **({"hold": hold} if hold else {})},
    )


async def test_sigkill_between_hand_back_and_the_source_ack_scores_each_sample_once(
    redis_url, namespace, spawn_workers, tmp_path
) -> None:
    """A worker of concurrency 3 takes entries of 16 and hands 13 of each back; it is SIGKILLed
    while the source entries are still pending. The survivor scores the redelivered source
    entries and the handed-back copies: one result per uid, every entry acked, no dead letter."""
    import signal

    from helpers import done_results, wait_until

    from stream_reward.ops.deadletters import list_dead_letters
    from stream_reward.wire.entries import FIELD_HANDED_BACK

    keys = Keys(namespace)
    n = 64
    args = ("--scorer", SLOW, "--reclaim-idle-ms", "600", "--concurrency", "3")
    # Every sample is held until the victim is dead: its source entries are still pending at
    # the kill however late the kill comes (with a bare 0.3 s scorer a loaded test could
    # kill after the acks, and miss its moment).
    hold = tmp_path / "hold"
    hold.touch()
    client = connect(redis_url)
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await producer.open_batch("k", n, 4)
            await producer.push_many(slow_traj("k", i, 0.3, hold=str(hold)) for i in range(n))
            assert await client.xlen(keys.stream()) == 4
            (victim,) = spawn_workers(1, *args)

            async def handed_back() -> bool:
                return any(FIELD_HANDED_BACK in f for _, f in await client.xrange(keys.stream()))

            await wait_until(handed_back, timeout_s=20, every_s=0.01)
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            pending = await client.xpending_range(keys.stream(), "scorers", min="-", max="+", count=100)
            assert pending, "the victim had acked its source entries already: the test missed its moment"
            hold.unlink()
            spawn_workers(1, *args)
            rewards = await agg.collect("k", timeout_s=60, on_timeout="resolve")
            assert rewards.status == ["ok"] * n, [
                (r.index, r.status, r.reason) for r in rewards.results if r.status != "ok"
            ]
            assert await client.hlen(keys.results("k")) == n
            uids = [r.uid for r in await done_results(client, keys.done("k"))]
            assert sorted(uids) == sorted(set(uids)) and len(uids) == n

            async def nothing_pending() -> bool:
                return (await client.xpending(keys.stream(), "scorers"))["pending"] == 0

            await wait_until(nothing_pending, timeout_s=20)
            assert await list_dead_letters(redis_url, namespace=namespace) == []
    finally:
        await client.aclose()


async def test_after_a_sigkill_the_samples_a_worker_handed_back_are_not_scored_again_from_their_source(
    redis_url, namespace, spawn_workers, tmp_path
) -> None:
    """A worker of concurrency 3 takes entries of 16, starts 3 of each and hands 13 back; it
    is SIGKILLed before the source entries are acked. The survivor reclaims the sources: the
    samples handed back are already queued on their own, and scoring them from the source
    too spends the verifier's quota twice (the ledger keeps one result, but each call is paid)."""
    import signal
    from collections import Counter

    from helpers import wait_until

    from stream_reward.wire.entries import FIELD_HANDED_BACK

    keys = Keys(namespace)
    n = 32
    log = tmp_path / "calls.log"
    log.touch()
    # The second entry's samples are held until the victim is dead (it hands that entry back
    # once it has scored the first's 3): that source is still pending at the kill however
    # late the kill comes. With a bare 0.5 s scorer a loaded test could kill after its ack,
    # leaving the survivor nothing to score twice: the test would pass without testing.
    hold = tmp_path / "hold"
    hold.touch()
    args = ("--scorer", "python:tests/data/reliability_scorers.py:logged", "--reclaim-idle-ms", "600")
    client = connect(redis_url)
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await producer.open_batch("h", n, 4)
            await producer.push_many(
                Trajectory(
                    "h",
                    i,
                    "test",
                    response="ok",
                    extra_info={"sleep_s": 0.5, "tag": i, "log": str(log), **({"hold": str(hold)} if i >= 16 else {})},
                )
                for i in range(n)
            )
            (victim,) = spawn_workers(1, *args, "--concurrency", "3")

            async def handed_back() -> bool:
                copies = [f for _, f in await client.xrange(keys.stream()) if FIELD_HANDED_BACK in f]
                return len(copies) >= 2 * 13

            await wait_until(handed_back, timeout_s=20, every_s=0.01)
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            assert (await client.xpending(keys.stream(), "scorers"))["pending"], "the sources were acked already"
            hold.unlink()
            spawn_workers(1, *args, "--concurrency", "8")
            rewards = await agg.collect("h", timeout_s=60, on_timeout="resolve")
            assert rewards.status == ["ok"] * n
    finally:
        await client.aclose()
    calls = [line.split() for line in log.read_text().splitlines()]
    by_survivor = Counter(tag for tag, pid in calls if int(pid) != victim.pid)
    twice = sorted(int(tag) for tag, k in by_survivor.items() if k > 1)
    assert not twice, f"the survivor scored these samples twice (from the copy and from the source): {twice}"


@pytest.mark.parametrize("poison_at,n", [(0, 16), (15, 16), (7, 32)])
async def test_a_poison_sample_in_an_entry_of_several_is_dead_lettered_alone(
    redis_url, namespace, spawn_workers, poison_at, n
) -> None:
    """Worker processes die (exit 3) on the poison sample. Quarantine must pin the poison, and
    only it, whether it is the first or the last of its entry (or handed back)."""
    from stream_reward.ops.deadletters import list_dead_letters

    args = ("--scorer", SLOW, "--reclaim-idle-ms", "300", "--concurrency", "4")
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await producer.open_batch("p", n, 4)
        await producer.push_many(slow_traj("p", i, 0.01, poison=i == poison_at) for i in range(n))
        collect = asyncio.create_task(agg.collect("p", timeout_s=90))
        crashes = 0
        while not collect.done() and crashes < 12:
            (worker,) = spawn_workers(1, *args)
            while worker.poll() is None and not collect.done():
                await asyncio.sleep(0.05)
            if worker.poll() is not None:
                assert worker.returncode == 3
                crashes += 1
        rewards = await collect
    want = ["ok"] * n
    want[poison_at] = "failed"
    assert rewards.status == want, [(r.index, r.status, r.reason) for r in rewards.results if r.status != "ok"]
    assert rewards.results[poison_at].reason == "poison"
    letters = await list_dead_letters(redis_url, namespace=namespace)
    assert [(d.reason, d.summary()["index"]) for d in letters] == [("poison", poison_at)]
    assert crashes <= 4, crashes


@pytest.mark.parametrize("partitions,concurrency,stop_after", [(1, 3, None), (2, 5, None), (1, 3, 0.15), (2, 2, 0.1)])
async def test_burst_workers_finish_half_settled_entries_of_a_dead_consumer(
    redis_url, namespace, partitions, concurrency, stop_after
) -> None:
    """A dead consumer holds entries of 16 of which it wrote some samples' results (no ack:
    not the last sample). Burst workers (the first maybe stopped mid-run) must finish them:
    one result per sample, the first one kept, every entry acked, no dead letter."""
    import dataclasses

    from helpers import done_results

    from stream_reward.ops.deadletters import list_dead_letters
    from stream_reward.wire.codec import encode_result
    from stream_reward.wire.ledger import LedgerItem, LedgerWriter
    from stream_reward.wire.trajectory import ScoreResult

    keys = Keys(namespace, partitions)
    n = 96
    client = connect(redis_url)
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace, partitions=partitions)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await producer.open_batch("h", n, 8)
            await producer.push_many(traj("h", i) for i in range(n))
            held = await client.xreadgroup("scorers", "dead", {s: ">" for s in keys.streams()}, count=2)
            ledger = LedgerWriter(client, keys, "scorers", result_ttl_s=3600)
            prewritten = {}
            for stream, entries in held:
                part = keys.streams().index(stream.decode())
                items = []
                for eid, fields in entries:
                    for t in samples_of(fields)[::3]:  # every third sample settled by the dead worker
                        r = ScoreResult(t.uid, t.batch_id, t.index, expected(t), "ok", {}, scored_at=0.0)
                        items.append(LedgerItem(eid, t.batch_id, t.uid, encode_result(r), ack=False))
                        prewritten[t.index] = expected(t)
                await ledger.write(part, items)
            config = ConsumerConfig(
                namespace=namespace,
                partitions=partitions,
                block_ms=20,
                concurrency=concurrency,
                reclaim_idle_ms=0,
                drain_timeout_s=2,
                consumer="burst1",
            )
            stop = asyncio.Event()
            if stop_after is not None:
                asyncio.get_running_loop().call_later(stop_after, stop.set)
            w = Worker(redis_url, Ident(0.01, 0.04), config)
            await asyncio.wait_for(w.run(stop, burst=True), 60)
            await w.aclose()
            w2 = Worker(redis_url, Ident(0.0, 0.01), dataclasses.replace(config, consumer="burst2"))
            await asyncio.wait_for(w2.run(asyncio.Event(), burst=True), 60)
            await w2.aclose()
            pending = sum([(await client.xpending(s, "scorers"))["pending"] for s in keys.streams()])
            assert pending == 0, f"{pending} entries left pending"
            rewards = await agg.collect("h", timeout_s=3, on_timeout="resolve")
        assert rewards.status == ["ok"] * n, [
            (r.index, r.status, r.reason) for r in rewards.results if r.status != "ok"
        ]
        assert rewards.scores == [expected(traj("h", i)) for i in range(n)]
        uids = []
        for p in range(partitions):
            uids += [r.uid for r in await done_results(client, keys.done("h", p))]
        assert len(uids) == len(set(uids)) == n
        assert await list_dead_letters(redis_url, namespace=namespace, partitions=partitions) == []
    finally:
        await client.aclose()


# ======================================================================================
# Odd entries and settings


@pytest.mark.parametrize("value", [0, -1, 1025])
def test_an_invalid_samples_per_entry_is_a_config_error(value) -> None:
    from stream_reward.errors import ConfigError

    with pytest.raises(ConfigError, match="samples_per_entry"):
        ProducerConfig(samples_per_entry=value)


@pytest.mark.parametrize("per_entry", [1, 257])
async def test_samples_per_entry_one_and_257_queue_what_they_say(redis_url, namespace, per_entry) -> None:
    from helpers import queued

    keys = Keys(namespace)
    n = 600
    client = connect(redis_url)
    try:
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace, samples_per_entry=per_entry)) as p:
            await p.open_batch("s", n, 8)
            await p.push_many(traj("s", i) for i in range(n))
            sizes = [len(samples_of(f)) for _, f in await client.xrange(keys.stream())]
            assert max(sizes) <= per_entry and sum(sizes) == n
            assert sorted(q[2] for q in await queued(redis_url, keys)) == list(range(n))
            assert await p.backlog() == n
    finally:
        await client.aclose()


async def test_entries_never_pass_256_kib_unless_one_sample_does(redis_url, namespace) -> None:
    from stream_reward.wire.push import ENTRY_MAX_BYTES

    keys = Keys(namespace)
    sizes_kib = [100, 100, 100, 300, 10, 10, 250, 7, 1, 1, 1, 120, 130, 6]
    trajs = [
        Trajectory("z", i, "test/exact", response="x" * (k * 1024), ground_truth="1") for i, k in enumerate(sizes_kib)
    ]
    client = connect(redis_url)
    try:
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace, max_message_bytes=1 << 20)) as p:
            await p.open_batch("z", len(trajs), 8)
            await p.push_many(trajs)
        got = []
        for _, f in await client.xrange(keys.stream()):
            members = samples_of(f)
            assert len(members) == 1 or len(f[b"d"]) <= ENTRY_MAX_BYTES, (len(members), len(f[b"d"]))
            got += [t.index for t in members]
        assert got == list(range(len(trajs)))
        w = Worker(redis_url, Ident(), ConsumerConfig(namespace=namespace, block_ms=20, max_message_bytes=1 << 20))
        await asyncio.wait_for(w.run(burst=True), 30)
        await w.aclose()
        async with RewardAggregator(redis_url, namespace=namespace) as agg:
            rewards = await agg.collect("z", timeout_s=5)
        assert rewards.status == ["ok"] * len(trajs)
    finally:
        await client.aclose()


async def test_an_entry_with_a_raising_sample_a_garbled_one_and_a_repeated_uid(redis_url, namespace) -> None:
    """A crafted entry of 5: a sample the scorer raises on, a garbled payload, the same uid
    twice (first kept), and two plain ones. Each uid gets exactly one result; the entry is
    acked; only the garbled sample is dead-lettered."""
    from helpers import done_results

    from stream_reward.ops.deadletters import list_dead_letters
    from stream_reward.wire.codec import encode_trajectory
    from stream_reward.wire.entries import entry_header

    class Raises(Ident):
        async def score(self, t: Trajectory) -> Scored:
            if t.index == 1:
                raise RuntimeError("boom")
            return await super().score(t)

    keys = Keys(namespace)
    t = [traj("e", i) for i in range(4)]
    dup = Trajectory("e", 3, "test/exact", response="other", ground_truth="1")
    payloads = [
        encode_trajectory(t[0]),
        encode_trajectory(t[1]),
        b"\xc1garbage",
        encode_trajectory(t[3]),
        encode_trajectory(dup),
    ]
    heads = [("e", 0, "e/0"), ("e", 1, "e/1"), ("e", 2, "e/2"), ("e", 3, "e/3"), ("e", 3, "e/3")]
    fields = {
        "d": b"".join(payloads),
        "h": b"".join(entry_header(b, i, u, len(p)) for (b, i, u), p in zip(heads, payloads)),
    }
    client = connect(redis_url)
    try:
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
            await producer.open_batch("e", 4, 8)
            await producer.client.xadd(keys.stream(), fields)
        # concurrency 1: the rest of the entry is handed back and scored in stream order (first e/3 first)
        w = Worker(redis_url, Raises(0.01, 0.02), ConsumerConfig(namespace=namespace, block_ms=20, concurrency=1))
        await asyncio.wait_for(w.run(burst=True), 30)
        await w.aclose()
        async with RewardAggregator(redis_url, namespace=namespace) as agg:
            rewards = await agg.collect("e", timeout_s=5)
        assert rewards.status == ["ok", "failed", "failed", "ok"]
        assert rewards.results[1].reason == "scorer_error" and rewards.results[2].reason == "malformed"
        assert rewards.scores[3] == expected(t[3])
        uids = [r.uid for r in await done_results(client, keys.done("e"))]
        assert sorted(uids) == ["e/0", "e/1", "e/2", "e/3"]
        assert (await client.xpending(keys.stream(), "scorers"))["pending"] == 0
        assert [d.summary()["index"] for d in await list_dead_letters(redis_url, namespace=namespace)] == [2]
    finally:
        await client.aclose()


async def test_backlog_after_a_hand_back_is_not_counted_as_full_entries(redis_url, namespace) -> None:
    """Handed-back copies (an entry each, at the stream's tail) are the newest entries of the
    lag: the producer counts its own remembered entries (16 samples each) in their place and
    the rest at the mean (16): the backlog reads about 4x the truth, and a producer near
    max_backlog stalls at a quarter of it. (entry_sizes.py: "Counting them as full ones would
    be safe and far too high".)"""
    from helpers import wait_until

    keys = Keys(namespace)
    client = connect(redis_url)
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
            running_worker(redis_url, namespace, Ident(3.0), concurrency=3),
        ):
            await producer.open_batch("hb", 64, 8)
            await producer.push_many(traj("hb", i) for i in range(64))

            async def handed_back() -> bool:
                return await client.xlen(keys.stream()) == 4 + 13

            await wait_until(handed_back, timeout_s=10, every_s=0.01)
            truth = await undelivered_samples(client, keys)
            estimate = await producer.backlog()
            assert truth <= estimate <= 2 * truth, f"backlog() {estimate} for {truth} samples undelivered"
    finally:
        await client.aclose()


# ======================================================================================
# Quarantine of an entry of several


@pytest.mark.parametrize("stop_after", [0.05, 0.3, 0.75, 1.3])
async def test_a_stop_during_the_quarantine_of_an_entry_of_several_poisons_no_sample(
    redis_url, namespace, stop_after
) -> None:
    """An entry of 8 delivered twice to consumers that died is a suspect: scored sample by
    sample alone. A stop at any moment of that, then a second worker: no sample is poison,
    each has its own result, the entry is acked, no quarantine note is left."""
    keys = Keys(namespace)
    client = connect(redis_url)
    n = 8
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await producer.open_batch("q", n, 8)
            await producer.push_many(traj("q", i) for i in range(n))
            held = await client.xreadgroup("scorers", "dead", {keys.stream(): ">"}, count=1)
            await client.xclaim(keys.stream(), "scorers", "dead2", 0, [held[0][1][0][0]])
            cfg = dict(namespace=namespace, block_ms=20, concurrency=4, reclaim_idle_ms=0, drain_timeout_s=0.2)
            w1 = Worker(redis_url, Ident(0.2), ConsumerConfig(consumer="w1", **cfg))
            stop = asyncio.Event()
            asyncio.get_running_loop().call_later(stop_after, stop.set)
            await asyncio.wait_for(w1.run(stop), 20)
            await w1.aclose()
            assert await client.hgetall(keys.quarantine(0)) == {}
            w2 = Worker(redis_url, Ident(0.01), ConsumerConfig(consumer="w2", **cfg))
            await asyncio.wait_for(w2.run(asyncio.Event(), burst=True), 30)
            await w2.aclose()
            rewards = await agg.collect("q", timeout_s=3, on_timeout="resolve")
            assert (await client.xpending(keys.stream(), "scorers"))["pending"] == 0
    finally:
        await client.aclose()
    assert rewards.status == ["ok"] * n, [(r.index, r.status, r.reason) for r in rewards.results if r.status != "ok"]
    assert rewards.scores == [expected(traj("q", i)) for i in range(n)]
    assert w1.stats.dead_letters + w2.stats.dead_letters == 0


@pytest.mark.parametrize("poisons", [(2, 9), (1, 4, 7, 10)])
async def test_several_poison_samples_in_one_entry_are_each_dead_lettered_alone(
    redis_url, namespace, spawn_workers, poisons
) -> None:
    """An entry of 16 with several samples that kill their worker (exit 3). Quarantine hunts
    them one note per sample; a poison found and dead-lettered must not be scored (and crash
    a worker) again on the entry's next delivery, and the innocents must never reach
    max_deliveries: each poison dead-lettered alone, every neighbour ok."""
    from stream_reward.ops.deadletters import list_dead_letters

    n = 16
    args = ("--scorer", SLOW, "--reclaim-idle-ms", "300", "--concurrency", "32")
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await producer.open_batch("pp", n, 4)
        await producer.push_many(slow_traj("pp", i, 0.01, poison=i in poisons) for i in range(n))
        collect = asyncio.create_task(agg.collect("pp", timeout_s=120))
        crashes = 0
        while not collect.done() and crashes < 30:
            (worker,) = spawn_workers(1, *args)
            while worker.poll() is None and not collect.done():
                await asyncio.sleep(0.05)
            if worker.poll() is not None:
                assert worker.returncode == 3
                crashes += 1
        rewards = await collect
    want = ["failed" if i in poisons else "ok" for i in range(n)]
    got = [(r.index, r.status, r.reason) for r in rewards.results if r.status != "ok"]
    assert rewards.status == want, got
    letters = await list_dead_letters(redis_url, namespace=namespace)
    assert sorted((d.reason, d.summary()["index"]) for d in letters) == [("poison", i) for i in poisons]
    # Two crashes with neighbours in flight, then one per poison scored alone.
    assert crashes == 2 + len(poisons), crashes


# ======================================================================================
# Hand-back and a second consumer group


async def test_a_hand_back_in_one_group_is_not_scored_again_by_another_group(redis_url, namespace) -> None:
    """Two consumer groups read the namespace's stream (results are kept per group). Group
    'scorers' has a worker of concurrency 3 that hands back most of each entry of 16; the copies
    land in the shared stream, so group 'judges' gets every handed-back sample a second time
    and scores it again (quota spent twice, and its own workers' copies come back to 'scorers')."""
    from helpers import wait_until

    from stream_reward.wire.entries import ensure_group

    keys = Keys(namespace)
    n = 64
    client = connect(redis_url)
    judge = Ident()
    try:
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
            await ensure_group(client, keys.stream(), "judges")
            await producer.open_batch("g", n, 8)
            await producer.push_many(traj("g", i) for i in range(n))
            async with (
                running_worker(redis_url, namespace, Ident(0.05), concurrency=3, consumer="s1"),
                running_worker(redis_url, namespace, judge, concurrency=256, group="judges", consumer="j1"),
            ):

                async def both_done() -> bool:
                    a = await client.hlen(keys.results("g", 0, "scorers"))
                    b = await client.hlen(keys.results("g", 0, "judges"))
                    return a == n and b == n

                await wait_until(both_done, timeout_s=30)
                await asyncio.sleep(0.5)  # let the judges read whatever else is queued
        assert len(judge.seen) == n, f"group 'judges' scored {len(judge.seen)} times for {n} samples"
    finally:
        await client.aclose()


@pytest.mark.parametrize("seed", [7, 8])
async def test_workers_sigkilled_at_random_moments_lose_and_repeat_nothing(
    redis_url, namespace, spawn_workers, seed
) -> None:
    """Entries of 16, a slow scorer, concurrency 3 (hand-back on every entry): a steady
    worker and a victim SIGKILLed at random moments three times (replaced each time)."""
    import signal

    from helpers import done_results, wait_until

    from stream_reward.ops.deadletters import list_dead_letters

    rnd = random.Random(seed)
    keys = Keys(namespace)
    n = 96
    args = ("--scorer", SLOW, "--reclaim-idle-ms", "500", "--concurrency", "3")
    client = connect(redis_url)
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await producer.open_batch("r", n, 4)
            await producer.push_many(slow_traj("r", i, 0.05) for i in range(n))
            spawn_workers(1, *args)
            for _ in range(3):
                (victim,) = spawn_workers(1, *args)
                await asyncio.sleep(rnd.uniform(0.6, 1.6))
                victim.send_signal(signal.SIGKILL)
                victim.wait()
            rewards = await agg.collect("r", timeout_s=90, on_timeout="resolve")
            bad = [(r.index, r.status, r.reason) for r in rewards.results if r.status != "ok"]
            assert not bad, bad
            assert await client.hlen(keys.results("r")) == n
            uids = [r.uid for r in await done_results(client, keys.done("r"))]
            assert len(uids) == len(set(uids)) == n

            async def nothing_pending() -> bool:
                return (await client.xpending(keys.stream(), "scorers"))["pending"] == 0

            await wait_until(nothing_pending, timeout_s=20)
            assert await list_dead_letters(redis_url, namespace=namespace) == []
    finally:
        await client.aclose()


async def test_backlog_of_one_producer_over_two_partitions_is_never_below_the_truth(redis_url, namespace) -> None:
    """One producer, two partitions. It queues 160 samples of one GRPO group (one partition) in
    entries of 16, then 10 samples of another group (the other partition) one push at a
    time. The second partition is read at once (its reader is ahead: a cluster reads each
    partition apart). The lag left is 10 entries of 16, but EntrySizes remembers the
    producer's newest 10 entries over all partitions: the 10 singles."""
    keys = Keys(namespace, 2)
    groups = {}
    i = 0
    while len(groups) < 2:
        groups.setdefault(keys.partition_of(f"u{i}", f"grp{i}"), f"grp{i}")
        i += 1
    big, small = groups[0], groups[1]
    client = connect(redis_url)
    try:
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace, partitions=2)) as p:
            await p.open_batch("two", 170, 8)
            await p.push_many(
                Trajectory("two", i, "test/exact", response="r", ground_truth="1", group=big) for i in range(160)
            )
            for i in range(160, 170):
                await p.push(Trajectory("two", i, "test/exact", response="r", ground_truth="1", group=small))
            assert await client.xlen(keys.stream(1)) == 10
            await client.xreadgroup("scorers", "fast", {keys.stream(1): ">"}, count=100)
            truth = await undelivered_samples(client, keys)
            assert truth == 160
            assert await p.backlog() >= truth, f"backlog() {await p.backlog()} for {truth} samples undelivered"
    finally:
        await client.aclose()


async def test_entries_a_live_worker_read_but_has_not_opened_yet_are_not_taken_by_a_peer(redis_url, namespace) -> None:
    """A worker of concurrency 3 guesses 1 sample an entry and reads 3 entries of 16 at once.
    It opens (and holds, and keeps renewing) the first two at once; the third waits, delivered
    but not held, until the first round of scoring ends: longer than reclaim_idle_ms.
    A live peer's sweep must not take it (scored twice, delivery count bumped)."""
    from helpers import wait_until

    calls: dict[str, int] = {}

    class Slow:
        async def score(self, t: Trajectory) -> Scored:
            calls[t.uid] = calls.get(t.uid, 0) + 1
            await asyncio.sleep(1.6)
            return Scored(expected(t))

    keys = Keys(namespace)
    n = 48
    cfg = {"concurrency": 3, "reclaim_idle_ms": 1000}
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as p:
        await p.open_batch("nh", n, 8)
        await p.push_many(traj("nh", i) for i in range(n))
        async with running_worker(redis_url, namespace, Slow(), consumer="holder", **cfg) as holder:
            await wait_until(lambda: asyncio.sleep(0, bool(calls)))
            async with running_worker(
                redis_url, namespace, Slow(), consumer="peer", **{**cfg, "concurrency": 64}
            ) as peer:
                deliveries = set()

                async def all_scored() -> bool:
                    rows = await p.client.xpending_range(keys.stream(), "scorers", min="-", max="+", count=100)
                    deliveries.update(r["times_delivered"] for r in rows)
                    return await p.client.hlen(keys.results("nh")) == n and not rows

                await wait_until(all_scored, timeout_s=30)
    twice = {u: c for u, c in calls.items() if c > 1}
    assert deliveries == {1}, f"a sweep claimed a live worker's entry (times delivered: {sorted(deliveries)})"
    assert not twice and peer.stats.reclaimed == 0, f"peer reclaimed {peer.stats.reclaimed}; scored twice: {twice}"
    assert holder.stats.duplicates + peer.stats.duplicates == 0


async def test_the_slow_path_cuts_each_fresh_sample_out_of_the_right_entry(redis_url, namespace) -> None:
    """A push with some duplicates takes the script's slow path, which cuts each fresh sample
    out of its prepared entry by offset: with entries split by count and by size, each
    queued sample must be exactly itself (helpers.samples_of checks header vs payload)."""
    from helpers import queued

    keys = Keys(namespace)
    sizes = [1, 90, 1, 200, 3, 70, 70, 70, 1, 1] * 4

    def big(i: int) -> Trajectory:
        return Trajectory("sp", i, "test/exact", response=chr(97 + i % 26) * (sizes[i] * 1024), ground_truth="1")

    n = len(sizes)
    cfg = ProducerConfig(namespace=namespace, max_message_bytes=1 << 20, samples_per_entry=3)
    async with RolloutProducer(redis_url, cfg) as p, RolloutProducer(redis_url, cfg) as first:
        await first.open_batch("sp", n, 8)
        await first.push_many(big(i) for i in range(0, n, 2))  # the even ones first
        await p.push_many(big(i) for i in range(n))  # then all, by another producer: evens are duplicates
        got = sorted(q[2] for q in await queued(redis_url, keys))
        assert got == list(range(n))
        client = connect(redis_url)
        try:
            for _, f in await client.xrange(keys.stream()):
                for t in samples_of(f):
                    assert t.response == big(t.index).response
        finally:
            await client.aclose()


async def test_a_graceful_stop_does_not_make_the_next_worker_rescore_settled_samples(redis_url, namespace) -> None:
    """One entry of 16; 15 samples settle at once, one is slow. The worker is stopped (drain
    deadline 0.2 s): it releases the entry for its one unsettled sample. The next worker
    scores the entry again, all 16 samples: 15 scorer calls (an LLM judge's quota) spent twice
    for samples whose results are already written. On main, only the unsettled sample's
    entry was released."""
    calls: dict[str, int] = {}

    class OneSlow:
        async def score(self, t: Trajectory) -> Scored:
            calls[t.uid] = calls.get(t.uid, 0) + 1
            await asyncio.sleep(5 if t.index == 15 and calls[t.uid] == 1 else 0.01)
            return Scored(expected(t))

    keys = Keys(namespace)
    n = 16
    cfg = dict(namespace=namespace, block_ms=20, concurrency=32, reclaim_idle_ms=60_000, drain_timeout_s=0.2)
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as p,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await p.open_batch("gs", n, 8)
        await p.push_many(traj("gs", i) for i in range(n))
        stop = asyncio.Event()
        w1 = Worker(redis_url, OneSlow(), ConsumerConfig(consumer="w1", **cfg))
        run = asyncio.ensure_future(w1.run(stop))
        from helpers import wait_until

        await wait_until(lambda: p.client.hlen(keys.results("gs")), timeout_s=10)
        await asyncio.sleep(0.3)
        assert await p.client.hlen(keys.results("gs")) == 15
        stop.set()
        await asyncio.wait_for(run, 20)
        await w1.aclose()
        w2 = Worker(redis_url, OneSlow(), ConsumerConfig(consumer="w2", **cfg))
        await asyncio.wait_for(w2.run(asyncio.Event(), burst=True), 30)
        await w2.aclose()
        rewards = await agg.collect("gs", timeout_s=3)
    assert rewards.status == ["ok"] * n
    twice = sorted(u for u, c in calls.items() if c > 1 and u != "gs/15")
    assert not twice, f"settled samples scored again after a graceful stop: {twice}"


@pytest.mark.parametrize("failing", ["hincrby", "hdel"])
async def test_a_redis_blip_during_a_quarantine_does_not_strand_the_entry(redis_url, namespace, failing) -> None:
    """A suspect entry of 4 is quarantined sample by sample; one quarantine-note command fails
    once (a connection blip). The reclaimer logs the error and sweeps on; the entry must still
    be finished (by this worker or a peer): here it stays held by the live worker, renewed
    for ever, so no peer takes it, and its remaining samples never get a result."""
    from helpers import wait_until
    from redis.exceptions import ConnectionError as RedisConnectionError

    keys = Keys(namespace)
    client = connect(redis_url)
    n = 4
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await producer.open_batch("bl", n, 8)
            await producer.push_many(traj("bl", i) for i in range(n))
            held = await client.xreadgroup("scorers", "dead", {keys.stream(): ">"}, count=1)
            await client.xclaim(keys.stream(), "scorers", "dead2", 0, [held[0][1][0][0]])
            wc = connect(redis_url)
            real = getattr(wc, failing)
            blips = []

            async def flaky(key, *args, **kw):
                if key == keys.quarantine(0) and not blips:
                    blips.append(args)
                    if failing == "hdel":
                        await real(key, *args, **kw)  # ran, but the reply was lost
                    raise RedisConnectionError("blip")
                return await real(key, *args, **kw)

            setattr(wc, failing, flaky)
            cfg = dict(namespace=namespace, block_ms=20, concurrency=4, reclaim_idle_ms=300, drain_timeout_s=0.5)
            async with started(Worker(redis_url, Ident(0.01), ConsumerConfig(consumer="w1", **cfg), client=wc)):
                await wait_until(lambda: asyncio.sleep(0, bool(blips)), timeout_s=10)
                # A peer joins: it may take whatever w1 does not hold on to.
                async with started(Worker(redis_url, Ident(0.01), ConsumerConfig(consumer="peer", **cfg))):

                    async def done() -> bool:
                        return (
                            await client.hlen(keys.results("bl")) == n
                            and (await client.xpending(keys.stream(), "scorers"))["pending"] == 0
                        )

                    assert await _eventually(done, 8), (
                        f"results {await client.hlen(keys.results('bl'))}/{n}; pending "
                        f"{await client.xpending_range(keys.stream(), 'scorers', min='-', max='+', count=10)}"
                    )
            rewards = await agg.collect("bl", timeout_s=1, on_timeout="resolve")
            assert rewards.status == ["ok"] * n
    finally:
        await client.aclose()


async def _eventually(predicate, timeout_s: float) -> bool:
    from helpers import wait_until

    try:
        await wait_until(predicate, timeout_s=timeout_s)
    except AssertionError:
        return False
    return True


def test_producer_samples_per_entry_is_configurable_as_documented(tmp_path, clean_env) -> None:
    """docs/operations.md lists `producer.samples_per_entry` among the settings; the [producer]
    section (ops/settings.py) reads only max_backlog, on_backlog and backlog_poll_s."""
    from stream_reward.ops.settings import load_settings

    s = load_settings(env={"STREAM_REWARD_PRODUCER_SAMPLES_PER_ENTRY": "1"})
    assert s.producer_config().samples_per_entry == 1
    path = tmp_path / "c.toml"
    path.write_text("[producer]\nsamples_per_entry = 4\n")
    assert load_settings(path, env={}).producer_config().samples_per_entry == 4
