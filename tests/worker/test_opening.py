"""Opening entries into samples (stream_reward.worker.opening, stream_reward.worker.members).

An entry may hold several samples. Entries whose headers cannot be read are split by their
payloads without letting a garbled one take its innocent neighbours; of a redelivered
entry, the samples with a result already are not scored again (and all are, if Redis fails
the lookup); samples a worker has no room for are handed back as entries of their own and
scored once, across SIGKILLs, lost replies, two partitions and a cluster; each consumer
group scores its own samples only, redriven dead letters included. A refused sample
(stream_reward.worker.samples) whose entry names its batch and index but no usable uid is
still a failed result of that index, so its batch completes.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections import Counter

import msgpack
import pytest
from helpers import (
    WIDTH,
    Counting,
    Exact,
    Timed,
    _letter_of_first_sample,
    exact_traj,
    identity_score,
    producer_and_aggregator,
    quick_worker,
    running_worker,
    samples,
    samples_of,
    stop_config,
    wait_until,
)
from worker_support import (
    SLOW,
    Delays,
    _async,
    cfg,
    one_result_each,
    pending_count,
    push,
    requeue_replies_lost,
    results,
    slow_traj,
)

from stream_reward import ProducerConfig, RewardAggregator, RolloutProducer, Trajectory
from stream_reward.config import ConsumerConfig
from stream_reward.ops.deadletters import list_dead_letters, redrive_dead_letters
from stream_reward.scoring.scorer import Scored
from stream_reward.wire.codec import encode_trajectory
from stream_reward.wire.connection import connect
from stream_reward.wire.entries import FIELD_HANDED_BACK, ensure_group, entry_header
from stream_reward.wire.keys import Keys
from stream_reward.worker.consumer import Worker

pytestmark = pytest.mark.anyio


def _payload(batch: str, i: int, uid: str | None = None) -> bytes:
    return encode_trajectory(exact_traj(batch, i, uid=uid))


async def _open(redis_url: str, namespace: str, batch: str, n: int) -> None:
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as p:
        await p.open_batch(batch, n, 8)


LOGGED = ("--scorer", "python:tests/data/reliability_scorers.py:logged")


async def settle(client, keys: Keys, batch: str, n: int, timeout_s: float) -> None:
    """Wait (up to ``timeout_s``) for ``n`` results of ``batch`` and nothing pending; then
    assert one result each."""

    async def all_in() -> bool:
        return len(await results(client, keys, batch)) >= n and await pending_count(client, keys) == 0

    with contextlib.suppress(AssertionError):
        await wait_until(all_in, timeout_s=timeout_s)
    await one_result_each(client, keys, batch, n)


async def copies_on(client, keys: Keys, partition: int = 0) -> list:
    return [f for _, f in await client.xrange(keys.stream(partition)) if FIELD_HANDED_BACK in f]


def calls_by(log_path) -> list[tuple[str, int]]:
    return [(tag, int(pid)) for tag, pid in (line.split() for line in log_path.read_text().splitlines())]


async def _len_at_least(awaitable, n: int) -> bool:
    return len(await awaitable) >= n


@pytest.fixture(scope="module")
def cluster():
    from stream_reward.ops.cluster import LocalCluster

    with LocalCluster(masters=3) as local:
        yield local


# --- entries without readable headers: split by their payloads


@pytest.mark.parametrize(
    "garbage",
    [pytest.param(b"\x91", id="array-prefix"), pytest.param(b"\xc1", id="never-used-byte")],
)
async def test_one_garbage_payload_between_good_ones_does_not_take_its_right_neighbour(
    redis_url, namespace, garbage
) -> None:
    """An entry without headers holds [good W/0, garbage, good W/1]. The garbage is a single
    byte: 0x91 (a msgpack array of one, which swallows W/1 as its element) or 0xc1 (never
    used: the unpacker stops there). Either way the split makes 'garbage + W/1' one payload
    that names no sample and dead-letters it alone: W/1, innocent, gets no result at all and
    its batch never completes."""
    keys = Keys(namespace)
    client = connect(redis_url)
    try:
        await _open(redis_url, namespace, "W", 2)
        await client.xadd(keys.stream(), {"d": _payload("W", 0) + garbage + _payload("W", 1)})
        w = Worker(redis_url, Counting(first=0.0), stop_config(namespace, "w"))
        await asyncio.wait_for(w.run(asyncio.Event(), burst=True), 10)
        await w.aclose()
        got = {r.index: r.status for r in await results(client, keys, "W")}
        letters = [(d.reason, d.id) for d in await list_dead_letters(redis_url, namespace=namespace)]
        assert got == {0: "ok", 1: "ok"}, (
            f"entry without headers [W/0, {garbage!r}, W/1]: results {got}, dead letters {letters}"
        )
    finally:
        await client.aclose()


async def test_a_garbage_byte_before_a_good_payload_does_not_take_it(redis_url, namespace) -> None:
    """An entry without headers: [0xc1, good W/0]. The split gives up at once (nothing
    named before the garbage), the entry is read whole, fails to decode and is dead-lettered
    with no batch known: W/0 gets no result."""
    keys = Keys(namespace)
    client = connect(redis_url)
    try:
        await _open(redis_url, namespace, "V", 1)
        await client.xadd(keys.stream(), {"d": b"\xc1" + _payload("V", 0)})
        w = Worker(redis_url, Counting(first=0.0), stop_config(namespace, "w"))
        await asyncio.wait_for(w.run(asyncio.Event(), burst=True), 10)
        await w.aclose()
        got = {r.index: r.status for r in await results(client, keys, "V")}
        letters = [(d.reason, d.id) for d in await list_dead_letters(redis_url, namespace=namespace)]
        assert got == {0: "ok"}, f"entry without headers [0xc1, V/0]: results {got}, dead letters {letters}"
    finally:
        await client.aclose()


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


async def test_an_entry_with_a_raising_sample_a_garbled_one_and_a_repeated_uid(redis_url, namespace) -> None:
    """A crafted entry of 5: a sample the scorer raises on, a garbled payload, the same uid
    twice (first kept), and two plain ones. Each uid gets exactly one result; the entry is
    acked; only the garbled sample is dead-lettered."""
    from helpers import done_results

    from stream_reward.ops.deadletters import list_dead_letters
    from stream_reward.wire.codec import encode_trajectory
    from stream_reward.wire.entries import entry_header

    class Raises(Timed):
        async def score(self, t: Trajectory) -> Scored:
            if t.index == 1:
                raise RuntimeError("boom")
            return await super().score(t)

    keys = Keys(namespace)
    t = [exact_traj("e", i) for i in range(4)]
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
        assert rewards.scores[3] == identity_score(t[3])
        uids = [r.uid for r in await done_results(client, keys.done("e"))]
        assert sorted(uids) == ["e/0", "e/1", "e/2", "e/3"]
        assert (await client.xpending(keys.stream(), "scorers"))["pending"] == 0
        assert [d.summary()["index"] for d in await list_dead_letters(redis_url, namespace=namespace)] == [2]
    finally:
        await client.aclose()


# --- redelivered entries: what has a result is not scored again


@pytest.mark.parametrize("where", ["another_group", "another_batch_same_uid"])
async def test_a_result_elsewhere_does_not_skip_a_redelivered_sample(redis_url, namespace, where) -> None:
    """A redelivered entry whose samples have results only in another group's ledger, or
    in another batch under the same (custom) uid, must be scored in full."""
    keys = Keys(namespace)
    client = connect(redis_url)
    n = 4
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            if where == "another_group":
                await ensure_group(client, keys.stream(), "judges")
                await producer.open_batch("a", n, 8)
                await producer.push_many(exact_traj("a", i) for i in range(n))
                async with running_worker(redis_url, namespace, Timed(), group="judges", consumer="j"):

                    async def judged() -> bool:
                        return await client.hlen(keys.results("a", 0, "judges")) == n

                    await wait_until(judged, timeout_s=10)
                batch = "a"
            else:
                await producer.open_batch("a", n, 8)
                await producer.push_many(exact_traj("a", i, uid=f"u{i}") for i in range(n))
                async with running_worker(redis_url, namespace, Timed(), consumer="w0"):

                    async def first() -> bool:
                        return await client.hlen(keys.results("a")) == n

                    await wait_until(first, timeout_s=10)
                await producer.open_batch("b", n, 8)
                await producer.push_many(exact_traj("b", i, uid=f"u{i}") for i in range(n))
                batch = "b"
            # a consumer of 'scorers' reads the entry and dies
            got = await client.xreadgroup("scorers", "dead", {keys.stream(): ">"}, count=10)
            assert got
            scorer = Timed()
            async with running_worker(redis_url, namespace, scorer, consumer="w1", reclaim_idle_ms=200):

                async def done() -> bool:
                    return (
                        await client.hlen(keys.results(batch)) == n
                        and (await client.xpending(keys.stream(), "scorers"))["pending"] == 0
                    )

                ok = True
                try:
                    await wait_until(done, timeout_s=8)
                except AssertionError:
                    ok = False
            assert ok, f"{await client.hlen(keys.results(batch))}/{n} results; scored {scorer.seen}"
            rewards = await agg.collect(batch, timeout_s=2, on_timeout="resolve")
            assert rewards.status == ["ok"] * n
    finally:
        await client.aclose()


async def test_a_redis_error_looking_up_settled_samples_scores_all_once(redis_url, namespace) -> None:
    """The HMGET pipeline of _settled_before fails once: the worker scores every sample of the
    reclaimed entry, each gets one result, the entry is acked."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    keys = Keys(namespace)
    client = connect(redis_url)
    n = 8
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await producer.open_batch("e", n, 8)
            await producer.push_many(exact_traj("e", i) for i in range(n))
            await client.xreadgroup("scorers", "dead", {keys.stream(): ">"}, count=10)
            wc = connect(redis_url)
            real_pipeline = wc.pipeline
            failed = []

            def pipeline(*a, **kw):
                pipe = real_pipeline(*a, **kw)
                real_execute = pipe.execute

                async def execute(*ea, **ekw):
                    names = [str(c[0][1]) for c in pipe.command_stack if str(c[0][0]).upper() == "HMGET"]
                    if not failed and any(":res:" in x for x in names):
                        failed.append(names)
                        await pipe.reset()
                        raise RedisConnectionError("blip")
                    return await real_execute(*ea, **ekw)

                pipe.execute = execute
                return pipe

            wc.pipeline = pipeline
            async with running_worker(redis_url, namespace, Timed(), client=wc, consumer="w1", reclaim_idle_ms=200):

                async def done() -> bool:
                    return (
                        await client.hlen(keys.results("e")) == n
                        and (await client.xpending(keys.stream(), "scorers"))["pending"] == 0
                    )

                await wait_until(done, timeout_s=10)
            assert failed
            rewards = await agg.collect("e", timeout_s=2, on_timeout="resolve")
            assert rewards.status == ["ok"] * n
    finally:
        await client.aclose()


async def test_a_half_settled_entry_spanning_two_batches_scores_only_the_rest(redis_url, namespace) -> None:
    """One push of 4 samples of batch x and 4 of batch y makes one entry. A first worker
    scores x's samples and hangs on y's; it is stopped (drain 0.2 s) and releases the entry.
    The next worker reclaims it: it must score y's 4 only, each once, and ack the entry."""
    keys = Keys(namespace)
    client = connect(redis_url)

    class HangsOnY(Timed):
        async def score(self, t: Trajectory) -> Scored:
            if t.batch_id == "y":
                await asyncio.sleep(30)
            return await super().score(t)

    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await producer.open_batch("x", 4, 4)
            await producer.open_batch("y", 4, 4)
            await producer.push_many([exact_traj("x", i) for i in range(4)] + [exact_traj("y", i) for i in range(4)])
            assert await client.xlen(keys.stream()) == 1
            first = HangsOnY()
            async with running_worker(redis_url, namespace, first, consumer="w0", concurrency=8):

                async def x_done() -> bool:
                    return await client.hlen(keys.results("x")) == 4

                await wait_until(x_done, timeout_s=10)
            assert await client.hlen(keys.results("y")) == 0
            second = Timed()
            async with running_worker(redis_url, namespace, second, consumer="w1", concurrency=8, reclaim_idle_ms=300):

                async def all_done() -> bool:
                    return (
                        await client.hlen(keys.results("y")) == 4
                        and (await client.xpending(keys.stream(), "scorers"))["pending"] == 0
                    )

                await wait_until(all_done, timeout_s=10)
            assert sorted(second.seen) == [f"y/{i}" for i in range(4)], second.seen
            for b in ("x", "y"):
                rewards = await agg.collect(b, timeout_s=2, on_timeout="resolve")
                assert rewards.status == ["ok"] * 4
    finally:
        await client.aclose()


# --- hand-backs: samples with no room here go back to the stream, scored once


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


async def test_hand_back_copies_taken_by_a_consumer_that_dies_are_reclaimed_and_scored_once(
    redis_url, namespace
) -> None:
    keys = Keys(namespace)
    client = connect(redis_url)
    n = 16
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await producer.open_batch("k", n, 8)
            await producer.push_many(exact_traj("k", i) for i in range(n))
            a = Timed(0.5)
            async with running_worker(redis_url, namespace, a, consumer="a", concurrency=2):

                async def handed_back() -> bool:
                    return await client.xlen(keys.stream()) > 1

                await wait_until(handed_back, timeout_s=10)
                # a consumer reads every copy and dies
                got = await client.xreadgroup("scorers", "dead", {keys.stream(): ">"}, count=100)
                taken = len(got[0][1]) if got else 0

                async def own_two() -> bool:
                    return await client.hlen(keys.results("k")) == 2

                await wait_until(own_two, timeout_s=10)
                await asyncio.sleep(0.2)  # the source's ack
            assert taken > 0
            c = Timed()
            async with running_worker(redis_url, namespace, c, consumer="c", reclaim_idle_ms=300):

                async def done() -> bool:
                    return (
                        await client.hlen(keys.results("k")) == n
                        and (await client.xpending(keys.stream(), "scorers"))["pending"] == 0
                    )

                await wait_until(done, timeout_s=15)
            assert sorted(a.seen + c.seen) == sorted(f"k/{i}" for i in range(n)), (sorted(a.seen), sorted(c.seen))
            rewards = await agg.collect("k", timeout_s=2, on_timeout="resolve")
            assert rewards.status == ["ok"] * n
            assert await producer.backlog() == 0
    finally:
        await client.aclose()


async def test_hand_backs_on_a_cluster_are_stamped_per_partition_and_score_once(cluster, namespace) -> None:
    """Entries of 16 over 3 partitions on 3 masters; a worker of concurrency 3 hands most
    samples back through the requeue script (two keys, one slot per partition)."""
    partitions = 3
    keys = Keys(namespace, partitions)
    n = 96
    trajs = [
        Trajectory("cl", i, "test/exact", response=f"r{i}", ground_truth="1", group=f"g{i // 16}") for i in range(n)
    ]
    scorer = Timed(0.02)
    client = connect(cluster.url)
    try:
        async with RolloutProducer(cluster.url, ProducerConfig(namespace=namespace, partitions=partitions)) as producer:
            await producer.open_batch("cl", n, 16)
            await producer.push_many(trajs)
            # The worker's housekeeping trims acknowledged entries. Run long enough (CI's
            # py310 job once did), it left a partition's first entry stamped 16 here, not 0.
            # A group that reads nothing holds them all; the housekeeping runs often.
            for p in range(partitions):
                await client.xgroup_create(keys.stream(p), "holds-every-entry", id="0")
            config = ConsumerConfig(
                namespace=namespace,
                partitions=partitions,
                block_ms=50,
                concurrency=3,
                trim_interval_s=0.05,
                heartbeat_interval_s=0.05,
            )
            w = Worker(cluster.url, scorer, config)
            try:
                await asyncio.wait_for(w.run(burst=True), 60)
            finally:
                await w.aclose()
            assert w.stats.spilled > 0
            async with RewardAggregator(cluster.url, namespace=namespace) as agg:
                rewards = await agg.collect("cl", timeout_s=20, on_timeout="resolve")
            assert rewards.status == ["ok"] * n
            assert rewards.scores == [i + len(f"r{i}") / 1000 for i in range(n)]
            assert sorted(scorer.seen) == sorted(t.uid for t in trajs), "a sample scored twice or never"
            for p in range(partitions):
                before = 0
                for _, fields in await client.xrange(keys.stream(p)):
                    assert int(fields[b"n"]) == before
                    before += len(samples_of(fields))
                assert before == int(await client.hget(keys.pushed(p), "samples") or 0)
            assert await producer.backlog() == 0
    finally:
        await client.aclose()


# --- consumer groups: each scores its own samples


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
    judge = Timed()
    try:
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
            await ensure_group(client, keys.stream(), "judges")
            await producer.open_batch("g", n, 8)
            await producer.push_many(exact_traj("g", i) for i in range(n))
            async with (
                quick_worker(redis_url, namespace, Timed(0.05), concurrency=3, consumer="s1"),
                quick_worker(redis_url, namespace, judge, concurrency=256, group="judges", consumer="j1"),
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


async def test_a_redriven_letter_of_one_group_is_not_scored_again_by_another_group(redis_url, namespace) -> None:
    """Group 'scorers' dead-lettered sample 0 of an entry of 4 (a letter of its own, as
    _Member.fields writes it); group 'judges' scored the whole entry. A redrive queues the
    letter plain, without the group that dead-lettered it: 'judges' scores it a second
    time (quota spent twice), as hand-backs did before they carried field g."""
    from stream_reward.ops.deadletters import redrive_dead_letters

    keys = Keys(namespace)
    client = connect(redis_url)
    try:
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
            await ensure_group(client, keys.stream(), "judges")
            await producer.open_batch("j", 4, 8)
            await producer.push_many(exact_traj("j", i) for i in range(4))
            judge = Timed()
            async with running_worker(redis_url, namespace, judge, group="judges", consumer="j1"):

                async def judged() -> bool:
                    return await client.hlen(keys.results("j", 0, "judges")) == 4

                await wait_until(judged, timeout_s=10)
                await _letter_of_first_sample(client, keys)  # as scorers' worker would write it
                assert await redrive_dead_letters(redis_url, namespace=namespace) == 1
                await asyncio.sleep(1.0)
            assert sorted(judge.seen) == sorted(f"j/{i}" for i in range(4)), judge.seen
    finally:
        await client.aclose()


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


def _payload_of_r2(uid: object) -> bytes:
    """Sample 2 of batch "r" as a producer encodes it, its uid replaced (``...``: left out)."""
    fields = msgpack.unpackb(encode_trajectory(samples("r", ["a", "a", "a"])[2]))
    del fields["u"]
    if uid is not ...:
        fields["u"] = uid
    return msgpack.packb(fields)


# The entry of sample 2: a header whose uid is null, one whose uid is a number, none at all.
NO_UID_ENTRIES = {
    "null uid": lambda: {"d": _payload_of_r2(None), "h": entry_header("r", 2, None, len(_payload_of_r2(None)))},  # type: ignore[arg-type]
    "numeric uid": lambda: {"d": _payload_of_r2(7), "h": entry_header("r", 2, 7, len(_payload_of_r2(7)))},  # type: ignore[arg-type]
    "no header, no uid": lambda: {"d": _payload_of_r2(...)},
}


@pytest.mark.parametrize("entry", list(NO_UID_ENTRIES))
async def test_a_refused_sample_whose_entry_names_no_uid_is_a_failed_result_of_its_batch_and_index(
    redis_url: str, namespace: str, entry: str
) -> None:
    keys = Keys(namespace)
    async with producer_and_aggregator(redis_url, namespace) as (producer, agg):
        await producer.open_batch("r", 3, WIDTH)
        await producer.push_many(samples("r", ["a", "a"]))
        await producer.client.xadd(keys.stream(), NO_UID_ENTRIES[entry]())
        w = Worker(redis_url, Exact(), ConsumerConfig(namespace=namespace, block_ms=20))
        await asyncio.wait_for(w.run(burst=True), 30)
        await w.aclose()
        rewards = await agg.collect("r", timeout_s=10)  # complete: not left to a deadline or timeout
    assert rewards.status == ["ok", "ok", "failed"]
    assert rewards.results[2].reason == "malformed" and "names no usable uid" in (rewards.errors[2] or "")
    letters = await list_dead_letters(redis_url, namespace=namespace)
    assert len(letters) == 1  # and it is kept for inspection, once
