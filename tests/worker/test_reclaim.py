"""Reclaiming and quarantine (stream_reward.worker.reclaim).

A burst worker finishes every entry a dead consumer left, partly settled ones included, and
those its background sweep claims while it reads. A sweep that takes back an entry its own
worker holds counts no delivery of it. An entry that keeps coming back is scored alone,
sample by sample, under a durable note: the sample that crashes a worker while alone is
dead-lettered, alone, even with graceful stops between its crashes; an innocent is never
blamed. A stop, a cancel or a Redis error during a hunt leaves no note behind and honours
the drain deadline; suspects waiting their turn are held, not taken by a peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import Counter

import pytest
from helpers import (
    Counting,
    IdentityScorer,
    Timed,
    exact_traj,
    identity_score,
    push_exact,
    running,
    running_worker,
    sample_traj,
    samples_of,
    started,
    stop_config,
    wait_until,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from worker_support import SLOW, finish_with_burst, nothing_pending, pending_of_stream, pending_rows, results, slow_traj

from stream_reward import ProducerConfig, RewardAggregator, RolloutProducer, Trajectory
from stream_reward.config import ConsumerConfig
from stream_reward.ops.deadletters import list_dead_letters
from stream_reward.scoring.scorer import Scored
from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys
from stream_reward.worker.consumer import Worker

pytestmark = pytest.mark.anyio


async def _dead_then_burst(
    redis_url: str,
    namespace: str,
    *,
    n: int,
    dead: int,
    partitions: int,
    concurrency: int,
    scorer: IdentityScorer,
    second_dead: bool = False,
    stop_after: float | None = None,
) -> tuple[Worker, list[str], list]:
    keys = Keys(namespace, partitions)
    client = connect(redis_url)
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace, partitions=partitions)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await producer.open_batch("b", n, 8)
            await producer.push_many(sample_traj("b", i, group=f"g{i}") for i in range(n))
            held = await client.xreadgroup("scorers", "dead", {s: ">" for s in keys.streams()}, count=dead)
            if second_dead:  # a second consumer claims them too and dies: delivered twice already
                for stream, entries in held:
                    ids = [eid for eid, _ in entries]
                    await client.xclaim(stream, "scorers", "dead2", 0, ids)
            config = ConsumerConfig(
                namespace=namespace,
                partitions=partitions,
                block_ms=20,
                concurrency=concurrency,
                reclaim_idle_ms=0,
                drain_timeout_s=5,
            )
            worker = Worker(redis_url, scorer, config)
            stop = asyncio.Event()
            if stop_after is not None:
                asyncio.get_running_loop().call_later(stop_after, stop.set)
            await asyncio.wait_for(worker.run(stop, burst=True), 60)
            await worker.aclose()
            if stop_after is not None:
                # What the stopped worker left behind, a second burst worker finishes.
                w2 = Worker(redis_url, IdentityScorer(), dataclasses.replace(config, consumer="second"))
                await asyncio.wait_for(w2.run(asyncio.Event(), burst=True), 60)
                await w2.aclose()
                worker.stats.dead_letters += w2.stats.dead_letters
            rewards = await agg.collect("b", timeout_s=3, on_timeout="resolve")
        pending = 0
        for s in keys.streams():
            pending += (await client.xpending(s, "scorers"))["pending"]
        assert pending == 0, f"{pending} entries left pending"
    finally:
        await client.aclose()
    return worker, rewards.status, rewards.results


async def queue_a_suspect(client, keys: Keys, producer: RolloutProducer) -> None:
    """Sample 0 of batch "q", delivered twice to consumers that died: a suspect for the next."""
    await producer.open_batch("q", 1, 8)
    await producer.push(sample_traj("q", 0))
    held = await client.xreadgroup("scorers", "dead", {keys.stream(): ">"}, count=1)
    await client.xclaim(keys.stream(), "scorers", "dead2", 0, [held[0][1][0][0]])


async def second_worker_finishes(redis_url: str, config: ConsumerConfig, agg: RewardAggregator):
    """A burst worker takes what the first left; then batch "q"'s rewards."""
    w2 = Worker(redis_url, IdentityScorer(), config)
    await asyncio.wait_for(w2.run(asyncio.Event(), burst=True), 20)
    await w2.aclose()
    return w2, await agg.collect("q", timeout_s=3, on_timeout="resolve")


CRASHER = """
import asyncio, os, signal, sys
from stream_reward.config import ConsumerConfig
from stream_reward.scoring.scorer import Scored
from stream_reward.worker.consumer import Worker

class Crash:
    inline = False
    async def score(self, t):
        os.kill(os.getpid(), signal.SIGKILL)  # poison: takes the worker down
        return Scored(0.0)

url, ns, name = sys.argv[1:4]
config = ConsumerConfig(namespace=ns, consumer=name, block_ms=20, reclaim_idle_ms=60_000, drain_timeout_s=0.3)
asyncio.run(Worker(url, Crash(), config).run(asyncio.Event(), burst=True))
"""


class Fatal(BaseException):
    """What takes a worker process down from inside its scorer (as SystemExit would)."""


class Killer:
    """An inline scorer that brings the worker down on one sample, scores the others."""

    inline = True

    def __init__(self, poison_uid: str) -> None:
        self.poison_uid = poison_uid
        self.calls: Counter[str] = Counter()

    async def score(self, t):
        self.calls[t.uid] += 1
        if t.uid == self.poison_uid:
            raise Fatal(f"scorer took the worker down on {t.uid}")
        return Scored(identity_score(t))


async def _eventually(predicate, timeout_s: float) -> bool:
    from helpers import wait_until

    try:
        await wait_until(predicate, timeout_s=timeout_s)
    except AssertionError:
        return False
    return True


async def _suspects(client, keys: Keys, count: int) -> list[bytes]:
    """The stream's first ``count`` entries, delivered twice to consumers that died: the
    next claim makes them suspects (quarantine_after_deliveries=2)."""
    got = await client.xreadgroup("scorers", "dead", {keys.stream(): ">"}, count=count)
    ids = [eid for eid, _ in got[0][1]]
    await client.xclaim(keys.stream(), "scorers", "dead2", 0, ids)
    return ids


class ByBatch:
    inline = False

    def __init__(self, delays: dict[str, float]) -> None:
        self.delays = delays
        self.seen: list[str] = []

    async def score(self, t: Trajectory) -> Scored:
        self.seen.append(t.uid)
        await asyncio.sleep(self.delays.get(t.batch_id, 0.01))
        return Scored(identity_score(t))


class CleansUp:
    """A scorer that takes ``cleanup_s`` to unwind when cancelled (closing a client, killing
    a sandbox process)."""

    inline = False

    def __init__(self, delay: float, cleanup_s: float) -> None:
        self.delay, self.cleanup_s = delay, cleanup_s
        self.seen: list[str] = []

    async def score(self, t: Trajectory) -> Scored:
        self.seen.append(t.uid)
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            import anyio

            with anyio.CancelScope(shield=True):  # as httpcore closes its connections
                await anyio.sleep(self.cleanup_s)
            raise
        return Scored(identity_score(t))


# --- burst passes over a dead consumer's entries


@pytest.mark.parametrize("partitions,concurrency", [(1, 1), (1, 3), (2, 1), (2, 4)])
async def test_burst_worker_finishes_every_dead_consumers_entry(redis_url, namespace, partitions, concurrency) -> None:
    for round_ in range(3):
        ns = f"{namespace}r{round_}"
        worker, status, results = await _dead_then_burst(
            redis_url,
            ns,
            n=12,
            dead=5,
            partitions=partitions,
            concurrency=concurrency,
            scorer=IdentityScorer(delay=0.01, jitter=0.06),
        )
        assert status == ["ok"] * 12, [(r.index, r.status, r.reason) for r in results if r.status != "ok"]
        assert worker.stats.dead_letters == 0
        assert [r.score for r in results] == [i + len(f"r{i}") / 1000 for i in range(12)]


async def test_a_burst_worker_scores_every_sample_of_an_entry_its_sweep_claims_while_it_reads(
    redis_url, namespace
) -> None:
    """Concurrency 1; a dead consumer holds one entry of 4 samples, and the background sweep
    claims it while the burst's reader still reads. Every sample must be scored by the time
    run() returns. A sample handed back to the stream (as a reader hands back what it has no
    room for) would land as a new entry after the reader's last read, and the burst's passes
    claim pending entries only: it would be left for a worker that never comes.

    The reader starts once the sweep has either begun to hand samples back or started them
    all; a hand-back reaches Redis only once the reader has ended."""
    await push_exact(redis_url, namespace, "b", 4, k=4)
    client = connect(redis_url)
    try:
        await client.xreadgroup("scorers", "dead", {Keys(namespace).stream(): ">"}, count=10)
    finally:
        await client.aclose()
    config = ConsumerConfig(namespace=namespace, block_ms=1, concurrency=1, reclaim_idle_ms=0)
    worker = Worker(redis_url, Counting(first=0.0), config)
    reader, process, hand_back = worker._reader, worker._process, worker._hand_back
    handing_back, opened, reader_done = asyncio.Event(), asyncio.Event(), asyncio.Event()
    claimed_while_reading: list[bool] = []

    async def process_and_say(partition, entries, deliveries):
        if deliveries is not None:
            claimed_while_reading.append(worker._reader_active)
        await process(partition, entries, deliveries)
        if deliveries is not None:
            opened.set()

    async def reader_after_the_sweep(stop, burst):
        waits = [asyncio.ensure_future(e.wait()) for e in (handing_back, opened)]
        await asyncio.wait(waits, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        try:
            await reader(stop, burst)
        finally:
            reader_done.set()

    async def hand_back_after_the_reader(*args):
        handing_back.set()
        await asyncio.wait_for(reader_done.wait(), 10)
        await hand_back(*args)

    worker._process = process_and_say  # type: ignore[method-assign]
    worker._reader = reader_after_the_sweep  # type: ignore[method-assign]
    worker._hand_back = hand_back_after_the_reader  # type: ignore[method-assign]
    await asyncio.wait_for(worker.run(asyncio.Event(), burst=True), 20)
    await worker.aclose()
    assert claimed_while_reading[:1] == [True], "the sweep did not claim the entry while the reader read"
    async with RewardAggregator(redis_url, namespace=namespace) as agg:
        rewards = await agg.collect("b", timeout_s=0.5, on_timeout="resolve")
    assert [(r.index, r.status, r.reason) for r in rewards.results] == [(i, "ok", None) for i in range(4)]
    assert await pending_of_stream(redis_url, namespace) == []


async def test_a_sweep_that_claims_an_entry_its_worker_holds_counts_no_delivery(redis_url, namespace) -> None:
    """reclaim_idle_ms=0: each background sweep's XAUTOCLAIM takes back the entry this worker
    is scoring, and leaves it to the scoring under way (it is held). XAUTOCLAIM counts a
    delivery of whatever it claims; these claims must not. Else the entry of a worker that
    later dies reaches its next worker delivered past quarantine_after_deliveries (hunted
    alone, a sample at a time) or max_deliveries (dead-lettered unscored)."""
    await push_exact(redis_url, namespace, "b", 1)
    release = asyncio.Event()

    class Held:
        inline = False
        started = asyncio.Event()

        async def score(self, t: Trajectory) -> Scored:
            self.started.set()
            await release.wait()
            return Scored(identity_score(t))

    scorer = Held()
    worker = Worker(redis_url, scorer, stop_config(namespace, "w1", concurrency=2, reclaim_idle_ms=0))
    sweep, swept = worker._reclaim_sweep, []

    async def counted_sweep(*args):
        out = await sweep(*args)
        # Read while this sweep still holds the sweeping lock: the next sweep's claim
        # (counted, then uncounted by the same sweep) cannot land in between.
        if scorer.started.is_set():
            swept.append(await pending_of_stream(redis_url, namespace))
        return out

    worker._reclaim_sweep = counted_sweep  # type: ignore[method-assign]
    stop = asyncio.Event()
    run = asyncio.ensure_future(worker.run(stop))
    try:
        await asyncio.wait_for(scorer.started.wait(), 10)
        await wait_until(lambda: asyncio.sleep(0, len(swept) >= 3), timeout_s=10)
    finally:
        release.set()
        stop.set()
        await asyncio.wait_for(run, 20)
        await worker.aclose()
    for rows in swept[:3]:
        assert [(consumer, delivered) for _, consumer, _, delivered in rows] == [(b"w1", 1)]


@pytest.mark.parametrize("partitions", [1, 2])
async def test_burst_worker_quarantines_twice_delivered_entries_without_poisoning_them(
    redis_url, namespace, partitions
) -> None:
    """Entries delivered twice already are suspects for the worker's claim: scored alone. Two
    sweeps must never both quarantine one (the second would find the note: poison)."""
    worker, status, results = await _dead_then_burst(
        redis_url,
        namespace,
        n=6,
        dead=4,
        partitions=partitions,
        concurrency=2,
        scorer=IdentityScorer(delay=0.03, jitter=0.05),
        second_dead=True,
    )
    assert status == ["ok"] * 6, [(r.index, r.status, r.reason) for r in results if r.status != "ok"]
    assert worker.stats.dead_letters == 0


@pytest.mark.parametrize("second_dead", [False, True])
async def test_burst_worker_stopped_mid_run_leaves_nothing_lost_or_poisoned(redis_url, namespace, second_dead) -> None:
    worker, status, results = await _dead_then_burst(
        redis_url,
        namespace,
        n=10,
        dead=6,
        partitions=2,
        concurrency=2,
        scorer=IdentityScorer(delay=0.1, jitter=0.1),
        second_dead=second_dead,
        stop_after=0.25,
    )
    assert status == ["ok"] * 10, [(r.index, r.status, r.reason) for r in results if r.status != "ok"]
    assert worker.stats.dead_letters == 0


async def test_burst_worker_does_not_deadlock_with_stop_and_a_stuck_scorer(redis_url, namespace) -> None:
    """stop set while one sample's scorer runs far past drain_timeout_s: a burst worker must
    return around the drain deadline (the burst's final pass waits for idle without one)."""
    started = asyncio.Event()

    class Stuck(IdentityScorer):
        async def score(self, t: Trajectory) -> Scored:
            started.set()
            await asyncio.sleep(8)
            return Scored(1.0)

    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
        await producer.open_batch("st", 1, 8)
        await producer.push(sample_traj("st", 0))
    cfg = ConsumerConfig(namespace=namespace, block_ms=20, concurrency=1, reclaim_idle_ms=0, drain_timeout_s=0.3)
    w = Worker(redis_url, Stuck(), cfg)
    stop = asyncio.Event()
    run = asyncio.ensure_future(w.run(stop, burst=True))
    await asyncio.wait_for(started.wait(), 10)
    t0 = time.monotonic()
    stop.set()
    await asyncio.wait_for(run, 30)
    took = time.monotonic() - t0
    await w.aclose()
    assert took < 4, f"burst worker took {took:.1f}s to stop with drain_timeout_s=0.3"


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
            await producer.push_many(exact_traj("h", i) for i in range(n))
            held = await client.xreadgroup("scorers", "dead", {s: ">" for s in keys.streams()}, count=2)
            ledger = LedgerWriter(client, keys, "scorers", result_ttl_s=3600)
            prewritten = {}
            for stream, entries in held:
                part = keys.streams().index(stream.decode())
                items = []
                for eid, fields in entries:
                    for t in samples_of(fields)[::3]:  # every third sample settled by the dead worker
                        r = ScoreResult(t.uid, t.batch_id, t.index, identity_score(t), "ok", {}, scored_at=0.0)
                        items.append(LedgerItem(eid, t.batch_id, t.uid, encode_result(r), ack=False))
                        prewritten[t.index] = identity_score(t)
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
            w = Worker(redis_url, Timed(0.01, 0.04), config)
            await asyncio.wait_for(w.run(stop, burst=True), 60)
            await w.aclose()
            w2 = Worker(redis_url, Timed(0.0, 0.01), dataclasses.replace(config, consumer="burst2"))
            await asyncio.wait_for(w2.run(asyncio.Event(), burst=True), 60)
            await w2.aclose()
            pending = sum([(await client.xpending(s, "scorers"))["pending"] for s in keys.streams()])
            assert pending == 0, f"{pending} entries left pending"
            rewards = await agg.collect("h", timeout_s=3, on_timeout="resolve")
        assert rewards.status == ["ok"] * n, [
            (r.index, r.status, r.reason) for r in rewards.results if r.status != "ok"
        ]
        assert rewards.scores == [identity_score(exact_traj("h", i)) for i in range(n)]
        uids = []
        for p in range(partitions):
            uids += [r.uid for r in await done_results(client, keys.done("h", p))]
        assert len(uids) == len(set(uids)) == n
        assert await list_dead_letters(redis_url, namespace=namespace, partitions=partitions) == []
    finally:
        await client.aclose()


# --- quarantine: a poison sample is found alone, an innocent never blamed


async def test_a_sample_that_takes_run_down_every_time_is_still_found_poison(redis_url, namespace) -> None:
    """A sample whose scoring raises a BaseException takes run() down: the process exits,
    as good as a crash. Restarted workers meet it again and again. With SIGKILLs its
    delivery count grows, it is quarantined and dead-lettered as poison after a few
    restarts. But run()'s finally releases it with RETRYCOUNT = deliveries - 1, so the
    count never grows: every restart dies on it, for ever, and its batch never completes."""
    keys = Keys(namespace)
    client = connect(redis_url)
    await push_exact(redis_url, namespace, "P", 1)
    outcomes = []
    try:
        for run_no in range(6):
            scorer = Killer("P/0")
            w = Worker(
                redis_url,
                scorer,
                stop_config(namespace, f"w{run_no}", reclaim_idle_ms=100, reclaim_interval_s=0.05),
            )
            try:
                await asyncio.wait_for(w.run(asyncio.Event(), burst=True), 10)
                outcomes.append("returned")
            except Fatal:
                outcomes.append("died")
            except BaseException as exc:  # a group of one Fatal, when a sweep met it
                outcomes.append(f"died ({type(exc).__name__})")
            finally:
                await w.aclose()
            if outcomes[-1] == "returned":
                break
            await asyncio.sleep(0.15)  # past reclaim_idle_ms: the next worker takes it
        got = {r.index: (r.status, r.reason) for r in await results(client, keys, "P")}
        letters = [(d.reason, d.id) for d in await list_dead_letters(redis_url, namespace=namespace)]
        rows = await pending_rows(client, keys)
        assert got.get(0, (None,))[0] == "failed" and any(reason == "poison" for reason, _ in letters), (
            f"a sample that took down {len(outcomes)} successive runs ({outcomes}) was never found poison: "
            f"results {got}, dead letters {letters}, pending {rows} (times delivered never grows: each "
            f"run's release took the crash's delivery back)"
        )
    finally:
        await client.aclose()


async def test_a_poison_sample_is_still_dead_lettered_when_graceful_stops_come_between_its_crashes(
    redis_url, namespace
) -> None:
    """A poison sample SIGKILLs every worker process that scores it. Between its crashes,
    graceful workers take it and are stopped mid-scoring (rolling restart), once fresh and
    once mid-hunt: each release takes back only its own delivery. After three crashes the
    next worker must dead-letter it as poison (not score it a fourth time)."""
    import pathlib
    import subprocess
    import sys

    root = str(pathlib.Path(__file__).resolve().parents[1])

    def crash(name: str) -> None:
        proc = subprocess.Popen([sys.executable, "-c", CRASHER, redis_url, namespace, name], cwd=root)
        try:
            rc = proc.wait(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert rc == -9, f"{name} did not crash on the poison sample (exit {rc})"

    async def graceful(name: str) -> None:
        await asyncio.sleep(0.15)  # idle past its reclaim_idle_ms
        scorer = Counting(first=5.0)
        w = Worker(redis_url, scorer, stop_config(namespace, name, reclaim_idle_ms=100))
        stop = asyncio.Event()
        run = asyncio.ensure_future(w.run(stop))
        await asyncio.wait_for(scorer.started.wait(), 5)
        stop.set()
        await asyncio.wait_for(run, 10)
        await w.aclose()

    await push_exact(redis_url, namespace, "a", 1)
    history = []
    await asyncio.to_thread(crash, "p1")  # read it: delivered 1, crashed
    history.append(await pending_of_stream(redis_url, namespace))
    await graceful("g1")  # delivered 2 (fresh), stopped mid-scoring: released
    history.append(await pending_of_stream(redis_url, namespace))
    await asyncio.to_thread(crash, "p2")  # takes the released entry: crashed
    history.append(await pending_of_stream(redis_url, namespace))
    await graceful("g2")  # a suspect now: hunted alone, stopped mid-hunt: note dropped, released
    history.append(await pending_of_stream(redis_url, namespace))
    await asyncio.to_thread(crash, "p3")  # a suspect: its note, then crashed
    history.append(await pending_of_stream(redis_url, namespace))
    await asyncio.sleep(0.15)
    scorer = Counting(first=0.0)
    last = Worker(redis_url, scorer, stop_config(namespace, "last", reclaim_idle_ms=100))
    await asyncio.wait_for(last.run(asyncio.Event(), burst=True), 10)
    await last.aclose()
    letters = await list_dead_letters(redis_url, namespace=namespace)
    assert [d.reason for d in letters] == ["poison"], (
        f"after three crashes: letters {[(d.reason, d.error) for d in letters]}, scored again {scorer.calls}; "
        f"pending after each step {history}"
    )


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


async def test_suspects_waiting_for_their_quarantine_are_held_not_taken_by_a_peer(redis_url, namespace) -> None:
    """Three entries of 4, each delivered twice already, are reclaimed by w1 at once: all are
    suspects. w1 hunts them one after another, each sample alone (0.3 s each): the second and
    third suspect are delivered to w1 but opened (held, renewed) only when their turn comes,
    so after reclaim_idle_ms a peer claims them too: samples scored twice, and two workers'
    quarantine notes on one sample can dead-letter an innocent sample as poison."""
    from stream_reward.ops.deadletters import list_dead_letters

    keys = Keys(namespace)
    client = connect(redis_url)
    n = 12
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace, samples_per_entry=4)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await producer.open_batch("z", n, 8)
            await producer.push_many(exact_traj("z", i) for i in range(n))
            got = await client.xreadgroup("scorers", "dead", {keys.stream(): ">"}, count=10)
            ids = [eid for eid, _ in got[0][1]]
            assert len(ids) == 3
            await client.xclaim(keys.stream(), "scorers", "dead2", 0, ids)  # delivered twice
            # Entries of one sample read first: w1 guesses 1 sample an entry, and its sweep
            # claims as many entries as it has room for (8), the three suspects at once.
            async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace, samples_per_entry=1)) as singles:
                await singles.open_batch("w", 8, 8)
                await singles.push_many(exact_traj("w", i) for i in range(8))
            s1, s2 = Timed(0.3), Timed(0.3)
            cfg = dict(concurrency=8, reclaim_idle_ms=800)
            async with running_worker(redis_url, namespace, s1, consumer="w1", **cfg):

                async def w1_has_them() -> bool:
                    rows = await client.xpending_range(keys.stream(), "scorers", min="-", max="+", count=10)
                    mine = [
                        r
                        for r in rows
                        if (r["message_id"] if isinstance(r["message_id"], bytes) else r["message_id"].encode()) in ids
                    ]
                    return len(mine) == 3 and all(r["consumer"] in (b"w1", "w1") for r in mine)

                await wait_until(w1_has_them, timeout_s=10)
                async with running_worker(redis_url, namespace, s2, consumer="peer", **cfg):

                    async def done() -> bool:
                        return (
                            await client.hlen(keys.results("z")) == n
                            and (await client.xpending(keys.stream(), "scorers"))["pending"] == 0
                        )

                    await wait_until(done, timeout_s=30)
            s1.seen = [u for u in s1.seen if u.startswith("z/")]
            seen = s1.seen + s2.seen
            twice = sorted({u for u in seen if seen.count(u) > 1})
            letters = await list_dead_letters(redis_url, namespace=namespace)
            rewards = await agg.collect("z", timeout_s=2, on_timeout="resolve")
            assert not letters, [(d.reason, d.error) for d in letters]
            assert rewards.status == ["ok"] * n
            assert not twice, f"scored twice: {twice} (w1 {len(s1.seen)}, peer {len(s2.seen)})"
    finally:
        await client.aclose()


@pytest.mark.parametrize("failing", ["hincrby", "hdel"])
async def test_a_redis_blip_during_a_quarantine_does_not_strand_the_entry(redis_url, namespace, failing) -> None:
    """A suspect entry of 4 is quarantined sample by sample; one quarantine-note command fails
    once (a connection blip). The reclaimer logs the error and sweeps on; the entry must still
    be finished (by this worker or a peer): here it stays held by the live worker, renewed
    for ever, so no peer takes it, and its remaining samples never get a result."""
    from helpers import wait_until

    keys = Keys(namespace)
    client = connect(redis_url)
    n = 4
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await producer.open_batch("bl", n, 8)
            await producer.push_many(exact_traj("bl", i) for i in range(n))
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
            async with started(Worker(redis_url, Timed(0.01), ConsumerConfig(consumer="w1", **cfg), client=wc)):
                await wait_until(lambda: asyncio.sleep(0, bool(blips)), timeout_s=10)
                # A peer joins: it may take whatever w1 does not hold on to.
                async with started(Worker(redis_url, Timed(0.01), ConsumerConfig(consumer="peer", **cfg))):

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


@pytest.mark.parametrize("failing,away_s", [("hincrby", 0.0), ("hdel", 0.0), ("hincrby", 1.0)])
async def test_a_quarantine_note_whose_reply_is_lost_does_not_poison_an_innocent(
    redis_url, namespace, failing, away_s
) -> None:
    """A suspect entry of 4 is hunted sample by sample. The HINCRBY of a note runs on Redis
    but its reply is lost (a connection blip): the quarantine drops the entry, which is
    reclaimed again, and the note left at 1 made the next hunt dead-letter that innocent
    sample as poison. (hdel: the note stays after the sample's result is written. away_s:
    Redis stays away that long after the lost reply, so the one try to drop the note fails
    too; the worker reclaims the entry itself after reclaim_idle_ms and found its own note.)"""

    from stream_reward.ops.deadletters import list_dead_letters

    keys = Keys(namespace)
    client = connect(redis_url)
    n = 4
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await producer.open_batch("qn", n, 8)
            await producer.push_many(exact_traj("qn", i) for i in range(n))
            await _suspects(client, keys, 1)
            wc = connect(redis_url)
            loop = asyncio.get_running_loop()
            away_until: list[float] = []

            def flaky(name: str):
                real = getattr(wc, name)

                async def call(key, *args, **kw):
                    if key == keys.quarantine(0) and away_until and loop.time() < away_until[0]:
                        raise RedisConnectionError("still away")
                    out = await real(key, *args, **kw)
                    if name == failing and key == keys.quarantine(0) and not away_until:
                        away_until.append(loop.time() + away_s)
                        raise RedisConnectionError("blip")  # ran, but the reply was lost
                    return out

                return call

            wc.hincrby, wc.hdel = flaky("hincrby"), flaky("hdel")
            cfg = dict(namespace=namespace, block_ms=20, concurrency=4, reclaim_idle_ms=300, drain_timeout_s=0.5)
            w = Worker(redis_url, Timed(0.01), ConsumerConfig(consumer="w1", **cfg), client=wc)
            async with started(w):

                async def done() -> bool:
                    return await client.hlen(keys.results("qn")) == n and await nothing_pending(client, keys)

                await wait_until(done, timeout_s=15)
            assert away_until
            letters = await list_dead_letters(redis_url, namespace=namespace)
            rewards = await agg.collect("qn", timeout_s=1, on_timeout="resolve")
            assert not letters, [(d.reason, d.error) for d in letters]
            assert rewards.status == ["ok"] * n
            assert await client.hgetall(keys.quarantine(0)) == {}
    finally:
        await client.aclose()


# --- a stop or a cancel mid-quarantine leaves no note behind


async def test_a_stopped_worker_mid_quarantine_does_not_make_its_suspect_poison(redis_url, namespace) -> None:
    """A worker scoring a suspect alone is stopped past its drain deadline: the reclaimer is
    cancelled between the quarantine note (HINCRBY) and its HDEL. The next worker to claim
    the entry finds the note and dead-letters an innocent sample as poison."""
    keys = Keys(namespace)
    client = connect(redis_url)
    started = asyncio.Event()

    class SlowOnce(IdentityScorer):
        async def score(self, t: Trajectory) -> Scored:
            started.set()
            await asyncio.sleep(1.5)
            return Scored(1.0)

    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await queue_a_suspect(client, keys, producer)
            cfg = dict(namespace=namespace, block_ms=20, concurrency=2, reclaim_idle_ms=0, drain_timeout_s=0.2)
            w1 = Worker(redis_url, SlowOnce(), ConsumerConfig(consumer="w1", **cfg))
            stop = asyncio.Event()
            run1 = asyncio.ensure_future(w1.run(stop))
            await asyncio.wait_for(started.wait(), 10)
            stop.set()
            await asyncio.wait_for(run1, 20)
            await w1.aclose()
            w2, rewards = await second_worker_finishes(redis_url, ConsumerConfig(consumer="w2", **cfg), agg)
    finally:
        await client.aclose()
    assert (rewards.status, rewards.results[0].reason) == (["ok"], None)
    assert w1.stats.dead_letters + w2.stats.dead_letters == 0


@pytest.mark.parametrize("where", ["note written", "note not yet dropped"])
async def test_a_cancel_at_either_edge_of_a_quarantine_never_leaves_its_note(redis_url, namespace, where) -> None:
    """A stop cancels the background sweep wherever it waits. Landing on the quarantine note's
    HINCRBY after Redis ran it, or on the HDEL before Redis ran it, it must not leave the note
    behind: the next worker would dead-letter an innocent sample as poison."""
    keys = Keys(namespace)
    client = connect(redis_url)
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await queue_a_suspect(client, keys, producer)
            cfg = dict(namespace=namespace, block_ms=20, concurrency=2, reclaim_idle_ms=0, drain_timeout_s=2)
            w1 = Worker(redis_url, IdentityScorer(), ConsumerConfig(consumer="w1", **cfg))
            stop = asyncio.Event()
            w1._client = wc = connect(redis_url)
            real_hincrby, real_hdel = wc.hincrby, wc.hdel
            caught = []

            async def hincrby(key, field, amount=1):
                value = await real_hincrby(key, field, amount)
                if where == "note written" and key == keys.quarantine(0):
                    caught.append(field)
                    stop.set()
                    await asyncio.sleep(60)  # the stop's cancel lands here, after Redis ran it
                return value

            async def hdel(key, *fields):
                if where == "note not yet dropped" and key == keys.quarantine(0) and not caught:
                    caught.append(fields)
                    stop.set()
                    await asyncio.sleep(60)  # ... or here, before Redis runs it
                return await real_hdel(key, *fields)

            wc.hincrby, wc.hdel = hincrby, hdel
            await asyncio.wait_for(w1.run(stop), 20)
            await w1.aclose()
            assert caught, "the stop never reached the quarantine"
            assert await client.hgetall(keys.quarantine(0)) == {}
            w2, rewards = await second_worker_finishes(redis_url, ConsumerConfig(consumer="w2", **cfg), agg)
    finally:
        await client.aclose()
    assert (rewards.status, rewards.results[0].reason) == (["ok"], None)
    assert w1.stats.dead_letters + w2.stats.dead_letters == 0


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
            await producer.push_many(exact_traj("q", i) for i in range(n))
            held = await client.xreadgroup("scorers", "dead", {keys.stream(): ">"}, count=1)
            await client.xclaim(keys.stream(), "scorers", "dead2", 0, [held[0][1][0][0]])
            cfg = dict(namespace=namespace, block_ms=20, concurrency=4, reclaim_idle_ms=0, drain_timeout_s=0.2)
            w1 = Worker(redis_url, Timed(0.2), ConsumerConfig(consumer="w1", **cfg))
            stop = asyncio.Event()
            asyncio.get_running_loop().call_later(stop_after, stop.set)
            await asyncio.wait_for(w1.run(stop), 20)
            await w1.aclose()
            assert await client.hgetall(keys.quarantine(0)) == {}
            w2 = Worker(redis_url, Timed(0.01), ConsumerConfig(consumer="w2", **cfg))
            await asyncio.wait_for(w2.run(asyncio.Event(), burst=True), 30)
            await w2.aclose()
            rewards = await agg.collect("q", timeout_s=3, on_timeout="resolve")
            assert (await client.xpending(keys.stream(), "scorers"))["pending"] == 0
    finally:
        await client.aclose()
    assert rewards.status == ["ok"] * n, [(r.index, r.status, r.reason) for r in rewards.results if r.status != "ok"]
    assert rewards.scores == [identity_score(exact_traj("q", i)) for i in range(n)]
    assert w1.stats.dead_letters + w2.stats.dead_letters == 0


@pytest.mark.parametrize("after", [1, 3, 6])
async def test_a_stop_mid_quarantine_of_several_suspects_releases_them_and_poisons_none(
    redis_url, namespace, after
) -> None:
    """w1 claims three suspect entries of 4 in one sweep and hunts them sample by sample
    (0.3 s each); it is stopped after ``after`` samples started. The suspects not yet hunted,
    and the one being hunted, must be released (a peer finishes them at once, not after
    reclaim_idle_ms), nothing dead-lettered, every sample scored once besides the one
    cancelled."""
    from stream_reward.ops.deadletters import list_dead_letters

    keys = Keys(namespace)
    client = connect(redis_url)
    n = 12
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace, samples_per_entry=4)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await producer.open_batch("z", n, 8)
            await producer.push_many(exact_traj("z", i) for i in range(n))
            ids = await _suspects(client, keys, 10)
            assert len(ids) == 3
            async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace, samples_per_entry=1)) as singles:
                await singles.open_batch("w", 8, 8)
                await singles.push_many(exact_traj("w", i) for i in range(8))
            await asyncio.sleep(0.4)
            s1 = ByBatch({"z": 0.3})
            w1 = Worker(
                redis_url,
                s1,
                ConsumerConfig(
                    namespace=namespace,
                    consumer="w1",
                    block_ms=20,
                    concurrency=8,
                    reclaim_idle_ms=300,
                    drain_timeout_s=0.2,
                ),
            )
            async with started(w1):
                await wait_until(lambda: asyncio.sleep(0, sum(u.startswith("z/") for u in s1.seen) >= after), 15)
                assert w1.stats.reclaimed == 3  # the three suspects, in one sweep
            hunted = [u for u in s1.seen if u.startswith("z/")]
            # Released entries are taken at once: a peer with a long reclaim_idle_ms finishes them.
            s2 = ByBatch({})
            await finish_with_burst(redis_url, namespace, s2, reclaim_idle_ms=60_000)
            letters = await list_dead_letters(redis_url, namespace=namespace)
            rewards = await agg.collect("z", timeout_s=2, on_timeout="resolve")
            assert not letters, [(d.reason, d.error) for d in letters]
            assert rewards.status == ["ok"] * n, (hunted, s2.seen)
            assert await nothing_pending(client, keys)
            twice = sorted(u for u in set(s2.seen) if u in hunted[:-1] or s2.seen.count(u) > 1)
            assert not twice, f"scored twice: {twice} (w1 hunted {hunted})"
    finally:
        await client.aclose()


async def test_a_stop_during_a_burst_workers_quarantine_is_honoured_within_the_drain_deadline(
    redis_url, namespace
) -> None:
    """A burst worker's last pass claims a suspect entry of 4 and hunts it in its own task
    (not the background reclaimer that a stop cancels). A stop mid-hunt must end the run
    within the drain deadline: here the hunt goes on sample by sample (8 s each), ignoring
    the stop, and a supervisor's SIGKILL after its grace period would leave a note that
    dead-letters an innocent sample as poison."""
    from stream_reward.ops.deadletters import list_dead_letters

    keys = Keys(namespace)
    client = connect(redis_url)
    n = 4
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace, samples_per_entry=4)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await producer.open_batch("bq", n, 8)
            await producer.push_many(exact_traj("bq", i) for i in range(n))
            await _suspects(client, keys, 1)
            await asyncio.sleep(0.4)
            s = Timed(8.0)  # far beyond the bound below: a stop that waited for a sample shows
            w = Worker(
                redis_url,
                s,
                ConsumerConfig(
                    namespace=namespace,
                    consumer="w1",
                    block_ms=20,
                    concurrency=4,
                    reclaim_idle_ms=300,
                    drain_timeout_s=0.3,
                ),
            )
            stop = asyncio.Event()
            run = asyncio.ensure_future(w.run(stop, burst=True))
            await wait_until(lambda: asyncio.sleep(0, bool(s.seen)), timeout_s=10)
            stop.set()
            t0 = asyncio.get_running_loop().time()
            await asyncio.wait_for(run, 30)
            took = asyncio.get_running_loop().time() - t0
            await w.aclose()
            await finish_with_burst(redis_url, namespace, Timed(0.01), reclaim_idle_ms=60_000)
            letters = await list_dead_letters(redis_url, namespace=namespace)
            rewards = await agg.collect("bq", timeout_s=2, on_timeout="resolve")
            assert not letters, [(d.reason, d.error) for d in letters]
            assert rewards.status == ["ok"] * n
            # The drain deadline and generous slack for a loaded machine, well under one sample.
            assert took < 0.3 + 4.5, f"a stop mid-quarantine took {took:.1f} s (drain deadline 0.3 s); hunted {s.seen}"
    finally:
        await client.aclose()


async def test_a_stop_mid_hunt_with_a_scorer_that_unwinds_slowly_poisons_no_sample(redis_url, namespace) -> None:
    """w1 hunts a suspect entry of 4 while a peer runs. w1 is stopped mid-hunt: _drain
    releases the suspect (marked long idle) before the hunt is cancelled, and the hunt's
    note is deleted only once the scorer has unwound (0.5 s). The peer's next sweep takes the
    released suspect at once, finds the note and dead-letters the innocent sample as poison."""
    from stream_reward.ops.deadletters import list_dead_letters

    keys = Keys(namespace)
    client = connect(redis_url)
    n = 4
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace, samples_per_entry=4)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await producer.open_batch("cu", n, 8)
            await producer.push_many(exact_traj("cu", i) for i in range(n))
            await _suspects(client, keys, 1)
            await asyncio.sleep(0.4)
            s1 = CleansUp(5.0, 0.5)
            cfg = dict(namespace=namespace, block_ms=20, concurrency=4, reclaim_idle_ms=300, drain_timeout_s=0.3)
            w1 = Worker(redis_url, s1, ConsumerConfig(consumer="w1", **cfg))
            s2 = Timed(0.01)
            async with contextlib.AsyncExitStack() as peer_running:
                async with started(w1):
                    await wait_until(lambda: asyncio.sleep(0, bool(s1.seen)), timeout_s=10)
                    # The peer starts once w1 hunts (started first, its sweep could take the
                    # suspect before w1), and runs on after w1 stops.
                    await peer_running.enter_async_context(
                        running(redis_url, namespace, s2, consumer="peer", concurrency=4, reclaim_idle_ms=300)
                    )
                    await asyncio.sleep(0.2)

                async def done() -> bool:
                    return await client.hlen(keys.results("cu")) == n and await nothing_pending(client, keys)

                await wait_until(done, timeout_s=15)
            letters = await list_dead_letters(redis_url, namespace=namespace)
            rewards = await agg.collect("cu", timeout_s=2, on_timeout="resolve")
            assert not letters, [(d.reason, d.error) for d in letters]
            assert rewards.status == ["ok"] * n
    finally:
        await client.aclose()
