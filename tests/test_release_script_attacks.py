"""Attacks on the third round of the worker's stop (348b3f0): the release is one script per
stream (RELEASE_SCRIPT) run after the writer stopped, the stop's Redis work shares a 2 s
budget, and entries without headers are split by their payloads. Guarantees: every sample
ends with exactly one result and none is lost; no innocent sample is dead-lettered or scored
twice by live workers; a release never takes an entry another live consumer holds; a stop is
bounded (about drain_timeout_s + 5 s) even with Redis hanging; crash detection still works."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from helpers import Counting, done_results, exact_traj, identity_score, push_exact, stop_config

from stream_reward import ProducerConfig, RolloutProducer
from stream_reward.ops.deadletters import list_dead_letters
from stream_reward.scoring.scorer import Scored
from stream_reward.wire.codec import encode_trajectory
from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys
from stream_reward.worker.consumer import Worker
from stream_reward.worker.stop import _RELEASED_IDLE_MS

pytestmark = pytest.mark.anyio


async def results(client, keys: Keys, batch: str, group: str = "scorers") -> list:
    out = []
    for p in range(keys.partitions):
        out += await done_results(client, keys.done(batch, p, group))
    return out


async def pending_rows(client, keys: Keys, group: str = "scorers") -> list:
    out = []
    for stream in keys.streams():
        rows = await client.xpending_range(stream, group, min="-", max="+", count=1000)
        out += [(r["message_id"], r["consumer"], r["time_since_delivered"], r["times_delivered"]) for r in rows]
    return out


async def burst_peer(redis_url: str, namespace: str, scorer, **kw) -> None:
    peer = Worker(redis_url, scorer, stop_config(namespace, "peer", reclaim_idle_ms=60_000, **kw))
    await asyncio.wait_for(peer.run(asyncio.Event(), burst=True), 20)
    await peer.aclose()


# ======================================================================================
# (1) two workers under one consumer name


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


async def test_a_worker_refuses_a_consumer_name_a_live_worker_beats_under(redis_url, namespace) -> None:
    """The guard behind the test above: B, started under the name of live worker A (which
    refreshes its heartbeat), raises a ConfigError naming the clash rather than run; A's
    heartbeat stays. A name whose worker died (heartbeat no longer refreshed) is taken."""
    from stream_reward.errors import ConfigError

    keys = Keys(namespace)
    client = connect(redis_url)
    await push_exact(redis_url, namespace, "N", 1)
    a_scorer = Counting(first=3.0)
    a = Worker(redis_url, a_scorer, stop_config(namespace, "w1", heartbeat_interval_s=0.2))
    a_stop = asyncio.Event()
    a_run = asyncio.ensure_future(a.run(a_stop))
    try:
        await asyncio.wait_for(a_scorer.started.wait(), 5)
        b = Worker(redis_url, Counting(first=0.0), stop_config(namespace, "w1", heartbeat_interval_s=0.2))
        with pytest.raises(ConfigError, match="in use by a live worker"):
            await asyncio.wait_for(b.run(asyncio.Event()), 5)
        await b.aclose()
        assert await client.hexists(keys.workers(), "w1")
    finally:
        a_stop.set()
        await asyncio.wait_for(a_run, 10)
        await a.aclose()
    # A heartbeat left behind (a worker that died): taken after it stops changing.
    from stream_reward.wire.heartbeat import encode_heartbeat

    await client.hset(keys.workers(), "w2", encode_heartbeat({"host": "gone", "pid": 1, "started": 0.0, "seen": 1.0}))
    c = Worker(redis_url, Counting(first=0.0), stop_config(namespace, "w2", heartbeat_interval_s=0.2))
    await asyncio.wait_for(c.run(asyncio.Event(), burst=True), 10)
    await c.aclose()
    await client.aclose()


# ======================================================================================
# (2) run() ends by an error: the release takes back the delivery of a crash


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


# ======================================================================================
# (3) entries without headers: a payload that names no sample swallows a good neighbour


def _payload(batch: str, i: int) -> bytes:
    return encode_trajectory(exact_traj(batch, i))


async def _open(redis_url: str, namespace: str, batch: str, n: int) -> None:
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as p:
        await p.open_batch(batch, n, 8)


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


# ======================================================================================
# (4) a stop with Redis hanging while the writer's last flush is in flight


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


# ======================================================================================
# (5) a stop before anything was read; two groups on one stream


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
        await asyncio.wait_for(asyncio.gather(s1.started.wait(), s2.started.wait()), 5)
        await asyncio.sleep(0.1)
        stop1.set()
        await asyncio.wait_for(r1, 10)
        g1 = await pending_rows(client, keys, "g1")
        g2 = await pending_rows(client, keys, "g2")
        assert g1 and all(idle >= _RELEASED_IDLE_MS // 2 for _, _, idle, _ in g1), g1
        assert g2 and all(idle < 5_000 for _, _, idle, _ in g2), f"g2's live entries were released: {g2}"
        await asyncio.sleep(1.2)
        stop2.set()
        await asyncio.wait_for(r2, 10)
        got = Counter(r.index for r in await results(client, keys, "G", "g2"))
        assert got == {0: 1, 1: 1} and set(s2.calls.values()) == {1}, (got, s2.calls)
    finally:
        stop1.set()
        stop2.set()
        await asyncio.gather(r1, r2, return_exceptions=True)
        await w1.aclose()
        await w2.aclose()
        await client.aclose()
