"""The graceful stop (stream_reward.worker.stop).

Every entry a stopping worker had not finished is acked with all of its samples' results
or released, marked idle, so that a peer (here a burst worker with reclaim_idle_ms=60_000)
takes it at once; no sample is lost, none dead-lettered, none scored twice except one whose
scoring was cancelled. A release never takes an entry another live consumer (a twin of the
same name, a peer that claimed it, another group) holds; suspects are released innocent;
entries that handed samples back hand back the rest and are acked; and the stop stays
bounded when Redis is slow or away. Most tests force their interleaving with wrapped client
methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections import Counter
from typing import Any

import pytest
from helpers import (
    Counting,
    Timed,
    exact_traj,
    identity_score,
    push_exact,
    running,
    running_worker,
    sample_traj,
    started,
    stop_config,
    unsettled,
    wait_until,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from worker_support import (
    HUGE_IDLE,
    Delays,
    _async,
    cfg,
    finish_with_burst,
    ghost_holds,
    nothing_pending,
    one_result_each,
    peer_finishes_with_letters,
    pending_count,
    pending_of_stream,
    pending_rows,
    push,
    requeue_replies_lost,
    results,
)

from stream_reward import ProducerConfig, RewardAggregator, RolloutProducer, Trajectory
from stream_reward.config import ConsumerConfig
from stream_reward.ops.deadletters import list_dead_letters
from stream_reward.ops.embedded import EmbeddedServer
from stream_reward.scoring.scorer import Scored
from stream_reward.wire.connection import connect
from stream_reward.wire.entries import read_group
from stream_reward.wire.keys import Keys
from stream_reward.wire.ledger import LedgerWriter
from stream_reward.worker.consumer import Worker
from stream_reward.worker.stop import _RELEASED_IDLE_MS

pytestmark = pytest.mark.anyio


LANE_CMDS = {"xreadgroup", "evalsha", "script|load", "script"}


async def kill_lane_like(admin: Any) -> int:
    """CLIENT KILL every connection whose last command is one the worker's lanes send."""
    killed = 0
    listing = await admin.execute_command("CLIENT", "LIST")
    text = listing.decode() if isinstance(listing, bytes) else listing
    for line in text.splitlines():
        fields = dict(kv.split("=", 1) for kv in line.split(" ") if "=" in kv)
        if fields.get("cmd") in LANE_CMDS:
            with contextlib.suppress(Exception):
                killed += await admin.execute_command("CLIENT", "KILL", "ID", fields["id"]) == b"OK" or 1
    return killed


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


async def wait_for_calls(scorer: Counting, n: int, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while len(scorer.calls) < n:
        assert asyncio.get_running_loop().time() < deadline, f"only {len(scorer.calls)} of {n} samples started"
        await asyncio.sleep(0.02)


async def burst_peer(redis_url: str, namespace: str, scorer, **kw) -> None:
    peer = Worker(redis_url, scorer, stop_config(namespace, "peer", reclaim_idle_ms=60_000, **kw))
    await asyncio.wait_for(peer.run(asyncio.Event(), burst=True), 20)
    await peer.aclose()


async def check_batch(redis_url: str, namespace: str, batch: str, n: int, agg: RewardAggregator, timeout_s: float):
    """Every sample once, with its own score; nothing pending; no dead letter."""
    from helpers import done_results

    from stream_reward.ops.deadletters import list_dead_letters

    rewards = await agg.collect(batch, timeout_s=timeout_s, on_timeout="resolve")
    bad = [(r.index, r.status, r.reason) for r in rewards.results if r.status != "ok"]
    assert not bad, bad
    assert rewards.indices == list(range(n))
    assert rewards.scores == [identity_score(exact_traj(batch, i)) for i in range(n)], "a sample got another's score"
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


class SlowFlush(Worker):
    """A worker whose result writes take ``flush_s`` (a loaded Redis, a slow link)."""

    flush_s = 0.0

    async def _flush(self, batch):  # type: ignore[override]
        if self.flush_s:
            await asyncio.sleep(self.flush_s)
        await super()._flush(batch)


class FailingFinish(Worker):
    """Redis fails one step of _finish_handed (a blip at the stop)."""

    failing = ""

    async def _finish_handed(self, entries, left):  # type: ignore[override]
        from redis.exceptions import ConnectionError as RedisConnectionError

        real_requeue, real_xack, real_lookup = self._requeue, self._client.xack, self._with_results

        async def requeue(*args, **kw):
            if self.failing == "requeue_lost":
                await real_requeue(*args, **kw)  # ran, but the reply was lost
            if self.failing.startswith("requeue"):
                raise RedisConnectionError("blip")
            return await real_requeue(*args, **kw)

        async def xack(*args, **kw):
            if self.failing == "xack":
                raise RedisConnectionError("blip")
            return await real_xack(*args, **kw)

        async def lookup(*args, **kw):
            if self.failing == "lookup":
                raise RedisConnectionError("blip")
            return await real_lookup(*args, **kw)

        self._requeue, self._with_results = requeue, lookup
        self._client.xack = xack
        try:
            return await super()._finish_handed(entries, left)
        finally:
            self._requeue, self._with_results = real_requeue, real_lookup
            del self._client.xack


class SlowSpill(Worker):
    """The hand-back's requeue takes 0.5 s (then runs, or fails with ``fail``)."""

    fail = False
    in_spill = False

    async def _spill(self, *args, **kw):  # type: ignore[override]
        from redis.exceptions import ConnectionError as RedisConnectionError

        real = self._requeue

        async def slow(*a, **k):
            self.in_spill = True
            await asyncio.sleep(0.5)
            if self.fail:
                raise RedisConnectionError("blip")
            return await real(*a, **k)

        self._requeue = slow
        try:
            return await super()._spill(*args, **kw)
        finally:
            self._requeue = real


class Completes:
    """Records a sample once its scoring completed (not cancelled)."""

    inline = False

    def __init__(self, rnd, delay: float) -> None:
        self.rnd, self.delay = rnd, delay
        self.done: list[str] = []

    async def score(self, t: Trajectory) -> Scored:
        await asyncio.sleep(self.rnd.random() * self.delay)
        self.done.append(t.uid)
        return Scored(identity_score(t))


# --- the release: what is unfinished goes back to the group at once


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
    _, rewards, left, letters = await peer_finishes_with_letters(redis_url, namespace, "a")
    assert not letters
    assert unsettled(rewards) == [] and not left, (
        f"a sweep's claim whose reply outlasted the stop kept an entry under the stopped worker: "
        f"unsettled {unsettled(rewards)}, pending (consumer, idle ms, delivered) {left}"
    )


async def test_a_renewal_in_flight_at_a_stop_does_not_undo_the_release(redis_url, namespace) -> None:
    """A stopping worker releases its unfinished entries (marks them long idle, so the next
    sweep of any worker takes them at once). Its housekeeper renews held entries every
    reclaim_idle_ms / 3: a renewal on its way when the stop came, landing after the release,
    made the entry fresh again, and a peer with a long reclaim_idle_ms left it alone.
    (CI saw this as 10 of 12 samples never scored after a stop mid-quarantine.)"""
    calls: dict[str, int] = {}

    class Slow:
        async def score(self, t: Trajectory) -> Scored:
            calls[t.uid] = calls.get(t.uid, 0) + 1
            await asyncio.sleep(5 if calls[t.uid] == 1 else 0)
            return Scored(1.0)

    stop, released = asyncio.Event(), asyncio.Event()
    wc = connect(redis_url)
    real_xclaim, real_evalsha = wc.xclaim, wc.evalsha

    async def evalsha(*args):
        out = await real_evalsha(*args)
        if _RELEASED_IDLE_MS in args:  # the release script
            released.set()
        return out

    async def xclaim(name, group, consumer, min_idle_time, message_ids, **kw):
        if stop.is_set():  # a renewal under way when the stop came: a slow round trip
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(released.wait(), 1.0)
        return await real_xclaim(name, group, consumer, min_idle_time, message_ids, **kw)

    wc.xclaim, wc.evalsha = xclaim, evalsha
    cfg = dict(namespace=namespace, block_ms=20, concurrency=1, reclaim_idle_ms=300, drain_timeout_s=0.4)
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as p,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await p.open_batch("rr", 1, 8)
            await p.push(sample_traj("rr", 0))
            w1 = Worker(redis_url, Slow(), ConsumerConfig(consumer="w1", **cfg), client=wc)
            task = asyncio.ensure_future(w1.run(stop))
            await wait_until(lambda: asyncio.sleep(0, bool(calls)))
            stop.set()
            await asyncio.wait_for(task, 20)
            await w1.aclose()
            assert released.is_set()
            # Released: a peer that reclaims only entries idle for a minute takes it at once.
            w2 = Worker(redis_url, Slow(), ConsumerConfig(consumer="w2", **{**cfg, "reclaim_idle_ms": 60_000}))
            await asyncio.wait_for(w2.run(asyncio.Event(), burst=True), 20)
            await w2.aclose()
            rewards = await agg.collect("rr", timeout_s=2, on_timeout="resolve")
            pending = await p.client.xpending(p.keys.stream(), "scorers")
    finally:
        await wc.aclose()
    assert (rewards.status, pending["pending"]) == (["ok"], 0), "the release was undone by a late renewal"
    assert calls == {"rr/0": 2}  # the cancelled attempt, then the peer's


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


async def test_a_worker_stopped_before_it_read_anything_leaves_nothing_behind(redis_url, namespace) -> None:
    """stop is set before run(): nothing read, nothing pending, no heartbeat left; a burst
    peer then scores every sample once."""
    keys = Keys(namespace)
    client = connect(redis_url)
    try:
        await push_exact(redis_url, namespace, "E", 3)
        stop = asyncio.Event()
        stop.set()
        w = Worker(redis_url, Counting(first=0.0), stop_config(namespace, "w1"))
        await asyncio.wait_for(w.run(stop), 10)
        await w.aclose()
        assert await pending_rows(client, keys) == []
        assert not await client.hexists(keys.workers(), "w1")
        peer = Counting(first=0.0)
        await burst_peer(redis_url, namespace, peer)
        got = Counter(r.index for r in await results(client, keys, "E"))
        assert got == {0: 1, 1: 1, 2: 1} and set(peer.calls.values()) == {1}, (got, peer.calls)
    finally:
        await client.aclose()


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
            await producer.push_many(exact_traj("b", i) for i in range(n))
            assert await client.xlen(keys.stream()) == 3
            base = dict(namespace=namespace, block_ms=20, concurrency=3, reclaim_idle_ms=60_000, drain_timeout_s=3)
            stop = asyncio.Event()
            w = Worker(redis_url, Timed(0.5), ConsumerConfig(consumer="first", **base))
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
            w2 = Worker(redis_url, Timed(), ConsumerConfig(consumer="second", **base))
            await asyncio.wait_for(w2.run(asyncio.Event(), burst=True), 30)
            await w2.aclose()
            left = await client.xpending_range(keys.stream(), "scorers", min="-", max="+", count=100)
            assert left == [], f"entries left pending under the stopped consumer: {left}"
            rewards = await agg.collect("b", timeout_s=3, on_timeout="resolve")
            assert rewards.status == ["ok"] * n
    finally:
        await client.aclose()


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
        await producer.push_many(exact_traj("b", i) for i in range(n))
        steady_stop = asyncio.Event()
        steady = Worker(redis_url, Timed(0.01, 0.03), ConsumerConfig(consumer="steady", **base))
        steady_task = asyncio.ensure_future(steady.run(steady_stop))
        try:
            for round_ in range(6):
                stop = asyncio.Event()
                w = Worker(redis_url, Timed(0.01, 0.05), ConsumerConfig(consumer=f"flaky{round_}", **base))
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
            return Scored(identity_score(t))

    keys = Keys(namespace)
    n = 16
    cfg = dict(namespace=namespace, block_ms=20, concurrency=32, reclaim_idle_ms=60_000, drain_timeout_s=0.2)
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as p,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await p.open_batch("gs", n, 8)
        await p.push_many(exact_traj("gs", i) for i in range(n))
        stop = asyncio.Event()
        w1 = Worker(redis_url, OneSlow(), ConsumerConfig(consumer="w1", **cfg))
        run = asyncio.ensure_future(w1.run(stop))
        from helpers import wait_until

        async def fifteen_settled() -> bool:
            return await p.client.hlen(keys.results("gs")) == 15

        await wait_until(fifteen_settled, timeout_s=10)
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


# --- the release never takes what another consumer holds


async def test_a_twin_with_the_same_consumer_name_does_not_release_the_live_twins_entries(redis_url, namespace) -> None:
    """Misconfiguration: two live workers run under the consumer name 'w1'. A holds two
    slow samples; B (same name) starts and stops. B's release takes every entry pending
    under 'w1' -- A's, which A is scoring -- and marks them idle for ever: a burst peer
    then scores them a second time while A is still alive. B should either refuse to run
    under a name a live worker uses, or release only what it read itself."""
    keys = Keys(namespace)
    client = connect(redis_url)
    await push_exact(redis_url, namespace, "T", 2)
    a_scorer = Counting(first=2.0)
    a = Worker(redis_url, a_scorer, stop_config(namespace, "w1"))
    a_stop = asyncio.Event()
    a_run = asyncio.ensure_future(a.run(a_stop))
    try:
        await asyncio.wait_for(a_scorer.started.wait(), 5)
        await asyncio.sleep(0.1)
        b = Worker(redis_url, Counting(first=0.0), stop_config(namespace, "w1"))
        b_stop = asyncio.Event()
        b_run = asyncio.ensure_future(b.run(b_stop))
        await asyncio.sleep(0.3)
        b_stop.set()
        await asyncio.wait_for(b_run, 10)
        await b.aclose()
        peer_scorer = Counting(first=0.0)
        await burst_peer(redis_url, namespace, peer_scorer)
        rows = await pending_rows(client, keys)
        assert not peer_scorer.calls, (
            f"a peer scored {dict(peer_scorer.calls)} while live worker A (consumer 'w1') was still scoring "
            f"{dict(a_scorer.calls)}: its twin's release under the same name handed A's entries over "
            f"(pending now: {rows})"
        )
    finally:
        a_stop.set()
        await asyncio.wait_for(a_run, 10)
        await a.aclose()
        await client.aclose()


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
    rows = await pending_of_stream(redis_url, namespace)
    assert [(r[0], r[1]) for r in rows] == [(eid, b"peer")], (
        f"the stopping worker's release took the entry back from the live peer that claimed it: {rows}"
    )


async def test_a_release_stalled_past_a_peers_claim_does_not_take_the_entry_from_the_peer(redis_url, namespace) -> None:
    """The stopping worker looks at its entry (idle: a few ms, it renewed it just before),
    then stalls (a slow Redis) long enough for a peer's sweep to claim the entry and start
    scoring it. The release's XCLAIM (min-idle = the idle seen) must not take it from the
    live peer: marked idle for ever under the stopped consumer, any third worker would
    take it at once and score it a second time."""
    keys = Keys(namespace)
    stream = keys.stream()
    client = connect(redis_url)
    wc = connect(redis_url)
    stop = asyncio.Event()
    hooked: list = []
    stolen: list = []
    peer_scorer = Delays(default=5.0)
    peer = Worker(
        redis_url, peer_scorer, cfg(namespace, "P", reclaim_idle_ms=300, reclaim_interval_s=0.05, concurrency=4)
    )

    real_evalsha = wc.evalsha

    async def evalsha(*args):
        release = _RELEASED_IDLE_MS in args
        if release and not hooked:
            hooked.append(1)
            # A stall (a slow Redis) before the release runs: the peer's sweep claims the
            # entry meanwhile and starts scoring it.
            await asyncio.wait_for(peer_scorer.started.wait(), 3)
        reply = await real_evalsha(*args)
        if release:
            (row,) = await client.xpending_range(stream, "scorers", min="-", max="+", count=1)
            if row["consumer"] != b"P":
                stolen.append((reply, row["consumer"]))
        return reply

    wc.evalsha = evalsha
    try:
        await push(redis_url, namespace, [exact_traj("R", 0)], k=1)
        mine = Delays(default=5.0)
        worker = Worker(redis_url, mine, cfg(namespace, "S", reclaim_idle_ms=150, drain_timeout_s=0.1), client=wc)
        run = asyncio.create_task(worker.run(stop))
        await asyncio.wait_for(mine.started.wait(), 5)
        peer_stop = asyncio.Event()
        peer_run = asyncio.create_task(peer.run(peer_stop))
        await asyncio.sleep(0.3)
        stop.set()
        await asyncio.wait_for(run, 10)
        peer_stop.set()
        await asyncio.wait_for(peer_run, 10)
        await peer.aclose()
        assert hooked, "the release never ran"
        assert peer_scorer.started.is_set(), "the peer never claimed the entry"
        assert not stolen, (
            f"the stopping worker's release claimed the entry a live peer was scoring (reply {stolen[0][0]}, "
            f"then held by {stolen[0][1]!r}, idle for ever): any worker takes it and scores it again"
        )
    finally:
        await wc.aclose()
        await client.aclose()


async def test_a_stop_in_one_group_releases_nothing_of_another_group_on_the_same_stream(redis_url, namespace) -> None:
    """Groups g1 and g2 read the same stream; their workers share the consumer name 'w'
    (names are per group). g1's worker stops while both hold slow samples: only g1's
    entries are released; g2's stay with its live worker, fresh, and g2 scores each once."""
    keys = Keys(namespace)
    client = connect(redis_url)
    await push_exact(redis_url, namespace, "G", 2)
    s1, s2 = Counting(first=5.0), Counting(first=1.0)
    w1 = Worker(redis_url, s1, stop_config(namespace, "w", group="g1"))
    w2 = Worker(redis_url, s2, stop_config(namespace, "w", group="g2"))
    stop1, stop2 = asyncio.Event(), asyncio.Event()
    r1, r2 = asyncio.ensure_future(w1.run(stop1)), asyncio.ensure_future(w2.run(stop2))
    try:
        await asyncio.wait_for(asyncio.gather(s1.started.wait(), s2.started.wait()), 30)
        await asyncio.sleep(0.1)
        stop1.set()
        await asyncio.wait_for(r1, 30)
        g1 = await pending_rows(client, keys, "g1")
        g2 = await pending_rows(client, keys, "g2")
        assert g1 and all(idle >= _RELEASED_IDLE_MS // 2 for _, _, idle, _ in g1), g1
        assert g2 and all(idle < 5_000 for _, _, idle, _ in g2), f"g2's live entries were released: {g2}"
        await asyncio.sleep(1.2)
        stop2.set()
        await asyncio.wait_for(r2, 30)
        got = Counter(r.index for r in await results(client, keys, "G", "g2"))
        assert got == {0: 1, 1: 1} and set(s2.calls.values()) == {1}, (got, s2.calls)
    finally:
        stop1.set()
        stop2.set()
        await asyncio.gather(r1, r2, return_exceptions=True)
        await w1.aclose()
        await w2.aclose()
        await client.aclose()


# --- suspects at a stop: their notes dropped, released innocent


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
    _, rewards, left, letters = await peer_finishes_with_letters(redis_url, namespace, "a")
    assert not letters, (
        f"an innocent sample dead-lettered after a Redis blink and a stop: {[(d.reason, d.error) for d in letters]}"
    )
    assert unsettled(rewards) == [] and not left, (unsettled(rewards), left)


# --- entries that handed samples back: the rest handed back, the entry acked


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


async def test_a_lost_requeue_reply_then_a_graceful_stop_loses_no_sample(redis_url, namespace) -> None:
    """The requeue reply is lost (copies and record are there), the worker goes on with the
    samples itself, and is stopped while it scores them: the source entry is released whole.
    The peer that takes it leaves the recorded samples to their copies; every sample still
    gets one result."""
    keys = Keys(namespace)
    wc, lost = requeue_replies_lost(redis_url, every=True)
    client = connect(redis_url)
    try:
        await push(redis_url, namespace, [exact_traj("S", i) for i in range(4)], k=4)
        w1 = Worker(redis_url, Delays(default=3.0), cfg(namespace, "w1"), client=wc)
        stop = asyncio.Event()
        run = asyncio.create_task(w1.run(stop))
        await wait_until(lambda: _async(len(lost) >= 2), timeout_s=5, every_s=0.01)
        stop.set()
        await asyncio.wait_for(run, 10)
        peer = Delays(default=0.05)
        w2 = Worker(redis_url, peer, cfg(namespace, "w2", concurrency=8, reclaim_idle_ms=300))
        await asyncio.wait_for(w2.run(burst=True), 10)
        await w2.aclose()
        got = await one_result_each(client, keys, "S", 4)
        assert all(r.status == "ok" for r in got)
        assert await pending_count(client, keys) == 0
    finally:
        await wc.aclose()
        await client.aclose()


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


async def test_a_graceful_stop_after_a_hand_back_does_not_score_the_handed_back_samples_twice(
    redis_url, namespace
) -> None:
    """Worker a (concurrency 2) scores 2 samples of an entry of 16 and hands the other 14
    back; it is stopped before its 2 finish (drain 0.3 s): the source entry is released.
    Worker c then reclaims the source, which still lists all 16 samples, and reads the 14
    copies: each handed-back sample is scored twice (quota spent twice), though no process
    crashed."""
    keys = Keys(namespace)
    client = connect(redis_url)
    n = 16
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await producer.open_batch("q", n, 8)
            await producer.push_many(exact_traj("q", i) for i in range(n))
            async with running_worker(redis_url, namespace, Timed(2.0), consumer="a", concurrency=2):

                async def handed_back() -> bool:
                    return await client.xlen(keys.stream()) > 1

                await wait_until(handed_back, timeout_s=10)
            c = Timed(0.5)  # the copies are still being scored when the source comes back
            async with running_worker(redis_url, namespace, c, consumer="c", concurrency=32, reclaim_idle_ms=300):

                async def done() -> bool:
                    return (
                        await client.hlen(keys.results("q")) == n
                        and (await client.xpending(keys.stream(), "scorers"))["pending"] == 0
                        and await client.xlen(keys.stream()) > 0
                    )

                await wait_until(done, timeout_s=15)
                await asyncio.sleep(0.5)
            twice = sorted({u for u in c.seen if c.seen.count(u) > 1})
            rewards = await agg.collect("q", timeout_s=2, on_timeout="resolve")
            assert rewards.status == ["ok"] * n
            assert not twice, f"{len(twice)} samples scored twice after a graceful stop: {twice}"
    finally:
        await client.aclose()


@pytest.mark.parametrize("flush_s", [0.0, 1.5])
async def test_a_stop_with_a_handed_entrys_result_still_in_the_writer_scores_nothing_twice(
    redis_url, namespace, flush_s
) -> None:
    """Worker a (concurrency 2) starts samples 0 and 1 of an entry of 16 and hands 14 back.
    Sample 0 finishes; its result is in the writer's flush (a slow write) when the stop's
    drain deadline passes. _finish_handed looks the started samples up in the ledger, where
    sample 0's result is not yet, and hands it back as well: the next worker scores it a
    second time after a graceful stop."""
    keys = Keys(namespace)
    client = connect(redis_url)
    n = 16
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await producer.open_batch("f", n, 8)
            await producer.push_many(exact_traj("f", i) for i in range(n))
            a_scorer = Timed(delay=5.0, delays={0: 0.3})
            a = SlowFlush(
                redis_url,
                a_scorer,
                ConsumerConfig(namespace=namespace, consumer="a", block_ms=20, concurrency=2, drain_timeout_s=0.3),
            )
            a.flush_s = flush_s  # 0: the control, sample 0's result is written before the stop
            async with started(a):
                await wait_until(lambda: asyncio.sleep(0, a.stats.spilled > 0), timeout_s=10)
                await wait_until(lambda: asyncio.sleep(0, "f/0" in a_scorer.seen), timeout_s=10)
                await asyncio.sleep(0.5)  # sample 0 scored; its result is being written
            c = Timed(0.01)
            await finish_with_burst(redis_url, namespace, c, reclaim_idle_ms=300)
            rewards = await agg.collect("f", timeout_s=3, on_timeout="resolve")
            assert rewards.status == ["ok"] * n
            assert rewards.scores == pytest.approx([identity_score(exact_traj("f", i)) for i in range(n)])
            assert await nothing_pending(client, keys)
            twice = sorted(u for u in set(c.seen) if u in a_scorer.seen[:1] or c.seen.count(u) > 1)
            assert not twice, f"scored twice after a graceful stop: {twice} (a scored {a_scorer.seen})"
    finally:
        await client.aclose()


# (No "xack" case: the entry's ack goes through the writer, after the results still queued
# for it, and the writer's failures are tested in tests/e2e/test_reliability.py.)
@pytest.mark.parametrize("failing", ["", "lookup", "requeue", "requeue_lost"])
async def test_redis_failing_the_hand_back_of_the_rest_at_a_stop_loses_nothing(
    redis_url, namespace, failing, caplog
) -> None:
    """a starts 2 samples of an entry of 16, hands 14 back, and is stopped before its 2
    finish. One step of handing back the 2 fails: the entry must be released whole and
    every sample still get exactly one result, its own."""
    keys = Keys(namespace)
    client = connect(redis_url)
    n = 16
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await producer.open_batch("h", n, 8)
            await producer.push_many(exact_traj("h", i) for i in range(n))
            a = FailingFinish(
                redis_url,
                Timed(5.0),
                ConsumerConfig(namespace=namespace, consumer="a", block_ms=20, concurrency=2, drain_timeout_s=0.3),
            )
            a.failing = failing
            async with started(a):
                await wait_until(lambda: asyncio.sleep(0, a.stats.spilled > 0), timeout_s=10)
            c = Timed(0.01)
            await finish_with_burst(redis_url, namespace, c, reclaim_idle_ms=300)
            rewards = await agg.collect("h", timeout_s=3, on_timeout="resolve")
            assert rewards.status == ["ok"] * n
            assert rewards.scores == pytest.approx([identity_score(exact_traj("h", i)) for i in range(n)])
            assert await nothing_pending(client, keys)
            assert ("released whole" in caplog.text) == bool(failing), caplog.text[-2000:]
            if not failing:
                twice = sorted(u for u in set(c.seen) if c.seen.count(u) > 1)
                assert not twice, twice
    finally:
        await client.aclose()


@pytest.mark.parametrize("flush_s", [0.0, 1.5])
async def test_a_stop_after_a_hand_back_whose_started_samples_include_a_dead_letter(
    redis_url, namespace, flush_s
) -> None:
    """Sample 0 of an entry of 16 is garbled: a (concurrency 2) dead-letters it, starts
    sample 1 (slow) and hands 14 back; it is stopped. _finish_handed must count the dead
    letter as settled: one dead letter, sample 0 `failed` once, the others `ok`."""
    from stream_reward.ops.deadletters import list_dead_letters
    from stream_reward.wire.entries import read_members

    keys = Keys(namespace)
    client = connect(redis_url)
    n = 16
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await producer.open_batch("dl", n, 8)
            await producer.push_many(exact_traj("dl", i) for i in range(n))
            ((eid, fields),) = await client.xrange(keys.stream())
            size0 = read_members(fields)[0][3]
            fields = dict(fields)
            fields[b"d"] = b"\xc1" * size0 + fields[b"d"][size0:]  # 0xc1: never valid msgpack
            await client.xdel(keys.stream(), eid)
            await client.xadd(keys.stream(), fields)
            a = SlowFlush(
                redis_url,
                Timed(5.0),
                ConsumerConfig(namespace=namespace, consumer="a", block_ms=20, concurrency=2, drain_timeout_s=0.3),
            )
            a.flush_s = flush_s
            async with started(a):
                await wait_until(lambda: asyncio.sleep(0, a.stats.spilled > 0), timeout_s=10)
                await asyncio.sleep(0.3)
            c = Timed(0.01)
            await finish_with_burst(redis_url, namespace, c, reclaim_idle_ms=300)
            letters = await list_dead_letters(redis_url, namespace=namespace)
            rewards = await agg.collect("dl", timeout_s=3, on_timeout="resolve")
            assert rewards.status == ["failed"] + ["ok"] * (n - 1)
            assert await nothing_pending(client, keys)
            assert len(letters) == 1, [(d.reason, d.consumer if hasattr(d, "consumer") else "") for d in letters]
    finally:
        await client.aclose()


@pytest.mark.parametrize("fail", [False, True])
async def test_a_stop_while_a_hand_back_is_in_flight_loses_and_repeats_nothing(redis_url, namespace, fail) -> None:
    keys = Keys(namespace)
    client = connect(redis_url)
    n = 16
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await producer.open_batch("sp", n, 8)
            await producer.push_many(exact_traj("sp", i) for i in range(n))
            sa = Timed(3.0)
            a = SlowSpill(
                redis_url,
                sa,
                ConsumerConfig(namespace=namespace, consumer="a", block_ms=20, concurrency=2, drain_timeout_s=0.3),
            )
            a.fail = fail
            async with started(a):
                await wait_until(lambda: asyncio.sleep(0, a.in_spill), timeout_s=10)
            c = Timed(0.01)
            await finish_with_burst(redis_url, namespace, c, reclaim_idle_ms=300)
            rewards = await agg.collect("sp", timeout_s=3, on_timeout="resolve")
            assert rewards.status == ["ok"] * n
            assert rewards.scores == pytest.approx([identity_score(exact_traj("sp", i)) for i in range(n)])
            assert await nothing_pending(client, keys)
            twice = sorted(u for u in set(c.seen) if c.seen.count(u) > 1)
            assert not twice, twice
    finally:
        await client.aclose()


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_workers_stopped_again_and_again_mid_hand_back_complete_no_sample_twice(
    redis_url, namespace, seed
) -> None:
    """Workers of concurrency 3 (entries of 16: each read hands 13 back) are stopped at
    random moments one after another; every sample gets its own result once, and no sample's
    scoring completes twice."""
    import random

    rnd = random.Random(seed)
    keys = Keys(namespace)
    client = connect(redis_url)
    n = 64
    done: list[str] = []
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await producer.open_batch("rs", n, 8)
            await producer.push_many(exact_traj("rs", i) for i in range(n))
            for k in range(6):
                s = Completes(rnd, 0.4)
                async with running(redis_url, namespace, s, consumer=f"w{k}", concurrency=3, reclaim_idle_ms=300):
                    await asyncio.sleep(rnd.random() * 0.8)
                done += s.done
            s = Completes(rnd, 0.02)
            await finish_with_burst(redis_url, namespace, s, reclaim_idle_ms=300, concurrency=3)
            done += s.done
            rewards = await agg.collect("rs", timeout_s=3, on_timeout="resolve")
            assert rewards.status == ["ok"] * n
            assert rewards.scores == pytest.approx([identity_score(exact_traj("rs", i)) for i in range(n)])
            assert await nothing_pending(client, keys)
            twice = sorted(u for u in set(done) if done.count(u) > 1)
            assert not twice, twice
    finally:
        await client.aclose()


# --- a stop stays bounded when Redis is slow or away


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


async def test_a_stop_with_redis_hanging_and_a_flush_in_flight_stays_bounded(redis_url, namespace) -> None:
    """Redis stops answering (every command hangs) just as a sample's result goes out, and
    the stop comes at once. The drain waits its 2 s for the sweep and renewal under way,
    then the writer gets 0.5 s + 1 s + 1 s, then the release 2 s, then the farewell 1 s:
    the budgets add up instead of being shared."""
    await push_exact(redis_url, namespace, "S", 1)
    stop = asyncio.Event()
    hang = asyncio.Event()
    wc = connect(redis_url)
    real = wc.execute_command

    async def execute_command(*a, **kw):
        if hang.is_set():
            await asyncio.sleep(60)  # Redis (or the link) hangs
        return await real(*a, **kw)

    wc.execute_command = execute_command

    class HangAfter(Counting):
        async def score(self, t):
            out = await super().score(t)
            hang.set()
            stop.set()
            return out

    w = Worker(
        redis_url,
        HangAfter(first=0.0),
        stop_config(namespace, "w1", reclaim_idle_ms=300, reclaim_interval_s=0.05),
        client=wc,
    )
    run = asyncio.ensure_future(w.run(stop))
    try:
        await asyncio.wait_for(stop.wait(), 5)
        t0 = asyncio.get_running_loop().time()
        await asyncio.wait_for(run, 30)
        took = asyncio.get_running_loop().time() - t0
    finally:
        wc.execute_command = real
        await w.aclose()
    assert took < 0.3 + 5.0, f"a stop with Redis hanging took {took:.1f} s (drain_timeout_s 0.3)"


async def test_a_stop_while_a_lane_reconnects_to_a_hung_password_server_returns_and_leaks_nothing(
    namespace,
) -> None:
    """The lanes' connections are killed and the server hung (SIGSTOP) at once: the lanes'
    reconnection hangs in its AUTH/SELECT handshake. A stop must end run() in time, and
    leave no task or transport behind while the server stays hung."""
    with EmbeddedServer(extra_args=["--requirepass", "pw-h"]) as server:
        url = f"unix://:pw-h@{server.socket_path}?db=4"
        await push_exact(url, namespace, "hr", 4)
        admin = connect(url)
        scorer = Counting(first=5.0)
        w = Worker(url, scorer, stop_config(namespace, "w1"))
        stop = asyncio.Event()
        before = set(asyncio.all_tasks())
        run = asyncio.ensure_future(w.run(stop))
        assert server.pid
        try:
            await asyncio.wait_for(scorer.started.wait(), 5)
            await asyncio.sleep(0.2)
            await kill_lane_like(admin)
            os.kill(server.pid, signal.SIGSTOP)
            await asyncio.sleep(0.5)
            stop.set()
            t0 = time.monotonic()
            done, _ = await asyncio.wait([run], timeout=0.3 + 5.5)
            assert done, f"run() not back {time.monotonic() - t0:.1f} s after a stop"
            await asyncio.sleep(0.5)
            left = [
                t
                for t in asyncio.all_tasks() - before - {asyncio.current_task(), run}
                if not t.done() and "lane" in repr(t.get_coro())
            ]
            assert not left, f"lane tasks left running after run() returned: {left}"
        finally:
            os.kill(server.pid, signal.SIGCONT)
            run.cancel()
            await asyncio.wait([run], timeout=5)
            await w.aclose()
            await admin.aclose()
