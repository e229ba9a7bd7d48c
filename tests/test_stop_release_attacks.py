"""Attacks on a worker's graceful stop: every entry it had not finished is acked with all of
its samples' results, or released so that a peer with reclaim_idle_ms=60_000 (a burst
worker) takes it at once; no sample lost, none dead-lettered, none scored twice except one
whose scoring was cancelled. Each test forces its interleaving with wrapped client methods."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from helpers import Counting, exact_traj, identity_score, push_exact, stop_config, unsettled
from redis.exceptions import ConnectionError as RedisConnectionError

from stream_reward import RewardAggregator
from stream_reward.wire.connection import connect
from stream_reward.wire.entries import read_group
from stream_reward.wire.keys import Keys
from stream_reward.wire.ledger import LedgerWriter
from stream_reward.worker.consumer import Worker
from stream_reward.worker.stop import _RELEASED_IDLE_MS

pytestmark = pytest.mark.anyio


async def peer_finishes(redis_url: str, namespace: str, batch: str, **kw):
    """A burst peer with reclaim_idle_ms=60_000 takes what is left; then the batch's rewards,
    what stays pending (consumer, idle ms, times delivered) and the peer's dead letters."""
    scorer = Counting(first=0.0)
    peer = Worker(redis_url, scorer, stop_config(namespace, "peer", reclaim_idle_ms=60_000, **kw))
    await asyncio.wait_for(peer.run(asyncio.Event(), burst=True), 20)
    await peer.aclose()
    client = connect(redis_url)
    try:
        async with RewardAggregator(redis_url, namespace=namespace) as agg:
            rewards = await agg.collect(batch, timeout_s=1, on_timeout="resolve")
        rows = await client.xpending_range(Keys(namespace).stream(), "scorers", min="-", max="+", count=100)
        left = [(r["consumer"], r["time_since_delivered"], r["times_delivered"]) for r in rows]
    finally:
        await client.aclose()
    return peer, scorer, rewards, left


async def run_stopped(worker: Worker, stop: asyncio.Event) -> None:
    await asyncio.wait_for(worker.run(stop), 20)
    await worker.aclose()


# ======================================================================================
# A reclaim sweep in flight at the stop


async def test_entries_a_sweep_claimed_as_the_stop_came_are_released(redis_url, namespace) -> None:
    """The background sweep's XAUTOCLAIM takes a dead consumer's entries; its reply comes back
    just after the stop. The drain has already decided what to release (nothing), so the
    claimed entries stay pending under the stopped worker, idle-fresh: a peer waits a minute."""
    await push_exact(redis_url, namespace, "a", 1)
    client = connect(redis_url)
    try:
        await client.xreadgroup("scorers", "dead", {Keys(namespace).stream(): ">"}, count=10)
    finally:
        await client.aclose()
    await asyncio.sleep(0.15)  # idle past w1's reclaim_idle_ms
    stop, fired = asyncio.Event(), []
    wc = connect(redis_url)
    real = wc.xautoclaim

    async def xautoclaim(*a, **kw):
        out = await real(*a, **kw)
        if out[1] and not fired:  # Redis ran it: the entries are w1's now
            fired.append(len(out[1]))
            stop.set()
            await asyncio.sleep(1.0)  # a slow reply: the drain goes on meanwhile
        return out

    wc.xautoclaim = xautoclaim
    w1 = Worker(redis_url, Counting(), stop_config(namespace, "w1", reclaim_idle_ms=100), client=wc)
    await run_stopped(w1, stop)
    assert fired == [1], "the sweep never claimed the dead consumer's entries"
    _, _, rewards, left = await peer_finishes(redis_url, namespace, "a")
    assert (unsettled(rewards), left) == ([], []), (
        f"entries a sweep claimed at the stop were neither finished nor released: unsettled {unsettled(rewards)}, "
        f"pending (consumer, idle ms, delivered) {left}"
    )


async def test_a_sweep_in_flight_at_the_release_does_not_claim_the_released_entries_back(redis_url, namespace) -> None:
    """w1 scores a slow sample; the stop comes while its sweep's XAUTOCLAIM is on its way and
    lands just after the release: it claims the released (long idle) entry back for w1, which
    drops it (held) and stops. Nobody takes it for reclaim_idle_ms."""
    await push_exact(redis_url, namespace, "b", 1)
    stop, released, claimed_back, fired = asyncio.Event(), asyncio.Event(), asyncio.Event(), []
    scorer = Counting()
    wc = connect(redis_url)
    real_xautoclaim, real_evalsha = wc.xautoclaim, wc.evalsha

    async def xautoclaim(*a, **kw):
        if scorer.started.is_set() and not fired:
            fired.append(1)
            stop.set()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(released.wait(), 1.5)
            out = await real_xautoclaim(*a, **kw)
            claimed_back.set()
            return out
        return await real_xautoclaim(*a, **kw)

    async def evalsha(*a):
        out = await real_evalsha(*a)
        if _RELEASED_IDLE_MS in a:  # the release; its reply is slow, the sweep lands meanwhile
            released.set()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(claimed_back.wait(), 1.0)
        return out

    wc.xautoclaim, wc.evalsha = xautoclaim, evalsha
    w1 = Worker(redis_url, scorer, stop_config(namespace, "w1", reclaim_idle_ms=300), client=wc)
    await run_stopped(w1, stop)
    assert fired and released.is_set() and claimed_back.is_set(), "the interleaving was not reached"
    _, _, rewards, left = await peer_finishes(redis_url, namespace, "b")
    assert (unsettled(rewards), left) == ([], []), (
        f"a sweep landing after the release claimed the entry back: unsettled {unsettled(rewards)}, "
        f"pending (consumer, idle ms, delivered) {left}"
    )


# ======================================================================================
# A quarantine hunt at the stop


async def queue_a_suspect(redis_url: str, namespace: str, batch: str) -> None:
    """Sample 0 of ``batch``, delivered twice to consumers that died: a suspect for the next."""
    await push_exact(redis_url, namespace, batch, 1)
    keys = Keys(namespace)
    client = connect(redis_url)
    try:
        held = await client.xreadgroup("scorers", "dead", {keys.stream(): ">"}, count=1)
        await client.xclaim(keys.stream(), "scorers", "dead2", 0, [held[0][1][0][0]])
    finally:
        await client.aclose()


async def test_a_quarantine_note_landing_after_the_drain_does_not_poison_the_suspect(redis_url, namespace) -> None:
    """The hunt's HINCRBY (the durable note) is sent as the stop comes and lands after the
    drain dropped ``_hunting``'s note (HDEL first, HINCRBY second). The hunt then starts the
    sample anyway (an attempt nobody cancels, after the release) and returns on the stop
    without dropping the note: the next worker finds it and dead-letters the sample as poison."""
    await queue_a_suspect(redis_url, namespace, "q")
    keys = Keys(namespace)
    stop, landed, fired = asyncio.Event(), asyncio.Event(), []
    scorer = Counting(first=0.5)
    wc = connect(redis_url)
    real_hincrby, real_evalsha = wc.hincrby, wc.evalsha
    w1: Worker

    async def hincrby(key, field, amount=1):
        if key == keys.quarantine(0) and not fired:
            fired.append(field)
            stop.set()
            await asyncio.sleep(0.6)  # a slow send: it lands past the drain deadline (0.3 s)
            out = await real_hincrby(key, field, amount)
            landed.set()
            return out
        return await real_hincrby(key, field, amount)

    async def evalsha(*a):
        if _RELEASED_IDLE_MS in a:  # the release: a slow round trip
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(landed.wait(), 1.0)
            await asyncio.sleep(0.05)
        return await real_evalsha(*a)

    wc.hincrby, wc.evalsha = hincrby, evalsha
    w1 = Worker(redis_url, scorer, stop_config(namespace, "w1", reclaim_idle_ms=0, concurrency=2), client=wc)
    try:
        await run_stopped(w1, stop)
        assert fired and landed.is_set(), "the interleaving was not reached"
        left_running = len(w1._tasks)
        client = connect(redis_url)
        try:
            notes = await client.hgetall(keys.quarantine(0))
        finally:
            await client.aclose()
        peer, _, rewards, left = await peer_finishes(redis_url, namespace, "q")
    finally:
        for task in list(w1._tasks):
            task.cancel()
    assert (unsettled(rewards), w1.stats.dead_letters + peer.stats.dead_letters, left) == ([], 0, []), (
        f"a stop mid-hunt made an innocent suspect poison: unsettled {unsettled(rewards)}, "
        f"note left {notes}, pending {left}"
    )
    assert notes == {}, f"the quarantine note outlived the stop: {notes}"
    assert left_running == 0, f"{left_running} scoring task(s) still running after the worker stopped"


async def test_a_quarantine_note_failing_at_a_stop_still_releases_the_suspect(redis_url, namespace) -> None:
    """A Redis blip fails the hunt's HINCRBY as the stop comes. The quarantine lets the suspect
    go (no longer held or open: 'reclaimed after reclaim_idle_ms'), so the drain does not
    release it: a peer with a long reclaim_idle_ms leaves it alone."""
    await queue_a_suspect(redis_url, namespace, "f")
    keys = Keys(namespace)
    stop, failed = asyncio.Event(), []
    wc = connect(redis_url)
    real_hincrby, real_hdel = wc.hincrby, wc.hdel

    async def hincrby(key, field, amount=1):
        if key == keys.quarantine(0) and not failed:
            failed.append(field)
            raise RedisConnectionError("Connection reset by peer (injected)")
        return await real_hincrby(key, field, amount)

    async def hdel(key, *fields):
        out = await real_hdel(key, *fields)
        if failed and key == keys.quarantine(0):
            stop.set()  # the stop comes as the blip is handled
        return out

    wc.hincrby, wc.hdel = hincrby, hdel
    w1 = Worker(redis_url, Counting(), stop_config(namespace, "w1", reclaim_idle_ms=0, concurrency=2), client=wc)
    await run_stopped(w1, stop)
    assert failed, "the quarantine was never reached"
    peer, _, rewards, left = await peer_finishes(redis_url, namespace, "f")
    assert (unsettled(rewards), left) == ([], []), (
        f"a suspect whose note failed at the stop was not released: unsettled {unsettled(rewards)}, "
        f"pending (consumer, idle ms, delivered) {left}"
    )
    assert w1.stats.dead_letters + peer.stats.dead_letters == 0


# ======================================================================================
# The writer at the stop


async def test_results_the_writer_could_not_write_by_the_deadline_are_released(
    redis_url, namespace, monkeypatch
) -> None:
    """A sample finishes just after the stop; the writer's flush fails (the writer's
    connection is reset) until the drain deadline, while the rest of Redis answers. The entry
    was not in the drain's release (its sample had settled in memory) and the writer gives
    it up: it stays pending under the stopped worker, and a peer waits a minute for it."""
    await push_exact(redis_url, namespace, "w", 1)
    stop = asyncio.Event()
    scorer = Counting(first=0.05, on_first=stop.set)
    wc = connect(redis_url)
    real_write = LedgerWriter.write_partitions  # the writer's flushes, on its lane or through redis-py
    failed = []

    async def write_partitions(self, batch):
        if stop.is_set() and self is w1._ledger:  # the peer's flushes go through
            failed.append(1)
            raise RedisConnectionError("Connection reset by peer (injected)")
        return await real_write(self, batch)

    monkeypatch.setattr(LedgerWriter, "write_partitions", write_partitions)
    w1 = Worker(redis_url, scorer, stop_config(namespace, "w1", reclaim_idle_ms=300), client=wc)
    await run_stopped(w1, stop)
    assert failed, "the flush never failed"
    _, _, rewards, left = await peer_finishes(redis_url, namespace, "w")
    assert (unsettled(rewards), left) == ([], []), (
        f"an entry whose results the writer gave up on was not released: unsettled {unsettled(rewards)}, "
        f"pending (consumer, idle ms, delivered) {left}"
    )


# ======================================================================================
# Reads and hand-backs at the stop


async def test_a_stop_before_the_first_read_returns_loses_nothing(redis_url, namespace, monkeypatch) -> None:
    """The stop comes while the first XREADGROUP's reply is on its way: the entries it brings
    are opened after the stop; they must be scored within the drain or released."""
    await push_exact(redis_url, namespace, "r", 6, k=2)
    stop, fired = asyncio.Event(), []
    scorer = Counting()
    wc = connect(redis_url)

    async def first_read(*a, **kw):  # the worker's reads, on its lane or through redis-py
        out = await read_group(*a, **kw)
        if out and not fired:
            fired.append(1)
            stop.set()
            await asyncio.sleep(0.05)
        return out

    monkeypatch.setattr("stream_reward.worker.reading.read_group", first_read)
    w1 = Worker(redis_url, scorer, stop_config(namespace, "w1", reclaim_idle_ms=300, concurrency=8), client=wc)
    await run_stopped(w1, stop)
    assert fired
    _, peer_scorer, rewards, left = await peer_finishes(redis_url, namespace, "r")
    assert (unsettled(rewards), left) == ([], [])
    assert [r.score for r in rewards.results] == [identity_score(exact_traj("r", i)) for i in range(6)]
    twice = {u for u in scorer.calls if u in peer_scorer.calls}
    assert twice <= set(scorer.cancelled), f"scored twice without a cancel: {twice - set(scorer.cancelled)}"


@pytest.mark.parametrize("finish_fails", [False, True])
async def test_a_stop_during_a_hand_back_loses_and_doubles_nothing(redis_url, namespace, finish_fails) -> None:
    """An entry of 6 samples on a worker of concurrency 2: it starts two and hands 4 back; the
    stop comes while the hand-back's reply is on its way. The drain cancels the two and hands
    them back too (or, if that fails, releases the entry whole). Every sample ends scored once
    (plus the cancelled attempts), the entry acked."""
    await push_exact(redis_url, namespace, "h", 6, k=6)
    stop, fired = asyncio.Event(), []
    scorer = Counting()
    wc = connect(redis_url)
    real = wc.evalsha
    w1: Worker

    async def evalsha(sha, *a, **kw):
        if sha == w1._requeue.sha:
            if not fired:
                out = await real(sha, *a, **kw)  # (a NoScriptError goes back to Script, which loads it)
                fired.append(1)
                stop.set()
                await asyncio.sleep(0.05)
                return out
            if finish_fails:
                raise RedisConnectionError("Connection reset by peer (injected)")
        return await real(sha, *a, **kw)

    wc.evalsha = evalsha
    w1 = Worker(redis_url, scorer, stop_config(namespace, "w1", reclaim_idle_ms=300, concurrency=2), client=wc)
    await run_stopped(w1, stop)
    # 4 handed back for want of room, and the 2 the stop cancelled, unless that hand-back fails.
    assert fired and w1.stats.spilled == (4 if finish_fails else 6)
    peer, peer_scorer, rewards, left = await peer_finishes(redis_url, namespace, "h")
    assert (unsettled(rewards), left) == ([], [])
    assert [r.score for r in rewards.results] == [identity_score(exact_traj("h", i)) for i in range(6)]
    assert all(n == 1 for n in peer_scorer.calls.values()), f"the peer scored samples twice: {peer_scorer.calls}"
    twice = {u for u in scorer.calls if u in peer_scorer.calls}
    assert twice <= set(scorer.cancelled), f"scored twice without a cancel: {twice - set(scorer.cancelled)}"


# ======================================================================================
# Several workers, repeated stops


async def test_several_workers_stopping_at_once_release_everything(redis_url, namespace) -> None:
    """Three workers each scoring slow samples are stopped together; the burst peer finishes
    everything at once and nothing is scored twice except the cancelled attempts."""
    await push_exact(redis_url, namespace, "s", 12, k=2)
    stop = asyncio.Event()
    scorers = [Counting() for _ in range(3)]
    workers = [
        Worker(redis_url, s, stop_config(namespace, f"w{i}", reclaim_idle_ms=200, concurrency=2, read_count=2))
        for i, s in enumerate(scorers)
    ]
    runs = [asyncio.ensure_future(w.run(stop)) for w in workers]
    for s in scorers:
        await asyncio.wait_for(s.started.wait(), 5)
    await asyncio.sleep(0.3)  # the sweeps and renewals run meanwhile
    stop.set()
    await asyncio.wait_for(asyncio.gather(*runs), 20)
    for w in workers:
        await w.aclose()
    peer, peer_scorer, rewards, left = await peer_finishes(redis_url, namespace, "s")
    assert (unsettled(rewards), left) == ([], [])
    cancelled = {u for s in scorers for u in s.cancelled}
    twice = {u for s in scorers for u in s.calls if u in peer_scorer.calls}
    assert twice <= cancelled, f"scored twice without a cancel: {twice - cancelled}"
    assert sum(w.stats.dead_letters for w in workers) + peer.stats.dead_letters == 0


async def test_rolling_restarts_over_one_slow_sample_never_dead_letter_it(redis_url, namespace) -> None:
    """One slow sample; workers are started and stopped over it one after another (a rolling
    restart each time it is mid-scoring). Each stop cancels and releases it; none is a crash,
    so it must never be quarantined as poison nor dead-lettered for max_deliveries."""
    await push_exact(redis_url, namespace, "rr", 1)
    dead_letters = 0
    for i in range(4):
        stop = asyncio.Event()
        scorer = Counting()
        w = Worker(redis_url, scorer, stop_config(namespace, f"w{i}", reclaim_idle_ms=60_000, max_deliveries=4))
        task = asyncio.ensure_future(w.run(stop, burst=True))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(scorer.started.wait(), 5)
        stop.set()
        await asyncio.wait_for(task, 20)
        await w.aclose()
        dead_letters += w.stats.dead_letters
    peer, _, rewards, left = await peer_finishes(redis_url, namespace, "rr", max_deliveries=4)
    assert (unsettled(rewards), dead_letters + peer.stats.dead_letters, left) == ([], 0, []), (
        f"graceful stops counted as deliveries dead-lettered the sample: {unsettled(rewards)}"
    )
