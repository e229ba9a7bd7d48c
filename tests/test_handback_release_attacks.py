"""Attacks on the hand-back record (d88867d), the release at a stop (b32de5c) and the
split of entries with unreadable headers (0363e81). Guarantees: every sample gets exactly
one result and is never lost; no sample is scored twice by live workers except after a
real crash of a worker that was scoring it (or the known cost of a lost requeue reply);
an innocent sample is never dead-lettered; a release never takes an entry a live peer
holds. Interleavings are forced with wrapped client methods; crashes are real SIGKILLs."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import signal
from collections import Counter

import msgpack
import pytest
from helpers import done_results, exact_traj, identity_score, wait_until
from redis.exceptions import ConnectionError as RedisConnectionError

from stream_reward import ProducerConfig, RolloutProducer, Trajectory
from stream_reward.config import ConsumerConfig
from stream_reward.ops.deadletters import list_dead_letters, redrive_dead_letters
from stream_reward.scoring.scorer import Scored
from stream_reward.wire.codec import encode_trajectory
from stream_reward.wire.connection import connect
from stream_reward.wire.entries import FIELD_HANDED_BACK
from stream_reward.wire.keys import Keys
from stream_reward.wire.push import REQUEUE_SCRIPT
from stream_reward.worker.consumer import Worker
from stream_reward.worker.stop import _RELEASED_IDLE_MS

pytestmark = pytest.mark.anyio

LOGGED = ("--scorer", "python:tests/data/reliability_scorers.py:logged")


class Delays:
    """Scores by identity after ``delays[uid]`` seconds (``default`` otherwise) on a
    sample's first attempt, ``later`` after; counts attempts per (batch, uid)."""

    inline = False

    def __init__(self, delays: dict[str, float] | None = None, default: float = 0.05, later: float = 0.0) -> None:
        self.delays, self.default, self.later = delays or {}, default, later
        self.calls: Counter[tuple[str, str]] = Counter()
        self.started = asyncio.Event()

    async def score(self, t):
        self.calls[t.batch_id, t.uid] += 1
        self.started.set()
        first = self.calls[t.batch_id, t.uid] == 1
        await asyncio.sleep(self.delays.get(t.uid, self.default) if first else self.later)
        return Scored(identity_score(t))


def cfg(namespace: str, consumer: str, **kw) -> ConsumerConfig:
    return ConsumerConfig(
        namespace=namespace, consumer=consumer, **{"block_ms": 20, "drain_timeout_s": 0.3, "concurrency": 1, **kw}
    )


async def push(redis_url: str, namespace: str, trajs: list[Trajectory], *, k: int, partitions: int = 1) -> None:
    async with RolloutProducer(
        redis_url, ProducerConfig(namespace=namespace, samples_per_entry=k, partitions=partitions)
    ) as p:
        for batch in dict.fromkeys(t.batch_id for t in trajs):
            await p.open_batch(batch, sum(1 for t in trajs if t.batch_id == batch), 8)
        await p.push_many(trajs)


async def results(client, keys: Keys, batch: str, group: str = "scorers") -> list:
    out = []
    for p in range(keys.partitions):
        out += await done_results(client, keys.done(batch, p, group))
    return out


async def one_result_each(client, keys: Keys, batch: str, n: int, group: str = "scorers") -> list:
    got = await results(client, keys, batch, group)
    by_index = Counter(r.index for r in got)
    assert sorted(by_index) == list(range(n)) and set(by_index.values()) == {1}, (
        f"batch {batch!r} of group {group!r}: results by index {dict(by_index)} (want one for each of 0..{n - 1})"
    )
    return got


async def settle(client, keys: Keys, batch: str, n: int, timeout_s: float) -> None:
    """Wait (up to ``timeout_s``) for ``n`` results of ``batch`` and nothing pending; then
    assert one result each."""

    async def all_in() -> bool:
        return len(await results(client, keys, batch)) >= n and await pending_count(client, keys) == 0

    with contextlib.suppress(AssertionError):
        await wait_until(all_in, timeout_s=timeout_s)
    await one_result_each(client, keys, batch, n)


async def pending_count(client, keys: Keys, group: str = "scorers") -> int:
    total = 0
    for stream in keys.streams():
        total += (await client.xpending(stream, group))["pending"]
    return total


async def copies_on(client, keys: Keys, partition: int = 0) -> list:
    return [f for _, f in await client.xrange(keys.stream(partition)) if FIELD_HANDED_BACK in f]


def calls_by(log_path) -> list[tuple[str, int]]:
    return [(tag, int(pid)) for tag, pid in (line.split() for line in log_path.read_text().splitlines())]


# ---------------------------------------------------------------------- hand-back record + SIGKILL
async def test_the_hand_back_record_does_not_settle_a_sample_of_another_batch_with_the_same_uid(
    redis_url, namespace, spawn_workers, tmp_path
) -> None:
    """Uids are unique within a batch (the ledger and the claims are per batch), and a
    producer packs consecutive samples of several batches into one entry. A worker of
    concurrency 1 starts A's sample "x" and hands back B's sample "x", then is SIGKILLed.
    The survivor that reclaims the entry must still score A/x: only B/x was handed back."""
    keys = Keys(namespace)
    log = tmp_path / "calls.log"
    log.touch()
    # A/x is held until the victim is dead: it dies scoring A, however late the kill comes
    # (a 2 s scorer could finish first on a loaded machine, and its 2 s again in the survivor
    # plus the survivor's start and the reclaim were most of the 6 s this test waited).
    hold = tmp_path / "hold"
    hold.touch()
    client = connect(redis_url)
    try:
        info = {"log": str(log)}
        await push(
            redis_url,
            namespace,
            [
                Trajectory(
                    "A",
                    0,
                    "test",
                    response="ok",
                    uid="x",
                    extra_info={**info, "tag": "A", "hold": str(hold), "sleep_s": 0.1},
                ),
                Trajectory("B", 0, "test", response="ok", uid="x", extra_info={**info, "tag": "B", "sleep_s": 0.1}),
            ],
            k=2,
        )
        (victim,) = spawn_workers(1, *LOGGED, "--reclaim-idle-ms", "600", "--concurrency", "1")

        async def handed() -> bool:
            return len(await copies_on(client, keys)) >= 1 and "A" in log.read_text()

        await wait_until(handed, timeout_s=15, every_s=0.01)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        assert not await results(client, keys, "A"), "A/x scored before the kill, while held"
        hold.unlink()
        spawn_workers(1, *LOGGED, "--reclaim-idle-ms", "600", "--concurrency", "4")

        async def both() -> bool:
            return bool(await results(client, keys, "A")) and bool(await results(client, keys, "B"))

        try:
            await wait_until(both, timeout_s=15)
        except AssertionError:
            pass
        a, b = await results(client, keys, "A"), await results(client, keys, "B")
        pending = await pending_count(client, keys)
        assert [r.status for r in b] == ["ok"]
        assert [r.status for r in a] == ["ok"], (
            f"sample A/x was never scored after its worker died (results {a}, {pending} entries pending, "
            f"calls {calls_by(log)}): the redelivery took B's hand-back of uid 'x' for A's"
        )
    finally:
        await client.aclose()


async def test_samples_handed_back_to_a_worker_that_also_dies_are_scored_once_by_the_survivor(
    redis_url, namespace, spawn_workers, tmp_path
) -> None:
    """A worker hands 3 of 4 samples back and is SIGKILLed; a second worker takes the copies
    and is SIGKILLed too. The survivor must score the source's unhanded sample and each copy,
    each once: nothing lost, nothing scored from both the source and its copy."""
    keys = Keys(namespace)
    log = tmp_path / "calls.log"
    log.touch()
    hold = tmp_path / "hold"
    hold.touch()
    info = {"log": str(log), "hold": str(hold), "sleep_s": 0.1}
    client = connect(redis_url)
    try:
        await push(
            redis_url,
            namespace,
            [Trajectory("h", i, "test", response="ok", extra_info={**info, "tag": i}) for i in range(4)],
            k=4,
        )
        (v1,) = spawn_workers(1, *LOGGED, "--reclaim-idle-ms", "600", "--concurrency", "1")
        await wait_until(lambda: _async(len(log.read_text().splitlines()) >= 1), timeout_s=15, every_s=0.01)
        await wait_until(lambda: _len_at_least(copies_on(client, keys), 3), timeout_s=5, every_s=0.01)
        (v2,) = spawn_workers(1, *LOGGED, "--reclaim-idle-ms", "600", "--concurrency", "8")
        await wait_until(lambda: _async(len(log.read_text().splitlines()) >= 4), timeout_s=15, every_s=0.01)
        for v in (v1, v2):
            v.send_signal(signal.SIGKILL)
            v.wait()
        assert not await results(client, keys, "h"), "scored before the kills, while held"
        hold.unlink()
        (survivor,) = spawn_workers(1, *LOGGED, "--reclaim-idle-ms", "600", "--concurrency", "8")

        await settle(client, keys, "h", 4, timeout_s=12)
        by_survivor = Counter(tag for tag, pid in calls_by(log) if pid == survivor.pid)
        assert sorted(by_survivor) == ["0", "1", "2", "3"] and set(by_survivor.values()) == {1}, (
            f"the survivor's scorer calls by sample: {dict(by_survivor)}"
        )
    finally:
        await client.aclose()


async def _async(value):
    return value


async def _len_at_least(awaitable, n: int) -> bool:
    return len(await awaitable) >= n


# ---------------------------------------------------------------------- requeue reply lost
def requeue_replies_lost(redis_url: str, *, every: bool) -> tuple:
    """A worker's client whose requeue script runs but whose reply is lost (the first time,
    or ``every`` time), and the list of the replies lost."""
    sha = hashlib.sha1(REQUEUE_SCRIPT.encode()).hexdigest()
    wc = connect(redis_url)
    original = wc.evalsha
    lost: list = []

    async def evalsha(script_sha, numkeys, *args):
        reply = await original(script_sha, numkeys, *args)
        if script_sha == sha and (every or not lost):
            lost.append(reply)
            raise RedisConnectionError("the requeue reply was lost")
        return reply

    wc.evalsha = evalsha
    return wc, lost


async def test_a_lost_requeue_reply_loses_no_sample_and_leaves_nothing_pending(redis_url, namespace) -> None:
    """The requeue script runs (copies queued, record written) but its reply is lost: the
    worker scores the rest itself. Every sample must end with exactly one result, the
    source and every copy acked; scoring twice is the known cost."""
    keys = Keys(namespace)
    wc, lost = requeue_replies_lost(redis_url, every=False)
    client = connect(redis_url)
    try:
        await push(redis_url, namespace, [exact_traj("L", i) for i in range(6)], k=6)
        scorer = Delays(default=0.1)
        worker = Worker(redis_url, scorer, cfg(namespace, "w1"), client=wc)
        await asyncio.wait_for(worker.run(burst=True), 15)
        assert lost, "the requeue script never ran: no hand-back happened"
        got = await one_result_each(client, keys, "L", 6)
        assert all(r.status == "ok" for r in got)
        assert await pending_count(client, keys) == 0, "entries left pending after the burst"
        assert not await list_dead_letters(redis_url, namespace=namespace)
    finally:
        await wc.aclose()
        await client.aclose()


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


# ---------------------------------------------------------------------- groups, partitions
async def test_two_groups_each_handing_back_score_every_sample_once_per_group(redis_url, namespace) -> None:
    keys = Keys(namespace)
    client = connect(redis_url)
    try:
        await push(redis_url, namespace, [exact_traj("G", i) for i in range(8)], k=8)
        s1, s2 = Delays(default=0.05), Delays(default=0.05)
        w1 = Worker(redis_url, s1, cfg(namespace, "a", concurrency=2))
        w2 = Worker(redis_url, s2, cfg(namespace, "b", concurrency=2, group="g2"))
        await asyncio.wait_for(asyncio.gather(w1.run(burst=True), w2.run(burst=True)), 15)
        for w in (w1, w2):
            await w.aclose()
        assert w1.stats.spilled and w2.stats.spilled, "no hand-back happened"
        for group, scorer in (("scorers", s1), ("g2", s2)):
            await one_result_each(client, keys, "G", 8, group)
            assert set(scorer.calls.values()) == {1}, f"group {group}: calls {dict(scorer.calls)}"
            assert await pending_count(client, keys, group) == 0
    finally:
        await client.aclose()


async def test_two_partitions_with_hand_backs_and_a_sigkilled_holder_lose_nothing(
    redis_url, namespace, spawn_workers, tmp_path
) -> None:
    """Two partitions (their entries can share an id). A worker of concurrency 2 hands back
    part of the entries of both partitions and is SIGKILLed; the survivor scores the rest
    of each source, once, from the right partition's record."""
    keys = Keys(namespace, 2)
    log = tmp_path / "calls.log"
    log.touch()
    client = connect(redis_url)
    args = (*LOGGED, "--reclaim-idle-ms", "600", "--partitions", "2")
    try:
        trajs = [
            Trajectory("P", i, "test", response="ok", extra_info={"log": str(log), "tag": i, "sleep_s": 1.5})
            for i in range(16)
        ]
        await push(redis_url, namespace, trajs, k=4, partitions=2)
        (victim,) = spawn_workers(1, *args, "--concurrency", "2")

        async def handed() -> bool:
            return len(await copies_on(client, keys, 0)) >= 1 and len(await copies_on(client, keys, 1)) >= 1

        await wait_until(handed, timeout_s=15, every_s=0.01)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        (survivor,) = spawn_workers(1, *args, "--concurrency", "32")

        await settle(client, keys, "P", 16, timeout_s=10)
        by_survivor = Counter(tag for tag, pid in calls_by(log) if pid == survivor.pid)
        twice = {t: c for t, c in by_survivor.items() if c > 1}
        assert not twice, f"the survivor scored these samples twice: {twice}"
    finally:
        await client.aclose()


# ---------------------------------------------------------------------- release vs a peer's claim
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


# ---------------------------------------------------------------------- run() twice
async def test_a_worker_run_twice_finishes_what_its_first_run_handed_back_and_released(redis_url, namespace) -> None:
    """First run: an entry of 4 (one started, 3 handed back) and a single-sample entry are
    in hand when it stops (the started samples cancelled). Second run of the same Worker
    object: every sample gets one result, nothing is dead-lettered, nothing stays pending."""
    keys = Keys(namespace)
    client = connect(redis_url)
    try:
        await push(redis_url, namespace, [exact_traj("T", i) for i in range(4)], k=4)
        await push(redis_url, namespace, [exact_traj("U", 0)], k=1)
        scorer = Delays(default=5.0, later=0.02)
        worker = Worker(redis_url, scorer, cfg(namespace, "same", concurrency=2, reclaim_idle_ms=300))
        stop = asyncio.Event()
        run = asyncio.create_task(worker.run(stop))
        await wait_until(lambda: _async(sum(scorer.calls.values()) >= 2), timeout_s=5, every_s=0.01)
        stop.set()
        await asyncio.wait_for(run, 10)
        assert worker.stats.spilled, "no hand-back in the first run"
        scorer.default = 0.02
        await asyncio.wait_for(worker.run(burst=True), 10)
        await worker.aclose()
        for batch, n in (("T", 4), ("U", 1)):
            got = await one_result_each(client, keys, batch, n)
            assert all(r.status == "ok" for r in got), got
        assert await pending_count(client, keys) == 0
        assert not await list_dead_letters(redis_url, namespace=namespace)
    finally:
        await client.aclose()


# ---------------------------------------------------------------------- unreadable headers
def _payload(batch: str, i: int, uid: str | None = None) -> bytes:
    return encode_trajectory(exact_traj(batch, i, uid=uid))


async def _open(redis_url: str, namespace: str, batch: str, n: int) -> None:
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as p:
        await p.open_batch(batch, n, 8)


async def test_one_payload_of_wrong_types_does_not_dead_letter_its_innocent_neighbours(redis_url, namespace) -> None:
    """An entry whose header is garbled holds two good payloads and, last, a msgpack map
    naming its batch with an index of the wrong type. The good samples can be split off (the
    msgpack objects delimit themselves): they must be scored, not dead-lettered with the bad one."""
    keys = Keys(namespace)
    client = connect(redis_url)
    try:
        await _open(redis_url, namespace, "W", 3)
        bad = msgpack.packb({"b": "W", "i": "2", "u": "W/2", "ds": "test/exact", "r": "r2"})
        await client.xadd(keys.stream(), {"d": _payload("W", 0) + _payload("W", 1) + bad, "h": b"\xc1garbled"})
        worker = Worker(redis_url, Delays(default=0.01), cfg(namespace, "w", concurrency=4))
        await asyncio.wait_for(worker.run(burst=True), 10)
        await worker.aclose()
        got = {r.index: r.status for r in await results(client, keys, "W")}
        letters = await list_dead_letters(redis_url, namespace=namespace)
        assert got.get(0) == "ok" and got.get(1) == "ok", (
            f"the good samples W/0 and W/1 of an entry with one malformed payload have results {got}; "
            f"dead letters: {[(d.reason, d.id) for d in letters]}"
        )
    finally:
        await client.aclose()


async def test_garbled_entries_with_mixed_batches_and_duplicate_uids_settle_every_sample(redis_url, namespace) -> None:
    """Garbled headers; payloads of two batches, one uid twice in the entry (A/0 and A/1 both
    'dup'), all of it handed back by a worker of concurrency 1: every distinct sample gets one
    result, B's samples are not confused with A's, the worker does not crash."""
    keys = Keys(namespace)
    client = connect(redis_url)
    try:
        await _open(redis_url, namespace, "A", 3)
        await _open(redis_url, namespace, "B", 2)
        data = (
            _payload("A", 0, "dup")
            + _payload("B", 0, "b0")
            + _payload("A", 1, "dup")
            + _payload("B", 1, "b1")
            + _payload("A", 2, "a2")
        )
        await client.xadd(keys.stream(), {"d": data})  # no header at all
        scorer = Delays(default=0.05)
        worker = Worker(redis_url, scorer, cfg(namespace, "w", concurrency=1))
        await asyncio.wait_for(worker.run(burst=True), 10)
        await worker.aclose()
        a = {r.uid: r for r in await results(client, keys, "A")}
        await one_result_each(client, keys, "B", 2)
        assert set(a) == {"dup", "a2"} and all(r.status == "ok" for r in a.values()), a
        assert await pending_count(client, keys) == 0
    finally:
        await client.aclose()


async def test_a_hostile_entry_of_thousands_of_tiny_payloads_does_not_starve_other_samples(
    redis_url, namespace
) -> None:
    """A producer XADDs one entry of 3000 tiny maps naming batch/index/uid and nothing else
    (no header), and one with an index beyond int64; a normal batch follows. The worker
    must survive and score the normal batch, each tiny sample ending dead-lettered."""
    keys = Keys(namespace)
    client = connect(redis_url)
    try:
        tiny = b"".join(msgpack.packb({"b": "Z", "i": i, "u": f"z{i}"}) for i in range(3000))
        await client.xadd(keys.stream(), {"d": tiny, "h": b"junk"})
        huge = msgpack.packb({"b": "Y", "i": 2**64 - 1, "u": "y0"}) + msgpack.packb({"b": "Y", "i": 1, "u": "y1"})
        await client.xadd(keys.stream(), {"d": huge})
        await push(redis_url, namespace, [exact_traj("N", i) for i in range(4)], k=4)
        worker = Worker(redis_url, Delays(default=0.01), cfg(namespace, "w", concurrency=8, read_count=64))
        await asyncio.wait_for(worker.run(burst=True), 14)
        await worker.aclose()
        got = await one_result_each(client, keys, "N", 4)
        assert all(r.status == "ok" for r in got)
        assert await pending_count(client, keys) == 0
    finally:
        await client.aclose()


# ---------------------------------------------------------------------- dead-lettered copy, redrive
async def test_a_dead_lettered_copy_redriven_is_scored_by_its_group_only_and_keeps_one_result(
    redis_url, namespace
) -> None:
    """A sample whose payload cannot be decoded is handed back (its copy names group
    'scorers') and dead-lettered from the copy; its redrive goes back for that group only:
    a g2 worker must not score it a second time, and each group keeps one result."""
    keys = Keys(namespace)
    client = connect(redis_url)
    try:
        await _open(redis_url, namespace, "D", 3)
        good0, good2 = _payload("D", 0), _payload("D", 2)
        bad = b"\x81\xa1b\xa1D"  # a map that decodes to {"b": "D"} only
        from stream_reward.wire.entries import entry_header

        head = entry_header("D", 0, "D/0", len(good0)) + entry_header("D", 1, "D/1", len(bad))
        head += entry_header("D", 2, "D/2", len(good2))
        await client.xadd(keys.stream(), {"d": good0 + bad + good2, "h": head})
        w1 = Worker(redis_url, Delays(default=0.1), cfg(namespace, "w1", concurrency=1))
        g2 = Delays(default=0.01)
        w2 = Worker(redis_url, g2, cfg(namespace, "w2", concurrency=8, group="g2"))
        await asyncio.wait_for(asyncio.gather(w1.run(burst=True), w2.run(burst=True)), 10)
        assert w1.stats.spilled, "no hand-back"
        letters = await list_dead_letters(redis_url, namespace=namespace)
        assert len(letters) == 2, [(d.reason, d.fields.get("g")) for d in letters]  # one per group
        assert await redrive_dead_letters(redis_url, namespace=namespace) == 2
        await asyncio.wait_for(asyncio.gather(w1.run(burst=True), w2.run(burst=True)), 10)
        for w in (w1, w2):
            await w.aclose()
        for group in ("scorers", "g2"):
            got = {r.index: r.status for r in await one_result_each(client, keys, "D", 3, group)}
            assert got == {0: "ok", 1: "failed", 2: "ok"}, (group, got)
            assert await pending_count(client, keys, group) == 0
        assert set(g2.calls.values()) == {1}, dict(g2.calls)
    finally:
        await client.aclose()
