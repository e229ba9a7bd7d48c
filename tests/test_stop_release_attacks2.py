"""Attacks on a worker's graceful stop after ee84c76 (the drain waits for a sweep under way,
releases take back the delivery a stop cost with RETRYCOUNT, let-go suspects and entries
the writer gave up on are released too). Guarantees: every unfinished entry is acked with
all its results or released at once to peers; no sample lost, none dead-lettered without a
real crash; a release never steals an entry a live peer holds; shutdown stays bounded when
Redis is slow; a Worker whose run() ended can run() again. Each test forces its interleaving
with wrapped client methods."""

from __future__ import annotations

import asyncio

import pytest
from helpers import Counting, exact_traj, push_exact, stop_config, unsettled
from redis.exceptions import ConnectionError as RedisConnectionError

from stream_reward import ProducerConfig, RewardAggregator, RolloutProducer
from stream_reward.ops.deadletters import list_dead_letters
from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys
from stream_reward.worker.consumer import Worker
from stream_reward.worker.stop import _RELEASED_IDLE_MS

pytestmark = pytest.mark.anyio

HUGE_IDLE = 10**9


async def ghost_holds(redis_url: str, namespace: str, retrycounts: list[int]) -> list[bytes]:
    """A dead consumer 'ghost' reads the stream's entries; entry i is then marked idle for
    ever with times-delivered ``retrycounts[i]`` (a sweep's XAUTOCLAIM adds one)."""
    client = connect(redis_url)
    stream = Keys(namespace).stream()
    try:
        reply = await client.xreadgroup("scorers", "ghost", {stream: ">"}, count=100)
        ids = [eid for eid, _ in reply[0][1]] if isinstance(reply, list) else [eid for eid, _ in reply[stream][0]]
        for eid, count in zip(ids, retrycounts):
            await client.xclaim(stream, "scorers", "ghost", 0, [eid], idle=HUGE_IDLE, retrycount=count, justid=True)
        return ids
    finally:
        await client.aclose()


async def pending_rows(redis_url: str, namespace: str) -> list:
    client = connect(redis_url)
    try:
        rows = await client.xpending_range(Keys(namespace).stream(), "scorers", min="-", max="+", count=100)
        return [(r["message_id"], r["consumer"], r["time_since_delivered"], r["times_delivered"]) for r in rows]
    finally:
        await client.aclose()


async def peer_finishes(redis_url: str, namespace: str, batch: str, **kw):
    """A burst peer with reclaim_idle_ms=60_000 takes what is left; then the batch's rewards,
    what stays pending and the dead letters."""
    scorer = Counting(first=0.0)
    peer = Worker(redis_url, scorer, stop_config(namespace, "peer", reclaim_idle_ms=60_000, **kw))
    await asyncio.wait_for(peer.run(asyncio.Event(), burst=True), 20)
    await peer.aclose()
    async with RewardAggregator(redis_url, namespace=namespace) as agg:
        rewards = await agg.collect(batch, timeout_s=1, on_timeout="resolve")
    left = await pending_rows(redis_url, namespace)
    letters = await list_dead_letters(redis_url, namespace=namespace)
    return scorer, rewards, left, letters


# ======================================================================================
# (5) a Worker whose run() ended runs again


async def test_a_worker_run_again_after_a_graceful_stop_scores_new_samples(redis_url, namespace) -> None:
    """run() stopped gracefully, then run() again with a new stop event: the worker must
    score what is pushed afterwards (no state of the first stop may stick)."""
    scorer = Counting(first=0.0)
    w = Worker(redis_url, scorer, stop_config(namespace, "w1"))
    stop1 = asyncio.Event()
    first = asyncio.ensure_future(w.run(stop1))
    await asyncio.sleep(0.3)
    stop1.set()
    await asyncio.wait_for(first, 10)
    stop2 = asyncio.Event()
    second = asyncio.ensure_future(w.run(stop2))
    try:
        await push_exact(redis_url, namespace, "a", 6)
        async with RewardAggregator(redis_url, namespace=namespace) as agg:
            rewards = await agg.collect("a", timeout_s=4, on_timeout="resolve")
    finally:
        stop2.set()
        await asyncio.wait_for(second, 10)
        await w.aclose()
    assert unsettled(rewards) == [], (
        f"the second run() left samples unscored: {unsettled(rewards)}; scorer saw {scorer.calls}; "
        f"pending {await pending_rows(redis_url, namespace)}"
    )


async def test_a_worker_run_again_after_a_burst_still_renews_its_slow_samples(redis_url, namespace) -> None:
    """A burst run ends (its drain sets _renewals_over); the same Worker runs again and scores
    a sample slower than reclaim_idle_ms. Without renewals its own sweep XAUTOCLAIMs the held
    entry every reclaim_idle_ms, bumping its delivery count; a stop then releases it with
    that count, and the peer dead-letters an innocent, slow sample as max_deliveries."""
    scorer = Counting(first=0.0)
    w = Worker(redis_url, scorer, stop_config(namespace, "w1", reclaim_idle_ms=200, max_deliveries=5))
    await asyncio.wait_for(w.run(asyncio.Event(), burst=True), 10)  # nothing to do: ends at once
    scorer.first = 5.0
    await push_exact(redis_url, namespace, "a", 1)
    stop = asyncio.Event()
    second = asyncio.ensure_future(w.run(stop))
    try:
        await asyncio.wait_for(scorer.started.wait(), 5)
        await asyncio.sleep(1.6)
        during = await pending_rows(redis_url, namespace)
        stop.set()
        await asyncio.wait_for(second, 10)
    finally:
        await w.aclose()
    _, rewards, left, letters = await peer_finishes(redis_url, namespace, "a", max_deliveries=5)
    assert not letters, (
        f"a slow sample of a re-run worker dead-lettered: {[(d.reason, d.error) for d in letters]}; "
        f"pending while scored (id, consumer, idle ms, delivered): {during}"
    )
    assert unsettled(rewards) == [] and not left, (unsettled(rewards), left)


async def test_a_worker_run_again_after_a_graceful_stop_hunts_suspects(redis_url, namespace) -> None:
    """run() stopped gracefully, then run() again: a suspect a dead consumer left (delivered
    twice) must be scored alone and settled. _stopping/_stopped stay set from the first
    stop, so the hunt returns at once and the entry stays held (and renewed) for ever."""
    scorer = Counting(first=0.0)
    w = Worker(redis_url, scorer, stop_config(namespace, "w1", reclaim_idle_ms=60_000, reclaim_interval_s=0.05))
    stop1 = asyncio.Event()
    first = asyncio.ensure_future(w.run(stop1))
    await asyncio.sleep(0.3)
    stop1.set()
    await asyncio.wait_for(first, 10)
    await push_exact(redis_url, namespace, "a", 1)
    await ghost_holds(redis_url, namespace, [2])  # its sweep makes it 3 > 2: a suspect
    stop2 = asyncio.Event()
    second = asyncio.ensure_future(w.run(stop2))
    try:
        async with RewardAggregator(redis_url, namespace=namespace) as agg:
            rewards = await agg.collect("a", timeout_s=3, on_timeout="resolve")
        during = await pending_rows(redis_url, namespace)
    finally:
        stop2.set()
        await asyncio.wait_for(second, 10)
        await w.aclose()
    assert unsettled(rewards) == [], (
        f"the second run() never hunted the suspect: {unsettled(rewards)}; scorer saw {scorer.calls}; pending {during}"
    )


# ======================================================================================
# (3) a release never steals an entry a live peer holds


async def test_a_release_does_not_steal_a_let_go_suspect_a_peer_claimed_meanwhile(redis_url, namespace) -> None:
    """w1's hunt of a suspect fails on Redis (HINCRBY error): the suspect is let go, idle,
    not renewed. w1 stops; its release reads XPENDING (owner w1), and before its XCLAIM a
    live peer's sweep claims the idle entry. The XCLAIM (min-idle 0) takes it back from the
    peer, resets its delivery count, and marks it released: a live worker's entry stolen."""
    await push_exact(redis_url, namespace, "a", 1)
    (eid,) = await ghost_holds(redis_url, namespace, [2])  # w1's sweep makes it 3 > 2: a suspect
    stop, let_go = asyncio.Event(), asyncio.Event()
    wc = connect(redis_url)
    real_evalsha = wc.evalsha
    peer_client = connect(redis_url)
    stream = Keys(namespace).stream()

    async def hincrby(*a, **kw):
        let_go.set()
        stop.set()
        raise RedisConnectionError("injected: Redis away")

    async def evalsha(*a):
        if _RELEASED_IDLE_MS in a:
            # Just before the release, a live peer's sweep (reclaim idle 100 ms) finds the
            # let-go suspect idle and claims it.
            await asyncio.sleep(0.2)
            got = await peer_client.xautoclaim(stream, "scorers", "peer", min_idle_time=100, start_id="0-0")
            assert got[1], "the peer's sweep found nothing to claim"
        return await real_evalsha(*a)

    wc.hincrby, wc.evalsha = hincrby, evalsha
    w1 = Worker(
        redis_url, Counting(), stop_config(namespace, "w1", reclaim_idle_ms=60_000, reclaim_interval_s=0.05), client=wc
    )
    try:
        await asyncio.wait_for(w1.run(stop), 10)
    finally:
        await w1.aclose()
        await peer_client.aclose()
    assert let_go.is_set()
    rows = await pending_rows(redis_url, namespace)
    assert [(r[0], r[1]) for r in rows] == [(eid, b"peer")], (
        f"the stopping worker's release took the entry back from the live peer that claimed it: {rows}"
    )


# ======================================================================================
# (2) no innocent dead-lettered as poison after a stop


async def test_a_stale_note_is_dropped_before_its_suspect_is_released(redis_url, namespace) -> None:
    """w1 hunts a suspect: its HINCRBY lands but the reply is lost, and the HDEL that follows
    fails too (Redis blinks), so the note stays and the suspect is let go. Redis answers again
    at once, and w1 is stopped (a rolling restart): its release hands the suspect to peers at
    once, with the stale note still there. The peer's hunt finds it and dead-letters an
    innocent sample as poison, though Redis answered (the release went through)."""
    await push_exact(redis_url, namespace, "a", 1)
    await ghost_holds(redis_url, namespace, [2])
    stop, hdel_failed = asyncio.Event(), asyncio.Event()
    wc = connect(redis_url)
    real_hincrby, real_hdel = wc.hincrby, wc.hdel
    blinked = []

    async def hincrby(*a, **kw):
        out = await real_hincrby(*a, **kw)
        if not blinked:
            blinked.append(out)
            raise RedisConnectionError("injected: reply lost")
        return out

    async def hdel(*a, **kw):
        if blinked and not hdel_failed.is_set():
            hdel_failed.set()
            raise RedisConnectionError("injected: Redis away")
        return await real_hdel(*a, **kw)

    wc.hincrby, wc.hdel = hincrby, hdel
    w1 = Worker(
        redis_url, Counting(), stop_config(namespace, "w1", reclaim_idle_ms=60_000, reclaim_interval_s=0.05), client=wc
    )
    run = asyncio.ensure_future(w1.run(stop))
    try:
        await asyncio.wait_for(hdel_failed.wait(), 5)
        await asyncio.sleep(0.05)  # Redis answers again; then the stop
        stop.set()
        await asyncio.wait_for(run, 10)
    finally:
        await w1.aclose()
    _, rewards, left, letters = await peer_finishes(redis_url, namespace, "a")
    assert not letters, (
        f"an innocent sample dead-lettered after a Redis blink and a stop: {[(d.reason, d.error) for d in letters]}"
    )
    assert unsettled(rewards) == [] and not left, (unsettled(rewards), left)


# ======================================================================================
# (1)/(4) a sweep stuck on a slow command


async def test_a_sweep_whose_reply_outlasts_the_stop_does_not_keep_what_it_claimed(redis_url, namespace) -> None:
    """w1 scores 2 entries; its background sweep's XAUTOCLAIM takes a dead consumer's entry
    as the stop comes, and its reply is slower than the drain's wait for the sweep (drain
    deadline + 2 s). The drain goes on without the sweep, which never opens what it claimed:
    that entry, pending under the stopped worker and idle-fresh, must be released with the
    others, or a peer with reclaim_idle_ms=60_000 leaves it for a minute.

    (An XAUTOCLAIM that Redis would run only after the release, sent before it, is not
    modelled: a command sent earlier reaches the single-threaded server first.)"""
    await push_exact(redis_url, namespace, "a", 3)
    stream = Keys(namespace).stream()
    client = connect(redis_url)
    try:  # a dead consumer holds the first entry, idle for ever
        got = await client.xreadgroup("scorers", "ghost", {stream: ">"}, count=1)
        (ghost_entry,) = [eid for eid, _ in got[0][1]]
        await client.xclaim(stream, "scorers", "ghost", 0, [ghost_entry], idle=HUGE_IDLE, justid=True)
    finally:
        await client.aclose()
    stop, in_sweep = asyncio.Event(), asyncio.Event()
    armed: list[int] = []
    wc = connect(redis_url)
    real_xautoclaim = wc.xautoclaim

    async def xautoclaim(*a, **kw):
        out = await real_xautoclaim(*a, **kw)
        if armed and out[1] and not in_sweep.is_set():
            in_sweep.set()  # Redis ran it: the entry is w1's now
            await asyncio.sleep(5)  # ... and its reply is slow
        return out

    wc.xautoclaim = xautoclaim
    scorer = Counting()
    w1 = Worker(
        redis_url, scorer, stop_config(namespace, "w1", reclaim_idle_ms=60_000, reclaim_interval_s=0.05), client=wc
    )
    armed.append(1)
    run = asyncio.ensure_future(w1.run(stop))
    try:
        await asyncio.wait_for(in_sweep.wait(), 5)
        stop.set()
        await asyncio.wait_for(run, 15)
    finally:
        await w1.aclose()
    _, rewards, left, letters = await peer_finishes(redis_url, namespace, "a")
    assert not letters
    assert unsettled(rewards) == [] and not left, (
        f"a sweep's claim whose reply outlasted the stop kept an entry under the stopped worker: "
        f"unsettled {unsettled(rewards)}, pending (consumer, idle ms, delivered) {left}"
    )


async def test_shutdown_stays_bounded_when_redis_is_slow_and_released_entries_differ_in_deliveries(
    redis_url, namespace
) -> None:
    """w1 holds 6 entries reclaimed from a dead consumer, each delivered a different number
    of times (all under quarantine_after_deliveries=10). The stop comes with Redis slow
    (1.2 s a command, under each 2 s timeout): the release sends one XCLAIM per delivery
    count, each with its own 2 s timeout, so the stop takes 6 x 1.2 s on top of the drain."""
    n = 6
    await push_exact(redis_url, namespace, "a", n)
    await ghost_holds(redis_url, namespace, list(range(n)))
    stop = asyncio.Event()
    wc = connect(redis_url)
    real = wc.execute_command

    async def execute_command(*a, **kw):
        if stop.is_set():
            await asyncio.sleep(1.2)  # a slow Redis (or link)
        return await real(*a, **kw)

    wc.execute_command = execute_command
    scorer = Counting()
    w1 = Worker(
        redis_url,
        scorer,
        stop_config(
            namespace,
            "w1",
            concurrency=8,
            reclaim_idle_ms=60_000,
            reclaim_interval_s=0.05,
            quarantine_after_deliveries=10,
            max_deliveries=20,
        ),
        client=wc,
    )
    run = asyncio.ensure_future(w1.run(stop))
    try:
        await wait_for_calls(scorer, n)
        stop.set()
        t0 = asyncio.get_running_loop().time()
        await asyncio.wait_for(run, 30)
        took = asyncio.get_running_loop().time() - t0
    finally:
        await w1.aclose()
    assert took < 0.3 + 4.0, f"a stop with Redis slow took {took:.1f} s (drain_timeout_s 0.3)"


async def wait_for_calls(scorer: Counting, n: int, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while len(scorer.calls) < n:
        assert asyncio.get_running_loop().time() < deadline, f"only {len(scorer.calls)} of {n} samples started"
        await asyncio.sleep(0.02)


# ======================================================================================
# (1)/(2) partitions=2, entries of 4 samples, hand-backs


async def test_a_stop_of_a_worker_handing_back_over_two_partitions_loses_and_repeats_nothing(
    redis_url, namespace
) -> None:
    """partitions=2, entries of 4 samples, a scorer that is not inline and concurrency 3: the
    worker starts 3 samples of an entry and hands the 4th back, on both partitions. A stop
    mid-scoring: a burst peer must finish every sample, none dead-lettered, none scored twice
    except those whose scoring the stop cancelled, nothing left pending."""
    n = 16
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace, samples_per_entry=4, partitions=2)) as p:
        await p.open_batch("a", n, 8)
        await p.push_many([exact_traj("a", i) for i in range(n)])
    scorer = Counting(first=5.0)
    w1 = Worker(redis_url, scorer, stop_config(namespace, "w1", concurrency=3, partitions=2))
    stop = asyncio.Event()
    run = asyncio.ensure_future(w1.run(stop))
    await wait_for_calls(scorer, 3)
    await asyncio.sleep(0.2)
    stop.set()
    await asyncio.wait_for(run, 10)
    await w1.aclose()
    peer_scorer = Counting(first=0.0)
    peer = Worker(
        redis_url, peer_scorer, stop_config(namespace, "peer", reclaim_idle_ms=60_000, partitions=2, concurrency=8)
    )
    await asyncio.wait_for(peer.run(asyncio.Event(), burst=True), 20)
    await peer.aclose()
    async with RewardAggregator(redis_url, namespace=namespace, partitions=2) as agg:
        rewards = await agg.collect("a", timeout_s=1, on_timeout="resolve")
    letters = await list_dead_letters(redis_url, namespace=namespace, partitions=2)
    client = connect(redis_url)
    try:
        left = [
            r
            for s in Keys(namespace, 2).streams()
            for r in await client.xpending_range(s, "scorers", min="-", max="+", count=100)
        ]
    finally:
        await client.aclose()
    twice = sorted(u for u in set(scorer.calls) & set(peer_scorer.calls) if u not in scorer.cancelled)
    assert not letters, [(d.reason, d.error) for d in letters]
    assert unsettled(rewards) == [], unsettled(rewards)
    assert not left, left
    assert not twice, f"scored twice though not cancelled: {twice}"


# ======================================================================================
# (3) RETRYCOUNT must not hide real crashes

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
    history.append(await pending_rows(redis_url, namespace))
    await graceful("g1")  # delivered 2 (fresh), stopped mid-scoring: released
    history.append(await pending_rows(redis_url, namespace))
    await asyncio.to_thread(crash, "p2")  # takes the released entry: crashed
    history.append(await pending_rows(redis_url, namespace))
    await graceful("g2")  # a suspect now: hunted alone, stopped mid-hunt: note dropped, released
    history.append(await pending_rows(redis_url, namespace))
    await asyncio.to_thread(crash, "p3")  # a suspect: its note, then crashed
    history.append(await pending_rows(redis_url, namespace))
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
