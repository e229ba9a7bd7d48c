"""Third attack round on entries of several samples: a stop after a hand-back (results still
in the writer, Redis failing the hand-back of the rest), quarantine notes and stops."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from helpers import Timed, exact_traj, identity_score, started, undelivered_samples, wait_until

from stream_reward import ProducerConfig, RewardAggregator, RolloutProducer, Trajectory
from stream_reward.config import ConsumerConfig
from stream_reward.scoring.scorer import Scored
from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys
from stream_reward.worker.consumer import Worker

pytestmark = pytest.mark.anyio


traj, expected = exact_traj, identity_score


class SlowFlush(Worker):
    """A worker whose result writes take ``flush_s`` (a loaded Redis, a slow link)."""

    flush_s = 0.0

    async def _flush(self, batch):  # type: ignore[override]
        if self.flush_s:
            await asyncio.sleep(self.flush_s)
        await super()._flush(batch)


async def finish_with_burst(redis_url: str, namespace: str, scorer, **cfg) -> None:
    w = Worker(redis_url, scorer, ConsumerConfig(namespace=namespace, block_ms=20, consumer="burst", **cfg))
    await asyncio.wait_for(w.run(asyncio.Event(), burst=True), 60)
    await w.aclose()


async def nothing_pending(client, keys: Keys) -> bool:
    return (await client.xpending(keys.stream(), "scorers"))["pending"] == 0


# ======================================================================================
# A stop after a hand-back


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
            await producer.push_many(traj("f", i) for i in range(n))
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
            assert rewards.scores == pytest.approx([expected(traj("f", i)) for i in range(n)])
            assert await nothing_pending(client, keys)
            twice = sorted(u for u in set(c.seen) if u in a_scorer.seen[:1] or c.seen.count(u) > 1)
            assert not twice, f"scored twice after a graceful stop: {twice} (a scored {a_scorer.seen})"
    finally:
        await client.aclose()


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


# (An "xack" case went: the entry's ack now goes through the writer, after the results
# still queued for it, and the writer's failures are attacked in test_reliability.py.)
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
            await producer.push_many(traj("h", i) for i in range(n))
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
            assert rewards.scores == pytest.approx([expected(traj("h", i)) for i in range(n)])
            assert await nothing_pending(client, keys)
            assert ("released whole" in caplog.text) == bool(failing), caplog.text[-2000:]
            if not failing:
                twice = sorted(u for u in set(c.seen) if c.seen.count(u) > 1)
                assert not twice, twice
    finally:
        await client.aclose()


# ======================================================================================
# Quarantine


async def _suspects(client, keys: Keys, count: int) -> list[bytes]:
    """The stream's first ``count`` entries, delivered twice to consumers that died: the
    next claim makes them suspects (quarantine_after_deliveries=2)."""
    got = await client.xreadgroup("scorers", "dead", {keys.stream(): ">"}, count=count)
    ids = [eid for eid, _ in got[0][1]]
    await client.xclaim(keys.stream(), "scorers", "dead2", 0, ids)
    return ids


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
    from redis.exceptions import ConnectionError as RedisConnectionError

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
            await producer.push_many(traj("qn", i) for i in range(n))
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


class ByBatch:
    inline = False

    def __init__(self, delays: dict[str, float]) -> None:
        self.delays = delays
        self.seen: list[str] = []

    async def score(self, t: Trajectory) -> Scored:
        self.seen.append(t.uid)
        await asyncio.sleep(self.delays.get(t.batch_id, 0.01))
        return Scored(expected(t))


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
            await producer.push_many(traj("z", i) for i in range(n))
            ids = await _suspects(client, keys, 10)
            assert len(ids) == 3
            async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace, samples_per_entry=1)) as singles:
                await singles.open_batch("w", 8, 8)
                await singles.push_many(traj("w", i) for i in range(8))
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
            await producer.push_many(traj("dl", i) for i in range(n))
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


# ======================================================================================
# Stamps without the pushed counts


async def test_stamps_stay_exact_when_the_counts_go_while_workers_hand_back_and_producers_push(
    redis_url, namespace
) -> None:
    """The pushed-counts hash is deleted again and again while two workers (concurrency 2)
    hand samples back and a producer pushes: every entry's stamp is still the samples queued
    before it in stream order, and backlog() never reads below the truth."""
    from helpers import samples_of

    from stream_reward.wire.push import FIELD_STAMP  # noqa: F401

    keys = Keys(namespace)
    client = connect(redis_url)
    n = 160
    try:
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
            await producer.open_batch("k", n, 8)
            await producer.push_many(traj("k", i) for i in range(64))
            await client.delete(keys.pushed(0))
            cfg = dict(concurrency=2, trim_interval_s=3600)
            async with (
                running(redis_url, namespace, Timed(0.05), consumer="a", **cfg) as a,
                running(redis_url, namespace, Timed(0.05), consumer="b", **cfg) as b,
            ):

                async def deleter():
                    for _ in range(40):
                        await client.delete(keys.pushed(0))
                        await asyncio.sleep(0.005)

                async def pusher():
                    for lo in range(64, n, 8):
                        await producer.push_many(traj("k", i) for i in range(lo, lo + 8))
                        await asyncio.sleep(0.01)

                await asyncio.gather(deleter(), pusher())
            # Read once both stopped: a stop hands back the samples it started and cancelled.
            spilled = a.stats.spilled + b.stats.spilled
            assert spilled > 0
            # With workers reading meanwhile a reading may fall legitimately between the two
            # looks: only checked once they stopped, with the counts gone and back.
            low: list[tuple[int, int]] = []
            for _ in range(2):
                truth = await undelivered_samples(client, keys)
                low.append((truth, await producer.backlog()))
                await client.delete(keys.pushed(0))
            entries = await client.xrange(keys.stream())
            # A worker trims at its start: on a slow machine the first entry may already be
            # acked (its samples scored or handed back) and gone. The first left starts the
            # count; the total below still checks that stamp.
            before = int(entries[0][1][b"n"]) if entries else 0
            for eid, fields in entries:
                assert int(fields[b"n"]) == before, (eid, before)
                before += len(samples_of(fields))
            assert before == n + spilled
            assert all(got >= b for b, got in low), [x for x in low if x[1] < x[0]]
    finally:
        await client.aclose()


@contextlib.asynccontextmanager
async def running(url: str, ns: str, scorer, **cfg):
    w = Worker(url, scorer, ConsumerConfig(namespace=ns, block_ms=20, drain_timeout_s=0.3, **cfg))
    async with started(w):
        yield w


async def test_a_stop_during_a_burst_workers_quarantine_is_honoured_within_the_drain_deadline(
    redis_url, namespace
) -> None:
    """A burst worker's last pass claims a suspect entry of 4 and hunts it in its own task
    (not the background reclaimer that a stop cancels). A stop mid-hunt must end the run
    within the drain deadline: here the hunt goes on sample by sample (2 s each), ignoring
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
            await producer.push_many(traj("bq", i) for i in range(n))
            await _suspects(client, keys, 1)
            await asyncio.sleep(0.4)
            s = Timed(2.0)
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
            assert took < 1.5, f"a stop mid-quarantine took {took:.1f} s (drain deadline 0.3 s); hunted {s.seen}"
    finally:
        await client.aclose()


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
        return Scored(expected(t))


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
            await producer.push_many(traj("cu", i) for i in range(n))
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


@pytest.mark.parametrize("per_entry", [1, 16, 1024])
async def test_stamps_go_on_from_the_newest_entry_of_any_size_when_the_counts_are_gone(
    redis_url, namespace, per_entry
) -> None:
    """The counts go after a push of entries of ``per_entry`` samples (up to 1024: the
    script counts the newest entry's headers by unpacking them all onto Lua's stack); the
    next push is stamped with every sample before it."""
    from helpers import samples_of

    keys = Keys(namespace)
    client = connect(redis_url)
    n = 2 * per_entry  # the newest entry full
    try:
        async with RolloutProducer(
            redis_url, ProducerConfig(namespace=namespace, samples_per_entry=per_entry)
        ) as producer:
            await producer.open_batch("e", n + 5, 8)
            await producer.push_many(traj("e", i) for i in range(n))
            await client.delete(keys.pushed(0))
            await producer.push_many(traj("e", i) for i in range(n, n + 5))
            before = 0
            for _, fields in await client.xrange(keys.stream()):
                assert int(fields[b"n"]) == before
                before += len(samples_of(fields))
            assert before == n + 5
            assert await producer.backlog() == n + 5
    finally:
        await client.aclose()


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
            await producer.push_many(traj("sp", i) for i in range(n))
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
            assert rewards.scores == pytest.approx([expected(traj("sp", i)) for i in range(n)])
            assert await nothing_pending(client, keys)
            twice = sorted(u for u in set(c.seen) if c.seen.count(u) > 1)
            assert not twice, twice
    finally:
        await client.aclose()


class Completes:
    """Records a sample once its scoring completed (not cancelled)."""

    inline = False

    def __init__(self, rnd, delay: float) -> None:
        self.rnd, self.delay = rnd, delay
        self.done: list[str] = []

    async def score(self, t: Trajectory) -> Scored:
        await asyncio.sleep(self.rnd.random() * self.delay)
        self.done.append(t.uid)
        return Scored(expected(t))


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
            await producer.push_many(traj("rs", i) for i in range(n))
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
            assert rewards.scores == pytest.approx([expected(traj("rs", i)) for i in range(n)])
            assert await nothing_pending(client, keys)
            twice = sorted(u for u in set(done) if done.count(u) > 1)
            assert not twice, twice
    finally:
        await client.aclose()
