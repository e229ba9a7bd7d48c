"""The producer's backlog bound (trainer/backlog.py): ``max_backlog`` and its estimate.

It promises: the estimate (the last reading plus this producer's pushes since) never
counts one of this producer's pushes twice once its reply is in and never misses one;
where it cannot know (a reply pending across a reading, a duplicate resent after the
reading, a count it cannot read) it errs high, never low; so a push that fits is never
refused with ``on_backlog="raise"``, and concurrent pushers never pass ``max_backlog``
together. A reading is held in flight by wrapping the producer's read, a push by
wrapping its send; no worker runs unless a test says so, so the backlog is exactly what
was pushed less what the group was delivered; the truth is read by a second producer.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import (
    CutProxy,
    ReadHold,
    SendHold,
    Timed,
    backlog_ready,
    backlog_traj,
    backlog_truth,
    queued,
    refusals_of_pushes_that_fit,
    running_worker,
    traj,
    wait_until,
)
from redis.asyncio import Redis
from redis.exceptions import ResponseError
from trainer_support import clean, expected, graded, outcome, settle, worker

import stream_reward.trainer.flush as flush_module
from stream_reward import ProducerConfig, RolloutProducer, SyncRolloutProducer, Trajectory
from stream_reward.config import ConsumerConfig
from stream_reward.errors import BackpressureError, BrokerError, PushConflictError, ResultTimeoutError
from stream_reward.ops.cluster import LocalCluster
from stream_reward.ops.deadletters import list_dead_letters
from stream_reward.scoring.registry import RuleScorer
from stream_reward.wire.connection import connect
from stream_reward.wire.entries import XADD_MANY_CHUNK, entry_header
from stream_reward.wire.keys import Keys
from stream_reward.worker.consumer import Worker

pytestmark = pytest.mark.anyio


LIMIT = 20


async def _fresh_reading(producer: RolloutProducer) -> None:
    await producer._start_backlog_reading()


def _config(namespace: str, **kw: Any) -> ProducerConfig:
    base: dict[str, Any] = dict(namespace=namespace, max_backlog=LIMIT, on_backlog="raise", backlog_poll_s=60.0)
    base.update(kw)
    return ProducerConfig(**base)


async def lag_of(admin: Any, keys: Keys, group: str) -> int:
    """The group's lag in entries, read in one command (XINFO GROUPS): with
    samples_per_entry=1, the samples undelivered, at one instant (a two-step read while a
    worker consumes would count entries delivered in between)."""
    total = 0
    for stream in keys.streams():
        for g in await admin.xinfo_groups(stream):
            if g["name"] in (group, group.encode()):
                assert g["lag"] is not None
                total += int(g["lag"])
    return total


async def _settled(producer: RolloutProducer) -> tuple[int, int]:
    """(estimate, backlog()) once everything of the producer is in."""
    if producer._coalescer is not None:
        await producer._coalescer.aclose()
    if producer._backlog_reading is not None and not producer._backlog_reading.done():
        await asyncio.gather(producer._backlog_reading, return_exceptions=True)
    return producer._backlog, await producer.backlog()


async def _read_again(producer: RolloutProducer) -> int:
    """The estimate after one more reading, which nothing of the producer's is on its way past."""
    await producer._start_backlog_reading()
    return producer._backlog


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(masters=3) as local:
        yield local


async def _zero(count) -> bool:
    return await count == 0


def gsm(i: int) -> Trajectory:
    return Trajectory("m", i, "openai/gsm8k", response=f"#### {i}", ground_truth=str(i))


# A push and a reading in flight together


@pytest.mark.parametrize("partitions", [1, 3])
async def test_a_push_landing_during_a_backlog_reading_is_counted_once(redis_url, namespace, partitions):
    refused = await refusals_of_pushes_that_fit(redis_url, namespace, partitions)
    assert not refused, f"{len(refused)} of 15 rounds refused a push that fit: {refused[:3]}"


async def test_a_push_counted_before_a_reading_that_lands_after_it_is_not_lost_from_the_estimate(redis_url, namespace):
    """The other way round: ten samples counted, a reading starts and ends before their
    push reaches Redis (the push held back at the producer's send). The reading did not
    count them and they were counted before it started: an estimate that drops them lets
    the next pushes past max_backlog."""
    limit = 20
    config = ProducerConfig(namespace=namespace, max_backlog=limit, on_backlog="raise", backlog_poll_s=10.0)
    async with RolloutProducer(redis_url, config) as producer:
        await producer.open_batch("late", 40, 4)
        await producer.push(backlog_traj("late", 0))  # the groups and the script are ready
        release = asyncio.Event()
        send = producer._send_packed

        async def held_send(packed):
            await release.wait()
            return await send(packed)

        producer._send_packed = held_send
        pushing = asyncio.ensure_future(producer.push_many(backlog_traj("late", i) for i in range(1, 11)))
        await asyncio.sleep(0.05)
        assert not pushing.done()  # counted, held before Redis
        await producer._start_backlog_reading()  # reads 1: the ten are not in the stream yet
        release.set()
        await pushing
        producer._send_packed = send
        # 11 queued; 10 more would make 21
        with pytest.raises(BackpressureError, match="exceeds max_backlog 20"):
            await producer.push_many(backlog_traj("late", i) for i in range(11, 21))
        await producer.push_many(backlog_traj("late", i) for i in range(11, 20))  # 9 fit exactly
        assert await producer.backlog() == limit


# A push counted before a reading started lands after its HMGET, and its reply comes
# after the reading completed: in between the estimate misses it (errs LOW), and a push
# that does not fit goes through.
async def test_reply_of_a_push_counted_before_a_reading_and_landing_after_it_arrives_after_the_reading(
    redis_url, namespace
):
    problems: list[str] = []
    async with RolloutProducer(redis_url, _config(namespace)) as producer:
        await backlog_ready(producer, "late")
        send = SendHold(producer, before=True, reply=True)
        pushing = asyncio.ensure_future(producer.push_many(backlog_traj("late", i) for i in range(1, 11)))
        await send.entered.wait()  # counted, held before Redis
        hold = ReadHold(producer, after=True)
        reading = producer._start_backlog_reading()
        await hold.read.wait()  # the reading's HMGET ran: the ten are not in
        send.go_send.set()
        await send.landed.wait()  # the ten landed after the reading's count; their reply is held
        hold.go_return.set()
        await reading
        hold.restore()
        real = await backlog_truth(redis_url, namespace)
        if producer._backlog < real:
            problems.append(f"estimate {producer._backlog} < backlog {real} after the reading, reply pending")
        # 11 queued: 10 more make 21 > 20
        try:
            await producer.push_many(backlog_traj("late", i) for i in range(11, 21))
        except BackpressureError:
            pass
        else:
            problems.append("10 more pushed past max_backlog while the reply was pending")
        send.go_reply.set()
        await pushing
        send.restore()
        real = await backlog_truth(redis_url, namespace)
        if real > LIMIT:
            problems.append(f"backlog {real} > max_backlog {LIMIT}")
        if producer._backlog != real:
            problems.append(f"estimate {producer._backlog} != backlog {real} once every reply is in")
    assert not problems, problems


# The mirror: a push counted after a reading started lands before its HMGET, and its
# reply comes after the reading completed: in between it is counted twice, and a push
# that fits is refused.
async def test_reply_of_a_push_counted_during_a_reading_and_landing_before_it_arrives_after_the_reading(
    redis_url, namespace
):
    problems: list[str] = []
    async with RolloutProducer(redis_url, _config(namespace)) as producer:
        await backlog_ready(producer, "early")
        hold = ReadHold(producer, before=True)
        reading = producer._start_backlog_reading()
        send = SendHold(producer, reply=True)
        pushing = asyncio.ensure_future(producer.push_many(backlog_traj("early", i) for i in range(1, 11)))
        await send.landed.wait()  # counted after the reading started, landed before its HMGET
        hold.go_read.set()
        await reading
        hold.restore()
        real = await backlog_truth(redis_url, namespace)
        # With the reply pending, nothing says whether the push ran before the reading's count
        # or after it: the estimate may err high (counting it twice), never low.
        if producer._backlog < real:
            problems.append(f"estimate {producer._backlog} < backlog {real} after the reading, reply pending")
        send.go_reply.set()
        await pushing
        send.restore()
        real = await backlog_truth(redis_url, namespace)
        if producer._backlog != real:
            problems.append(f"estimate {producer._backlog} != backlog {real} once every reply is in")
        try:
            await producer.push_many(backlog_traj("early", i) for i in range(11, 20))  # 9: fits exactly
        except BackpressureError as exc:
            problems.append(f"a push that fit was refused once the reply was in: {exc}")
    assert not problems, problems


# A reply lost and the push resent (the lane's retry): the resend's verdicts are
# DUPLICATE: the first send ran, so they count as the fresh ones would.
async def test_lost_reply_of_a_push_counted_before_a_reading_that_landed_after_it(redis_url, namespace):
    problems: list[str] = []
    async with CutProxy(redis_url[len("unix://") :]) as proxy:
        async with RolloutProducer(proxy.url, _config(namespace)) as producer:
            await backlog_ready(producer, "dup")
            send = SendHold(producer, before=True)
            pushing = asyncio.ensure_future(producer.push_many(backlog_traj("dup", i) for i in range(1, 11)))
            await send.entered.wait()
            await _fresh_reading(producer)  # reads 1: the ten are not in
            proxy.arm(b"EVALSHA")
            send.go_send.set()
            await pushing  # landed, reply cut, resent: DUPLICATE
            send.restore()
            assert proxy.cuts == 1
            real = await backlog_truth(redis_url, namespace)
            if producer._backlog < real:
                problems.append(f"estimate {producer._backlog} < backlog {real} (errs low)")
            try:
                await producer.push_many(backlog_traj("dup", i) for i in range(11, 21))  # 11 + 10 = 21
            except BackpressureError:
                pass
            else:
                problems.append(f"pushed past max_backlog: backlog now {await backlog_truth(redis_url, namespace)}")
    assert not problems, problems


async def test_lost_reply_of_a_push_counted_during_a_reading_that_landed_before_its_count(redis_url, namespace):
    problems: list[str] = []
    async with CutProxy(redis_url[len("unix://") :]) as proxy:
        async with RolloutProducer(proxy.url, _config(namespace)) as producer:
            await backlog_ready(producer, "dup2")
            hold = ReadHold(producer, before=True)
            reading = producer._start_backlog_reading()
            proxy.arm(b"EVALSHA")
            await producer.push_many(backlog_traj("dup2", i) for i in range(1, 11))  # lands, cut, resent
            assert proxy.cuts == 1
            hold.go_read.set()
            await reading
            hold.restore()
            real = await backlog_truth(redis_url, namespace)
            if producer._backlog != real:
                problems.append(f"estimate {producer._backlog} != backlog {real} (counted twice)")
            try:
                await producer.push_many(backlog_traj("dup2", i) for i in range(11, 20))  # 9: fits exactly
            except BackpressureError as exc:
                problems.append(f"a push that fit was refused: {exc}")
    assert not problems, problems


# The slow path during a reading: samples refused (another producer holds their
# index with other content) in a call whose reply comes while the reading is in flight.
@pytest.mark.parametrize("lands", ["before_count", "after_count"])
async def test_refused_samples_of_a_push_whose_reply_comes_during_a_reading(redis_url, namespace, lands):
    problems: list[str] = []
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as other:
        await other.open_batch("c", 100, 4)
        # indices 1..5 taken with other content
        await other.push_many(
            Trajectory("c", i, "test/exact", response="other", ground_truth="x", group=f"c-{i}") for i in range(1, 6)
        )
        async with RolloutProducer(redis_url, _config(namespace)) as producer:
            await producer.open_batch("c", 100, 4, resume=True)
            await producer.push(backlog_traj("c", 0))
            if producer._backlog_reading is not None:
                await producer._backlog_reading
            hold = ReadHold(producer, before=lands == "before_count", after=lands == "after_count")
            reading = producer._start_backlog_reading()
            if lands == "after_count":
                await hold.read.wait()
            # 5 refused (1..5), 5 fresh (6..10): the slow path
            with pytest.raises(PushConflictError):
                await producer.push_many(backlog_traj("c", i) for i in range(1, 11))
            hold.go_read.set()
            hold.go_return.set()
            await reading
            hold.restore()
            real = await backlog_truth(redis_url, namespace)  # 5 (other) + 1 + 5
            if producer._backlog != real:
                problems.append(f"estimate {producer._backlog} != backlog {real}")
            room = LIMIT - real
            try:
                await producer.push_many(backlog_traj("c", i) for i in range(11, 11 + room))  # fits exactly
            except BackpressureError as exc:
                problems.append(f"a push that fit was refused: {exc}")
    assert not problems, problems


# The pushed-count hash deleted by hand: the reading cannot read the stream's count
# (falls back to the lag), so no reply can be placed against it. A push counted before the
# reading and landing after it must still be counted (err high, never low).
@pytest.mark.parametrize("spe", [1, 16])
async def test_pushed_hash_deleted_then_a_push_counted_before_a_reading_lands_after_it(redis_url, namespace, spe):
    problems: list[str] = []
    admin = connect(redis_url)
    try:
        # one sample an entry: the lag fallback (lag x mean entry) is then exact, not high by the entry size
        async with RolloutProducer(redis_url, _config(namespace, samples_per_entry=spe)) as producer:
            await backlog_ready(producer, "h")
            await admin.delete(Keys(namespace).pushed(0))
            send = SendHold(producer, before=True)
            pushing = asyncio.ensure_future(producer.push_many(backlog_traj("h", i) for i in range(1, 11)))
            await send.entered.wait()
            await _fresh_reading(producer)  # no count: the lag fallback, 1 entry
            send.go_send.set()
            await pushing
            send.restore()
            real = await backlog_truth(redis_url, namespace)
            if producer._backlog < real:
                problems.append(f"estimate {producer._backlog} < backlog {real} (errs low)")
            try:
                await producer.push_many(backlog_traj("h", i) for i in range(11, 21))  # 11 + 10 = 21
            except BackpressureError:
                pass
            else:
                problems.append(f"pushed past max_backlog: backlog now {await backlog_truth(redis_url, namespace)}")
    finally:
        await admin.aclose()
    assert not problems, problems


# The count runs backwards: every entry delivered, acked and trimmed (as workers
# XTRIM), and the pushed hash lost while a reading is in flight after its HMGET. The
# next push's script restarts the count at 0, so its reply's count is below the
# reading's: it must not be taken for a call the reading counted.
async def test_pushed_count_restarting_after_the_hash_is_lost_on_an_empty_stream(redis_url, namespace):
    problems: list[str] = []
    keys = Keys(namespace)
    admin = connect(redis_url)
    try:
        async with RolloutProducer(redis_url, _config(namespace)) as producer:
            await backlog_ready(producer, "b")
            await producer.push_many(backlog_traj("b", i) for i in range(1, 8))
            got = await admin.xreadgroup(producer.config.group, "w", {keys.stream(0): ">"}, count=1000)
            ids = [i for _, entries in got for i, _ in entries]
            await admin.xack(keys.stream(0), producer.config.group, *ids)
            await admin.xtrim(keys.stream(0), maxlen=0, approximate=False)
            hold = ReadHold(producer, after=True)
            reading = producer._start_backlog_reading()
            await hold.read.wait()  # count 8 read, nothing undelivered
            await admin.delete(keys.pushed(0))  # evicted / deleted
            await producer.push_many(backlog_traj("b", i) for i in range(8, 13))  # 5: count restarts at 0 -> 5
            hold.go_return.set()
            await reading
            hold.restore()
            real = await backlog_truth(redis_url, namespace)
            if producer._backlog < real:
                problems.append(f"estimate {producer._backlog} < backlog {real} (errs low)")
            try:
                await producer.push_many(backlog_traj("b", i) for i in range(13, 13 + LIMIT - real + 1))  # one too many
            except BackpressureError:
                pass
            else:
                problems.append(f"pushed past max_backlog: backlog now {await backlog_truth(redis_url, namespace)}")
    finally:
        await admin.aclose()
    assert not problems, problems


# Controls: several partitions in one flush, both sides
# of a reading; samples_per_entry > 1; another producer pushing on both sides.
@pytest.mark.parametrize("spe", [1, 4])
@pytest.mark.parametrize("lands", ["before_count", "after_count"])
async def test_a_flush_over_three_partitions_across_a_reading(redis_url, namespace, spe, lands):
    problems: list[str] = []
    cfg = _config(namespace, partitions=3, samples_per_entry=spe, max_backlog=60)
    async with RolloutProducer(redis_url, cfg) as other, RolloutProducer(redis_url, cfg) as producer:
        await backlog_ready(producer, "m")
        await other.push_many(backlog_traj("m", i) for i in range(50, 56))
        if lands == "before_count":
            hold = ReadHold(producer, before=True)
            reading = producer._start_backlog_reading()
            await producer.push_many(backlog_traj("m", i) for i in range(1, 25))  # gen N, lands before HMGET
            hold.go_read.set()
            await reading
        else:
            send = SendHold(producer, before=True)
            pushing = asyncio.ensure_future(producer.push_many(backlog_traj("m", i) for i in range(1, 25)))
            await send.entered.wait()
            hold = ReadHold(producer, after=True)
            reading = producer._start_backlog_reading()
            await hold.read.wait()
            send.go_send.set()
            await pushing  # reply comes while the reading is held
            hold.go_return.set()
            await reading
            send.restore()
        hold.restore()
        real = await backlog_truth(redis_url, namespace, 3)
        if producer._backlog != real:
            problems.append(f"estimate {producer._backlog} != backlog {real}")
        try:
            await producer.push_many(backlog_traj("m", i) for i in range(60, 60 + 60 - real))
        except BackpressureError as exc:
            problems.append(f"a push that fit was refused: {exc}")
        real = await backlog_truth(redis_url, namespace, 3)
        if real != 60:
            problems.append(f"backlog {real} != 60")
    assert not problems, problems


# A reading that fails after the server answered, while replies came in; the next
# reading must still be exact.
async def test_a_failed_reading_with_replies_in_flight_then_an_exact_one(redis_url, namespace):
    problems: list[str] = []
    async with RolloutProducer(redis_url, _config(namespace)) as producer:
        await backlog_ready(producer, "f")
        send = SendHold(producer, before=True)
        pushing = asyncio.ensure_future(producer.push_many(backlog_traj("f", i) for i in range(1, 6)))
        await send.entered.wait()  # counted before the failing reading
        hold = ReadHold(producer, after=True, fail=True)
        reading = producer._start_backlog_reading()
        await hold.read.wait()
        send.go_send.set()
        await pushing  # reply while the reading is on its way
        send.restore()
        await producer.push_many(backlog_traj("f", i) for i in range(6, 9))  # counted during it
        hold.go_return.set()
        with pytest.raises(ConnectionError):
            await reading
        hold.restore()
        real = await backlog_truth(redis_url, namespace)
        if producer._backlog < real:
            problems.append(f"estimate {producer._backlog} < backlog {real} after the failed reading")
        # held push counted during the failed reading lands after the next reading's count
        send = SendHold(producer, before=True)
        pushing = asyncio.ensure_future(producer.push_many(backlog_traj("f", i) for i in range(9, 12)))
        await send.entered.wait()
        hold = ReadHold(producer, after=True)
        reading = producer._start_backlog_reading()
        await hold.read.wait()
        send.go_send.set()
        await pushing
        send.restore()
        hold.go_return.set()
        await reading
        hold.restore()
        real = await backlog_truth(redis_url, namespace)
        if producer._backlog != real:
            problems.append(f"estimate {producer._backlog} != backlog {real} after the next reading")
        try:
            await producer.push_many(backlog_traj("f", i) for i in range(12, 12 + LIMIT - real))
        except BackpressureError as exc:
            problems.append(f"a push that fit was refused: {exc}")
    assert not problems, problems


# SCRIPT FLUSH while a reading is in flight: NOSCRIPT, reload, resend after the count.
async def test_script_flush_while_a_reading_is_in_flight(own_url, namespace):
    problems: list[str] = []
    admin = connect(own_url)
    try:
        async with RolloutProducer(own_url, _config(namespace)) as producer:
            await backlog_ready(producer, "s")
            send = SendHold(producer, before=True)
            pushing = asyncio.ensure_future(producer.push_many(backlog_traj("s", i) for i in range(1, 11)))
            await send.entered.wait()
            hold = ReadHold(producer, after=True)
            reading = producer._start_backlog_reading()
            await hold.read.wait()
            await admin.script_flush()
            send.go_send.set()
            await pushing
            send.restore()
            hold.go_return.set()
            await reading
            hold.restore()
            real = await backlog_truth(own_url, namespace)
            if producer._backlog != real:
                problems.append(f"estimate {producer._backlog} != backlog {real}")
            try:
                await producer.push_many(backlog_traj("s", i) for i in range(11, 11 + LIMIT - real))
            except BackpressureError as exc:
                problems.append(f"a push that fit was refused: {exc}")
    finally:
        await admin.aclose()
    assert not problems, problems


# Stress: backlog_poll_s=0 (a reading after every push), several flushes in flight,
#  random delays on sends, replies and readings; three partitions. Once every push
#  and reading has settled, the estimate is exact.
@pytest.mark.parametrize("spe", [1, 3])
async def test_back_to_back_readings_with_random_delays_settle_exact(redis_url, namespace, spe):
    rng = random.Random(7 + spe)
    limit = 100_000
    cfg = ProducerConfig(
        namespace=namespace,
        partitions=3,
        max_backlog=limit,
        on_backlog="raise",
        backlog_poll_s=0.0,
        coalesce_in_flight=4,
        coalesce_max_entries=7,
        samples_per_entry=spe,
    )
    async with RolloutProducer(redis_url, cfg) as producer:
        await backlog_ready(producer, "z", 2000)
        name = "_read_counts"
        orig_read = getattr(producer, name)
        orig_send = producer._send_packed

        async def read() -> Any:
            await asyncio.sleep(rng.random() * 0.004)
            r = await orig_read()
            await asyncio.sleep(rng.random() * 0.004)
            return r

        async def send(packed: list[bytes]) -> list[Any]:
            await asyncio.sleep(rng.random() * 0.004)
            r = await orig_send(packed)
            await asyncio.sleep(rng.random() * 0.004)
            return r

        setattr(producer, name, read)
        producer._send_packed = send  # type: ignore[method-assign]

        async def pusher(k: int) -> None:
            for j in range(k * 60 + 1, k * 60 + 61, 3):
                await producer.push_many(backlog_traj("z", i) for i in range(j, j + 3))
                await asyncio.sleep(rng.random() * 0.003)

        await asyncio.gather(*(pusher(k) for k in range(8)))
        while producer._backlog_reading is not None and not producer._backlog_reading.done():
            await producer._backlog_reading
        setattr(producer, name, orig_read)
        producer._send_packed = orig_send  # type: ignore[method-assign]
        real = await backlog_truth(redis_url, namespace, 3)
        assert real == 481
        assert producer._backlog == real, f"estimate {producer._backlog} != backlog {real}"


# score() cancelled while a reading is in flight, before its flush: nothing queued.
async def test_a_score_cancelled_before_its_flush_during_a_reading(redis_url, namespace):
    problems: list[str] = []
    cfg = _config(namespace, coalesce_delay_s=0.2)
    async with RolloutProducer(redis_url, cfg) as producer:
        await backlog_ready(producer, "sc")
        hold = ReadHold(producer, after=True)
        reading = producer._start_backlog_reading()
        await hold.read.wait()
        scores = [asyncio.ensure_future(producer.score(backlog_traj("sc", i), timeout_s=5)) for i in range(1, 6)]
        await asyncio.sleep(0.01)
        for s in scores:
            s.cancel()
        await asyncio.gather(*scores, return_exceptions=True)
        hold.go_return.set()
        await reading
        hold.restore()
        await asyncio.sleep(0.3)
        real = await backlog_truth(redis_url, namespace)
        if producer._backlog < real:
            problems.append(f"estimate {producer._backlog} < backlog {real} (errs low)")
        if producer._backlog != real:
            problems.append(f"estimate {producer._backlog} != backlog {real} (nothing of the cancelled scores queued)")
    assert not problems, problems


# No simulated delays: many concurrent pushers, a reading after every push, until
#  max_backlog refuses them; the group then takes everything, and again. The backlog
#  may never pass max_backlog (refusals are allowed: other tests look at those).
async def test_concurrent_pushers_with_back_to_back_readings_never_pass_max_backlog(redis_url, namespace):
    limit = 300
    cfg = ProducerConfig(
        namespace=namespace,
        partitions=2,
        max_backlog=limit,
        on_backlog="raise",
        backlog_poll_s=0.0,
        coalesce_in_flight=4,
        coalesce_max_entries=16,
        samples_per_entry=1,
    )
    worst = 0
    refusals = 0
    async with RolloutProducer(redis_url, cfg) as producer:
        for r in range(12):
            batch = f"n{r}"
            await producer.open_batch(batch, 2000, 4)

            async def pusher(batch: str, nxt: Any) -> None:
                nonlocal refusals
                for i in nxt:  # shared: each pusher takes the next four samples
                    try:
                        await producer.push_many(
                            backlog_traj(batch, j) for j in (4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3)
                        )
                    except BackpressureError:
                        refusals += 1
                        return

            nxt = iter(range(500))
            await asyncio.gather(*(pusher(batch, nxt) for _ in range(24)))
            real = await backlog_truth(redis_url, namespace, 2)
            worst = max(worst, real)
            for p in range(2):
                await producer.client.xreadgroup(cfg.group, "drain", {producer.keys.stream(p): ">"}, count=100_000)
            while producer._backlog_reading is not None and not producer._backlog_reading.done():
                await producer._backlog_reading
    assert worst <= limit, f"backlog reached {worst} > max_backlog {limit} ({refusals} refusals)"


# No simulated delays either: one large push in flight (its reply comes late: the
#  server takes time to read and run it) while new one-sample pushes arrive and each
#  starts a reading (backlog_poll_s=0). A reading started after the large push was
#  counted can end before its reply is in; pushes checked in between must still see it.
@pytest.mark.parametrize("round_", range(3))
async def test_small_pushes_arriving_while_a_large_push_is_in_flight(redis_url, namespace, round_):
    limit = 300
    cfg = ProducerConfig(
        namespace=namespace, max_backlog=limit, on_backlog="raise", backlog_poll_s=0.0, samples_per_entry=1
    )
    big_response = "x" * 100_000
    async with RolloutProducer(redis_url, cfg) as producer:
        await backlog_ready(producer, "L", 5000)
        big = asyncio.ensure_future(
            producer.push_many(
                Trajectory("L", i, "test/exact", response=big_response + str(i), ground_truth="1", group=f"L-{i}")
                for i in range(1, 257)
            )
        )
        small: list[asyncio.Future[int]] = []
        i = 1000
        while not big.done():
            small.append(asyncio.ensure_future(producer.push_many([backlog_traj("L", i)])))
            i += 1
            await asyncio.sleep(0.0001)
        await big
        results = await asyncio.gather(*small, return_exceptions=True)
        refused = sum(isinstance(r, BackpressureError) for r in results)
        real = await backlog_truth(redis_url, namespace)
        # 43 small pushes fit beside the large one: a round with more checks the limit
        assert real <= limit, f"backlog {real} > max_backlog {limit}: {len(small)} small pushes, {refused} refused"


# Failed, cancelled, retried and resent flushes across a reading
# A flush whose samples landed but whose replies were lost on every lane attempt: the
# flush fails (BrokerError). They are in the stream: an estimate that took them out
# would be LOW until the next reading, and on_backlog="raise" would let a push past the
# limit. They stay counted.
@pytest.mark.parametrize("lane", [True, False])
async def test_a_failed_flush_whose_samples_landed_leaves_the_estimate_low(redis_url, namespace, lane):
    """With the lane: every one of its attempts runs and loses its reply. Without a lane
    (a client Lane.for_client refuses: single_connection_client): the pushes go as a
    redis-py pipeline, which redis-py's own retry sends again; every try loses its reply."""

    problems: list[str] = []
    async with CutProxy(redis_url[len("unix://") :]) as proxy:
        host, port = proxy.url[len("redis://") :].split(":")
        client = None if lane else Redis(host=host, port=int(port), single_connection_client=True)
        async with RolloutProducer(proxy.url, _config(namespace), client=client) as producer:
            await backlog_ready(producer, "lost", 2000)
            assert (producer._lane is not None) == lane
            cuts = flush_module._LANE_ATTEMPTS if lane else 20
            proxy.arm(b"EVALSHA", times=cuts)  # every attempt runs, every reply lost
            with pytest.raises(BrokerError):
                await producer.push_many(backlog_traj("lost", i) for i in range(1, 11))
            assert proxy.cuts == cuts if lane else proxy.cuts >= 2
            proxy.arm(b"", times=0)
            real = await backlog_truth(redis_url, namespace)
            assert real == 11, real  # the ten are queued: the script ran
            if producer._backlog < real:
                problems.append(f"estimate {producer._backlog} < backlog {real} after the failed flush (errs low)")
            try:
                await producer.push_many(backlog_traj("lost", i) for i in range(11, 21))  # 11 + 10 = 21 > 20
            except BackpressureError:
                pass
            else:
                problems.append(f"pushed past max_backlog: backlog now {await backlog_truth(redis_url, namespace)}")
        if client is not None:
            await client.aclose()
    assert not problems, problems


async def test_a_failed_flush_retried_as_a_whole_settles_exact(redis_url, namespace):
    """The documented remedy ("a call that failed with BrokerError may be retried as a
    whole"): the failed call's samples stay counted (they may have landed; here they did)
    and the retry's DUPLICATEs count again: high, never low, until the next reading."""
    async with CutProxy(redis_url[len("unix://") :]) as proxy:
        # Room for the retry's ten on top of the failed call's, which stay counted.
        async with RolloutProducer(proxy.url, _config(namespace, max_backlog=30)) as producer:
            await backlog_ready(producer, "retry", 2000)
            proxy.arm(b"EVALSHA", times=flush_module._LANE_ATTEMPTS)
            with pytest.raises(BrokerError):
                await producer.push_many(backlog_traj("retry", i) for i in range(1, 11))
            await producer.push_many(backlog_traj("retry", i) for i in range(1, 11))
            est, real = await _settled(producer)
            assert real == 11 and est >= real, (est, real)
            assert await _read_again(producer) == real


# The coalescer between _take and the _send task starting: the batch is only in
# Coalescer._taken. A reading that ends right then must count it (unsent), once.
@pytest.mark.parametrize("lands", ["after_reading", "before_count_of_next"])
async def test_a_reading_ending_between_take_and_send(redis_url, namespace, lands):
    problems: list[str] = []
    async with RolloutProducer(redis_url, _config(namespace)) as producer:
        await backlog_ready(producer, "tk", 2000)
        co = producer._coalescer
        assert co is not None
        orig_send = co._send
        gate = asyncio.Event()
        entered = asyncio.Event()

        async def held_send(taken: Any, batch: Any) -> None:
            entered.set()
            await gate.wait()  # the real _send has not run: the batch is still in _taken
            await orig_send(taken, batch)

        co._send = held_send  # type: ignore[method-assign]
        pushing = asyncio.ensure_future(producer.push_many(backlog_traj("tk", i) for i in range(1, 11)))
        await entered.wait()
        if co.unsent() != 10 or producer._flying:
            problems.append(f"taken batch: unsent {co.unsent()}, flying {producer._flying}")
        await producer._start_backlog_reading()  # reads 1; the ten are unsent
        real = await backlog_truth(redis_url, namespace)
        if producer._backlog != real + 10:
            problems.append(f"after the reading: estimate {producer._backlog} != {real} + 10 unsent")
        if lands == "before_count_of_next":
            # a second reading held before its count, the flush lands meanwhile, its reply during it
            hold = ReadHold(producer, before=True)
            reading = producer._start_backlog_reading()
            gate.set()
            await pushing
            hold.go_read.set()
            await reading
            hold.restore()
        else:
            gate.set()
            await pushing
        co._send = orig_send  # type: ignore[method-assign]
        est, real = await _settled(producer)
        if est != real or real != 11:
            problems.append(f"settled: estimate {est}, backlog {real} (11 pushed)")
        try:
            await producer.push_many(backlog_traj("tk", i) for i in range(11, 20))  # 9: fits exactly
        except BackpressureError as exc:
            problems.append(f"a push that fit was refused: {exc}")
    assert not problems, problems


async def test_the_runner_cancelled_between_take_and_send(redis_url, namespace):
    """The runner and its _send task cancelled (a loop closing, cancelling every task) in
    the loop turn after the runner took a batch and created that task, before it ran: the
    task is cancelled unstarted, so _send's `except CancelledError` never runs. The taken
    batch must leave Coalescer._taken (the estimate's unsent), and its callers must hear."""
    problems: list[str] = []
    async with RolloutProducer(redis_url, _config(namespace, coalesce_max_entries=5)) as producer:
        await backlog_ready(producer, "cx", 2000)
        co = producer._coalescer
        assert co is not None
        orig_take = co._take
        loop = asyncio.get_running_loop()
        fired: list[int] = []

        def take() -> Any:
            taken = orig_take()
            if taken and not fired:
                fired.append(1)
                runner = co._runner
                assert runner is not None

                def shut() -> None:  # as a closing loop cancelling every task: the _send task too
                    runner.cancel()
                    for task in list(co._flushes):
                        task.cancel()

                loop.call_soon(shut)  # runs before the _send task's first step
            return taken

        co._take = take  # type: ignore[method-assign]
        a = asyncio.ensure_future(producer.push_many(backlog_traj("cx", i) for i in range(1, 6)))
        b = asyncio.ensure_future(producer.push_many(backlog_traj("cx", i) for i in range(6, 11)))
        done, pending = await asyncio.wait([a, b], timeout=3)
        co._take = orig_take  # type: ignore[method-assign]
        if pending:
            problems.append(f"{len(pending)} push_many callers hang after the runner was cancelled")
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if co._taken:
            problems.append(f"Coalescer._taken kept {len(co._taken)} batches of a cancelled flush")
        if co.unsent():
            problems.append(f"unsent() {co.unsent()} after the cancel")
        real = await backlog_truth(redis_url, namespace)
        if producer._backlog < real:
            problems.append(f"estimate {producer._backlog} < backlog {real}")
        await producer._start_backlog_reading()
        if producer._backlog != real:
            problems.append(f"after a reading: estimate {producer._backlog} != backlog {real}")
    assert not problems, problems


# aclose() while flushes are in flight and a reading too.
async def test_aclose_with_flushes_in_flight_and_a_reading(redis_url, namespace):
    problems: list[str] = []
    producer = RolloutProducer(redis_url, _config(namespace, on_backlog="wait", coalesce_in_flight=2))
    await backlog_ready(producer, "cl", 2000)
    orig_call = producer._call_push
    gate = asyncio.Event()

    async def held_call(calls: Any, cluster: bool) -> Any:
        replies = await orig_call(calls, cluster)  # landed
        await gate.wait()
        return replies

    producer._call_push = held_call  # type: ignore[method-assign]
    pushes = [
        asyncio.ensure_future(producer.push_many(backlog_traj("cl", i) for i in range(1 + 5 * k, 6 + 5 * k)))
        for k in range(2)
    ]
    await asyncio.sleep(0.05)
    hold = ReadHold(producer, after=True)
    producer._backlog_checked_at = 0  # the next push that must wait starts a reading
    # 11 counted: 10 more need room, they wait on the reading
    waiter = asyncio.ensure_future(producer.push_many(backlog_traj("cl", i) for i in range(11, 21)))
    await hold.read.wait()
    closing = asyncio.ensure_future(producer.aclose())
    await asyncio.sleep(0.05)
    gate.set()  # the flushes' replies come while aclose waits for them
    done, pending = await asyncio.wait([closing, waiter, *pushes], timeout=5)
    if pending:
        problems.append(f"{len(pending)} of aclose / waiter / pushes hang")
        hold.go_return.set()
        await asyncio.wait(pending, timeout=5)
    for p in pushes:
        if p.done() and p.exception() is not None:
            problems.append(f"a push in flight failed under aclose: {p.exception()!r}")
    if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
        problems.append("the waiting push went on after aclose")
    real = await backlog_truth(redis_url, namespace)
    if real != 11:
        problems.append(f"backlog {real} != 11")
    assert not problems, problems


# A reading that starts and ends while _call_push is inside its NOSCRIPT reload
# (script_load held), and one inside the lane's reconnect backoff after a lost reply.
@pytest.mark.parametrize("other_pushes", [0, 3])
async def test_a_reading_inside_the_noscript_reload(own_url, namespace, other_pushes):
    problems: list[str] = []
    admin = connect(own_url)
    try:
        async with (
            RolloutProducer(own_url, _config(namespace)) as producer,
            RolloutProducer(own_url, _config(namespace, max_backlog=0)) as other,
        ):
            await backlog_ready(producer, "ns", 2000)
            await other.open_batch("ns2", 100, 4)
            await admin.script_flush()
            client = producer.client
            orig_load = client.script_load
            gate, entered = asyncio.Event(), asyncio.Event()

            async def held_load(script: str) -> Any:
                entered.set()
                await gate.wait()
                return await orig_load(script)

            client.script_load = held_load
            pushing = asyncio.ensure_future(producer.push_many(backlog_traj("ns", i) for i in range(1, 11)))
            await entered.wait()  # NOSCRIPT came back; the reload is held
            await producer._start_backlog_reading()  # reads 1: the ten are on their way
            real = await backlog_truth(own_url, namespace)
            if producer._backlog < real + 10:
                problems.append(f"during the reload: estimate {producer._backlog} < {real} + 10 on their way")
            if other_pushes:
                await other.push_many(backlog_traj("ns2", i) for i in range(other_pushes))
            gate.set()
            await pushing
            client.script_load = orig_load
            est, real = await _settled(producer)
            if est != real - other_pushes or real != 11 + other_pushes:
                problems.append(f"settled: estimate {est}, backlog {real} ({other_pushes} by another producer)")
            room = LIMIT - est
            try:
                await producer.push_many(backlog_traj("ns", i) for i in range(11, 11 + room))
            except BackpressureError as exc:
                problems.append(f"a push that fit the estimate was refused: {exc}")
    finally:
        await admin.aclose()
    assert not problems, problems


@pytest.mark.parametrize("other_pushes", [0, 3])
async def test_a_reading_inside_the_lane_backoff_after_a_lost_reply(redis_url, namespace, monkeypatch, other_pushes):
    """The first send ran and its reply was cut; while the lane waits to resend, a reading
    counts the ten (they are in the stream) and marks the flight. The resend's DUPLICATEs
    then place it before the reading: exact. With another producer's pushes between the
    reading and the resend, the resend's count is past the reading's: the claimed
    'duplicate resend after the reading' case, which may err high (never low)."""
    monkeypatch.setattr(flush_module, "_LANE_BACKOFF_S", 0.5)
    problems: list[str] = []
    async with CutProxy(redis_url[len("unix://") :]) as proxy:
        async with (
            RolloutProducer(proxy.url, _config(namespace)) as producer,
            RolloutProducer(redis_url, _config(namespace, max_backlog=0)) as other,
        ):
            await backlog_ready(producer, "bo", 2000)
            await other.open_batch("bo2", 100, 4)
            proxy.arm(b"EVALSHA")
            pushing = asyncio.ensure_future(producer.push_many(backlog_traj("bo", i) for i in range(1, 11)))
            for _ in range(200):
                if proxy.cuts:
                    break
                await asyncio.sleep(0.005)
            assert proxy.cuts == 1
            await asyncio.sleep(0.02)  # the lane saw the loss and is in its backoff
            assert not pushing.done()
            await producer._start_backlog_reading()
            real = await backlog_truth(redis_url, namespace)
            if real != 11 or producer._backlog < real:
                problems.append(f"in the backoff: estimate {producer._backlog}, backlog {real}")
            if other_pushes:
                await other.push_many(backlog_traj("bo2", i) for i in range(other_pushes))
            await pushing
            real = await backlog_truth(redis_url, namespace)
            if producer._backlog < real - other_pushes:
                problems.append(f"after the resend: estimate {producer._backlog} < {real} - {other_pushes} (errs low)")
            if not other_pushes and producer._backlog != real:
                problems.append(f"after the resend: estimate {producer._backlog} != backlog {real}")
            await producer._start_backlog_reading()
            if producer._backlog != await backlog_truth(redis_url, namespace):
                problems.append("not exact after the next reading")
    assert not problems, problems


# Large pushes: several XADD_MANY_CHUNK calls for one partition in one flush, a reading's
# count between the first call and the rest (as when the server interleaves the reading
# with the flush's calls).
@pytest.mark.parametrize("reading_ends", ["in_flight", "after_reply"])
async def test_a_chunked_push_split_by_a_reading(redis_url, namespace, reading_ends):
    problems: list[str] = []
    n = 2 * XADD_MANY_CHUNK + 50
    limit = n + 100
    async with RolloutProducer(redis_url, _config(namespace, max_backlog=limit, coalesce_max_entries=4096)) as producer:
        await backlog_ready(producer, "big", size=n + 200)
        orig = producer._send_packed
        seen: list[int] = []

        async def split(packed: list[bytes]) -> list[Any]:
            seen.append(len(packed))
            first = await orig(packed[:1])
            if reading_ends == "in_flight":
                await producer._start_backlog_reading()
                rest = await orig(packed[1:])
            else:
                hold = ReadHold(producer, after=True)
                reading = producer._start_backlog_reading()
                await hold.read.wait()
                rest = await orig(packed[1:])
                hold.restore()

                async def end() -> None:
                    await asyncio.sleep(0.02)
                    hold.go_return.set()  # after this reply is placed

                asyncio.ensure_future(end())
                _ = reading
            return first + rest

        producer._send_packed = split  # type: ignore[method-assign]
        await producer.push_many(backlog_traj("big", i) for i in range(1, n + 1))
        producer._send_packed = orig  # type: ignore[method-assign]
        assert seen and seen[0] >= 3, seen
        est, real = await _settled(producer)
        if est != real or real != n + 1:
            problems.append(f"settled: estimate {est}, backlog {real} ({n + 1} pushed)")
        try:
            await producer.push_many(backlog_traj("big", i) for i in range(n + 1, limit))  # fits exactly
        except BackpressureError as exc:
            problems.append(f"a push that fit was refused: {exc}")
    assert not problems, problems


# push_many of duplicates of samples another producer queued.
@pytest.mark.parametrize("when", ["before_reading", "after_count_during_reading", "before_count_all_dups"])
async def test_duplicates_of_another_producers_samples(redis_url, namespace, when):
    problems: list[str] = []
    async with (
        RolloutProducer(redis_url, _config(namespace, max_backlog=0)) as other,
        RolloutProducer(redis_url, _config(namespace)) as producer,
    ):
        await other.open_batch("d", 100, 4)
        await producer.open_batch("d", 100, 4, resume=True)
        await producer.push(backlog_traj("d", 0))
        if producer._backlog_reading is not None:
            await producer._backlog_reading
        mine = range(1, 6) if when == "before_count_all_dups" else range(1, 11)
        if when == "after_count_during_reading":
            hold = ReadHold(producer, after=True)
            reading = producer._start_backlog_reading()
            await hold.read.wait()
            await other.push_many(backlog_traj("d", i) for i in range(1, 6))  # after the reading's count
            await producer.push_many(backlog_traj("d", i) for i in mine)  # 5 DUPLICATE + 5 FRESH
            hold.go_return.set()
            await reading
            hold.restore()
        elif when == "before_count_all_dups":
            await other.push_many(backlog_traj("d", i) for i in range(1, 6))
            hold = ReadHold(producer, after=True)
            reading = producer._start_backlog_reading()
            await hold.read.wait()
            await producer.push_many(backlog_traj("d", i) for i in mine)  # all DUPLICATE, count unchanged
            hold.go_return.set()
            await reading
            hold.restore()
        else:
            await other.push_many(backlog_traj("d", i) for i in range(1, 6))
            await producer._start_backlog_reading()  # has the other's five
            await producer.push_many(backlog_traj("d", i) for i in mine)  # 5 DUPLICATE + 5 FRESH
        est, real = await _settled(producer)
        if est < real:
            problems.append(f"estimate {est} < backlog {real} (errs low)")
        # A duplicate the reading may have counted (another producer's sample, or a first send
        # whose reply was lost) stays counted: high until the next reading, which is exact.
        if (again := await _read_again(producer)) != real:
            problems.append(f"estimate {again} != backlog {real} after the next reading")
        try:
            await producer.push_many(backlog_traj("d", i) for i in range(20, 20 + LIMIT - real))  # fits exactly
        except BackpressureError as exc:
            problems.append(f"a push that fit was refused: {exc}")
    assert not problems, problems


# The cluster path: one EVALSHA per partition, concurrently. One partition's call held
# (after it landed, or before it is sent) while a reading ends; or failing after it ran.
@pytest.mark.parametrize("mode", ["landed_reply_held", "held_before_send", "fails_after_running"])
async def test_cluster_one_partition_call_across_a_reading(cluster, namespace, mode):
    problems: list[str] = []
    url = cluster.url
    cfg = _config(namespace, partitions=3, max_backlog=60)
    async with RolloutProducer(url, cfg) as producer:
        await backlog_ready(producer, "cl", size=400)
        # every partition's pushed count started (a stream's first push answers "count
        # restarted", which no reading can place: see test_first_push_to_a_partition_...)
        per: dict[int, list[int]] = {}
        for i in range(90, 200):
            t = backlog_traj("cl", i)
            per.setdefault(producer.keys.partition_of(t.uid, t.group), []).append(i)
        warm_idx = [i for ids in per.values() for i in ids[:2]]
        await producer.push_many(backlog_traj("cl", i) for i in warm_idx)
        warm = 1 + len(warm_idx)
        assert set((await producer._read_counts())[1]) == {0, 1, 2}
        client = producer.client
        orig = client.evalsha
        slow = producer.keys.stream(2)
        gate, entered = asyncio.Event(), asyncio.Event()

        async def held(sha: str, numkeys: int, *rest: Any) -> Any:
            key = rest[0]
            key = key.decode() if isinstance(key, bytes) else key
            if key != slow:
                return await orig(sha, numkeys, *rest)
            entered.set()
            if mode == "held_before_send":
                await gate.wait()
                return await orig(sha, numkeys, *rest)
            reply = await orig(sha, numkeys, *rest)
            await gate.wait()
            if mode == "fails_after_running":
                from redis.exceptions import ConnectionError as RedisConnectionError

                raise RedisConnectionError("reply lost after the script ran (simulated)")
            return reply

        client.evalsha = held
        trajs = [backlog_traj("cl", i) for i in range(1, 31)]
        parts = {producer.keys.partition_of(t.uid, t.group) for t in trajs}
        assert parts == {0, 1, 2}, parts
        pushing = asyncio.ensure_future(producer.push_many(trajs))
        await entered.wait()
        await asyncio.sleep(0.05)  # the other partitions' calls are in
        await producer._start_backlog_reading()
        real = await backlog_truth(url, namespace, 3)
        if producer._backlog < real:
            problems.append(f"while held: estimate {producer._backlog} < backlog {real}")
        gate.set()
        try:
            await pushing
        except BrokerError:
            assert mode == "fails_after_running"
        client.evalsha = orig
        real = await backlog_truth(url, namespace, 3)
        if real != 30 + warm:
            problems.append(f"backlog {real} != {30 + warm}")
        if producer._backlog < real:
            problems.append(f"once replied: estimate {producer._backlog} < backlog {real} (errs low)")
        elif producer._backlog != real and mode != "fails_after_running":
            problems.append(f"once replied: estimate {producer._backlog} != backlog {real}")
        try:
            await producer.push_many(backlog_traj("cl", i) for i in range(200, 200 + 60 - real + 1))  # one too many
        except BackpressureError:
            pass
        else:
            problems.append(f"pushed past max_backlog: backlog now {await backlog_truth(url, namespace, 3)}")
    assert not problems, problems


# Concurrency stress: many pushers, flushes in parallel (coalesce_in_flight 4), a
# reading on every push, random delays before and after each flush's round trip, a
# drain taking entries meanwhile; with the lane, and with a client the lane refuses
# (single_connection_client: pushes go as redis-py pipelines, replies out of order).
@pytest.mark.parametrize("lane", [True, False])
@pytest.mark.parametrize("seed", [1, 2])
async def test_concurrent_pushers_random_delays_settle_exact(redis_url, namespace, lane, seed):
    rng = random.Random(seed)
    limit = 120
    problems: list[str] = []

    client = None if lane else Redis(unix_socket_path=redis_url[len("unix://") :], single_connection_client=True)
    cfg = _config(
        namespace,
        max_backlog=limit,
        backlog_poll_s=0.0,
        coalesce_in_flight=4,
        coalesce_max_entries=7,
        samples_per_entry=1,
    )
    producer = RolloutProducer(redis_url, cfg, client=client)
    try:
        await backlog_ready(producer, "s", size=5000)
        orig = producer._call_push

        async def jittered(calls: Any, cluster: bool) -> Any:
            await asyncio.sleep(rng.random() * 0.01)
            replies = await orig(calls, cluster)
            await asyncio.sleep(rng.random() * 0.01)
            return replies

        producer._call_push = jittered  # type: ignore[method-assign]
        next_index = iter(range(1, 5000))
        refused = 0
        stop = asyncio.Event()
        peak = 0

        async def pusher() -> None:
            nonlocal refused
            for _ in range(8):
                k = rng.randint(1, 6)
                try:
                    await producer.push_many(backlog_traj("s", next(next_index)) for _ in range(k))
                except BackpressureError:
                    refused += 1
                await asyncio.sleep(rng.random() * 0.005)

        async def drain() -> None:
            admin = connect(redis_url)
            try:
                while not stop.is_set():
                    await admin.xreadgroup(cfg.group, "drain", {producer.keys.stream(0): ">"}, count=rng.randint(1, 5))
                    await asyncio.sleep(0.01)
            finally:
                await admin.aclose()

        async def monitor() -> None:
            nonlocal peak
            admin = connect(redis_url)
            try:
                while not stop.is_set():
                    peak = max(peak, await lag_of(admin, Keys(namespace, 1), cfg.group))
                    await asyncio.sleep(0.003)
            finally:
                await admin.aclose()

        side = [asyncio.ensure_future(drain()), asyncio.ensure_future(monitor())]
        await asyncio.wait_for(asyncio.gather(*(pusher() for _ in range(20))), 60)
        stop.set()  # the drain stops: no consumer from here, so readings from here on can be exact
        await asyncio.gather(*side)
        if producer._backlog_reading is not None:
            await asyncio.gather(producer._backlog_reading, return_exceptions=True)
        stop.clear()
        side = [asyncio.ensure_future(monitor())]
        await asyncio.wait_for(asyncio.gather(*(pusher() for _ in range(20))), 60)
        producer._call_push = orig  # type: ignore[method-assign]
        stop.set()
        await asyncio.gather(*side)
        if lane != (producer._lane is not None):
            problems.append(f"lane expected {lane}, got {producer._lane}")
        est, real = await _settled(producer)
        if est != real:
            problems.append(f"settled: estimate {est} != backlog {real} ({refused} refused)")
        if peak > limit:
            problems.append(f"backlog peaked at {peak} > max_backlog {limit}")
    finally:
        await producer.aclose()
        if client is not None:
            await client.aclose()
    assert not problems, problems


# SyncRolloutProducer from several threads (one loop): exact once done.
def test_sync_producer_from_threads_settles_exact(redis_url, namespace):
    cfg = _config(namespace, max_backlog=400, backlog_poll_s=0.0)
    sp = SyncRolloutProducer(redis_url, cfg)
    errors: list[BaseException] = []
    try:
        sp.open_batch("t", 1000, 4)

        def work(k: int) -> None:
            try:
                for j in range(10):
                    sp.push_many(backlog_traj("t", 1 + k * 100 + j * 5 + m) for m in range(5))
                    sp.push(backlog_traj("t", 1 + k * 100 + 50 + j))
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[:3]
        est = sp._producer._backlog
        real = sp._run(sp._producer.backlog())
        assert (est, real) == (360, 360)
    finally:
        sp.close()


# on_backlog="wait" under many concurrent pushers with a slow worker draining: the
# backlog never passes max_backlog (one producer: no other producers' slack), and
# nothing deadlocks.
async def test_wait_mode_many_pushers_slow_worker_never_pass_limit(redis_url, namespace):
    limit = 30
    cfg = _config(
        namespace, max_backlog=limit, on_backlog="wait", backlog_poll_s=0.01, coalesce_in_flight=4, samples_per_entry=1
    )
    peak = 0
    stop = asyncio.Event()
    async with RolloutProducer(redis_url, cfg) as producer:
        await producer.open_batch("w", 400, 4)

        async def monitor() -> None:
            nonlocal peak
            admin = connect(redis_url)
            try:
                while not stop.is_set():
                    peak = max(peak, await lag_of(admin, Keys(namespace, 1), cfg.group))
                    await asyncio.sleep(0.002)
            finally:
                await admin.aclose()

        async with running_worker(redis_url, namespace, Timed(delay=0.01, jitter=0.01), concurrency=4):
            mon = asyncio.ensure_future(monitor())

            async def pusher(k: int) -> None:
                for j in range(12):
                    if j % 3:
                        await producer.push(backlog_traj("w", k * 12 + j))
                    else:
                        await producer.push_many(
                            [backlog_traj("w", k * 12 + j)] + ([backlog_traj("w", 300 + k)] if j == 0 else [])
                        )

            await asyncio.wait_for(asyncio.gather(*(pusher(k) for k in range(25))), 90)
            stop.set()
            await mon
        est, real = await _settled(producer)
    assert peak <= limit, f"backlog peaked at {peak} > max_backlog {limit}"
    assert est >= real


# score() with timeouts (no worker: every one times out, its sample stays queued),
# some during a held reading.
async def test_score_timeouts_across_a_reading_settle_exact(redis_url, namespace):
    problems: list[str] = []
    async with RolloutProducer(redis_url, _config(namespace)) as producer:
        await backlog_ready(producer, "sc", 2000)
        hold = ReadHold(producer, before=True, after=True)
        reading = producer._start_backlog_reading()
        early = [asyncio.ensure_future(producer.score(backlog_traj("sc", i), timeout_s=0.05)) for i in range(1, 6)]
        await asyncio.sleep(0.02)
        hold.go_read.set()
        await hold.read.wait()
        late = [asyncio.ensure_future(producer.score(backlog_traj("sc", i), timeout_s=0.05)) for i in range(6, 11)]
        await asyncio.sleep(0.02)
        hold.go_return.set()
        await reading
        hold.restore()
        for r in await asyncio.gather(*early, *late, return_exceptions=True):
            if not isinstance(r, ResultTimeoutError):
                problems.append(f"score: {r!r}")
        est, real = await _settled(producer)
        if est != real or real != 11:
            problems.append(f"settled: estimate {est}, backlog {real}")
        try:
            await producer.push_many(backlog_traj("sc", i) for i in range(11, 20))
        except BackpressureError as exc:
            problems.append(f"a push that fit was refused: {exc}")
    assert not problems, problems


# A partition's very first push answers "count restarted" (the hash did not exist yet:
# push.py's rebuilt), so a reading that ends while it is in flight cannot place it.
# The very first push of a run starts a reading in the background, so this is the
# common start of every producer on a fresh namespace.
async def test_first_push_to_a_partition_across_a_reading(redis_url, namespace):
    problems: list[str] = []
    async with RolloutProducer(redis_url, _config(namespace, partitions=3, max_backlog=60)) as producer:
        await producer.open_batch("fp", 100, 4)
        await producer._ensure_groups()
        orig = producer._send_packed
        gate, entered = asyncio.Event(), asyncio.Event()

        async def held(packed: list[bytes]) -> list[Any]:
            replies = await orig(packed)  # landed
            entered.set()
            await gate.wait()
            return replies

        producer._send_packed = held  # type: ignore[method-assign]
        pushing = asyncio.ensure_future(producer.push_many(backlog_traj("fp", i) for i in range(30)))
        await entered.wait()
        await producer._start_backlog_reading()  # has the thirty, and counts them as on their way
        gate.set()
        await pushing
        producer._send_packed = orig  # type: ignore[method-assign]
        est, real = await _settled(producer)
        if est < real:
            problems.append(f"estimate {est} < backlog {real} (errs low)")
        # A duplicate the reading may have counted (another producer's sample, or a first send
        # whose reply was lost) stays counted: high until the next reading, which is exact.
        if (again := await _read_again(producer)) != real:
            problems.append(f"estimate {again} != backlog {real} after the next reading")
        try:
            await producer.push_many(backlog_traj("fp", i) for i in range(30, 60))  # fits exactly
        except BackpressureError as exc:
            problems.append(f"a push that fit was refused: {exc}")
    assert not problems, problems


# A push given up while its flush is in flight (asyncio.wait_for timing out), then
# pushed again by its caller: the first flush lands FRESH, the retry DUPLICATE, and
# both stay counted (no reading between).
async def test_a_push_timed_out_in_flight_then_retried(redis_url, namespace):
    problems: list[str] = []
    async with RolloutProducer(redis_url, _config(namespace)) as producer:
        await backlog_ready(producer, "to", 2000)
        orig = producer._send_packed
        gate = asyncio.Event()
        calls = 0

        async def slow_first(packed: list[bytes]) -> list[Any]:
            nonlocal calls
            calls += 1
            if calls == 1:
                await gate.wait()  # held before Redis
            return await orig(packed)

        producer._send_packed = slow_first  # type: ignore[method-assign]
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(producer.push_many(backlog_traj("to", i) for i in range(1, 6)), 0.05)
        retry = asyncio.ensure_future(producer.push_many(backlog_traj("to", i) for i in range(1, 6)))
        await asyncio.sleep(0.02)
        gate.set()
        await retry
        producer._send_packed = orig  # type: ignore[method-assign]
        est, real = await _settled(producer)
        if est < real:
            problems.append(f"estimate {est} < backlog {real} (errs low)")
        # A duplicate the reading may have counted (another producer's sample, or a first send
        # whose reply was lost) stays counted: high until the next reading, which is exact.
        if (again := await _read_again(producer)) != real:
            problems.append(f"estimate {again} != backlog {real} after the next reading")
        try:
            await producer.push_many(backlog_traj("to", i) for i in range(6, 6 + LIMIT - real))  # fits exactly
        except BackpressureError as exc:
            problems.append(f"a push that fit was refused: {exc}")
    assert not problems, problems


# A flight marked by a reading (the reading ended while it was on its way), and the
# stream's count restarted after that reading by ANOTHER call (the pushed hash lost,
# every entry delivered, acked and trimmed as workers XTRIM): that call answers
# "restarted" (negative), but the marked flight's own call then answers a positive count
# on the new base, below the reading's, and _place takes it for a call the reading had
# counted. The restarting call is another producer's, or one of this producer's own
# flights. A known limit (docs/operations.md: the count's hash deleted by hand or
# evicted): the estimate is low until the next reading, which is exact again.
@pytest.mark.parametrize("restarter", ["another_producer", "own_other_flight"])
async def test_a_marked_flight_after_the_count_restarted_on_an_empty_stream(redis_url, namespace, restarter):
    problems: list[str] = []
    keys = Keys(namespace)
    admin = connect(redis_url)
    try:
        async with (
            RolloutProducer(redis_url, _config(namespace, coalesce_in_flight=2)) as producer,
            RolloutProducer(redis_url, _config(namespace, max_backlog=0)) as other,
        ):
            await backlog_ready(producer, "rs", 2000)
            await other.open_batch("rq", 100, 4)
            await producer.push_many(backlog_traj("rs", i) for i in range(1, 8))  # count 8
            got = await admin.xreadgroup(producer.config.group, "w", {keys.stream(0): ">"}, count=1000)
            ids = [i for _, entries in got for i, _ in entries]
            await admin.xack(keys.stream(0), producer.config.group, *ids)
            await admin.xtrim(keys.stream(0), maxlen=0, approximate=False)
            orig = producer._send_packed
            gates: list[asyncio.Event] = []
            entered: list[asyncio.Event] = []

            async def held(packed: list[bytes]) -> list[Any]:
                gate, come = asyncio.Event(), asyncio.Event()
                gates.append(gate)
                entered.append(come)
                come.set()
                await gate.wait()
                return await orig(packed)

            producer._send_packed = held  # type: ignore[method-assign]
            own = 5
            late = asyncio.ensure_future(producer.push_many(backlog_traj("rs", i) for i in range(8, 13)))
            await asyncio.sleep(0.02)
            first = None
            if restarter == "own_other_flight":
                first = asyncio.ensure_future(producer.push_many(backlog_traj("rs", i) for i in range(13, 16)))
                own += 3
                await asyncio.sleep(0.02)
            assert len(gates) == (2 if first is not None else 1), len(gates)
            await producer._start_backlog_reading()  # count 8, nothing undelivered; marks the flights
            if producer._backlog != own:
                problems.append(f"after the reading: estimate {producer._backlog} != {own} on their way")
            await admin.delete(keys.pushed(0))  # evicted / deleted
            if first is not None:
                gates[1].set()
                await first  # restarts the count: 0 -> 3 (answers negative: not placed, stays counted)
            else:
                await other.push_many(backlog_traj("rq", i) for i in range(3))  # restarts it: 0 -> 3
            gates[0].set()
            await late  # answers count 8 on the new base: "at most the reading's 8"
            producer._send_packed = orig  # type: ignore[method-assign]
            real = await backlog_truth(redis_url, namespace)
            if (again := await _read_again(producer)) != real:
                problems.append(f"estimate {again} != backlog {real} after the next reading")
            try:
                # the estimate should leave at most LIMIT - own; one more than that
                await producer.push_many(backlog_traj("rs", i) for i in range(20, 20 + LIMIT - real + 1))
            except BackpressureError:
                pass
            else:
                problems.append(f"pushed past max_backlog: backlog now {await backlog_truth(redis_url, namespace)}")
    finally:
        await admin.aclose()
    assert not problems, problems


async def test_a_reply_during_a_reading_after_another_call_restarted_the_count(redis_url, namespace):
    """As N, the reply coming while the reading is on its way (after its count): another
    producer's push restarted the count on the empty stream first, so this producer's push
    answers a positive count below the reading's, and _read_backlog leaves it out of what
    came after the reading (low until the next reading: N's known limit)."""
    problems: list[str] = []
    keys = Keys(namespace)
    admin = connect(redis_url)
    try:
        async with (
            RolloutProducer(redis_url, _config(namespace)) as producer,
            RolloutProducer(redis_url, _config(namespace, max_backlog=0)) as other,
        ):
            await backlog_ready(producer, "rd", 2000)
            await other.open_batch("rq", 100, 4)
            await producer.push_many(backlog_traj("rd", i) for i in range(1, 8))  # count 8
            got = await admin.xreadgroup(producer.config.group, "w", {keys.stream(0): ">"}, count=1000)
            ids = [i for _, entries in got for i, _ in entries]
            await admin.xack(keys.stream(0), producer.config.group, *ids)
            await admin.xtrim(keys.stream(0), maxlen=0, approximate=False)
            hold = ReadHold(producer, after=True)
            reading = producer._start_backlog_reading()
            await hold.read.wait()  # count 8 read, nothing undelivered
            await admin.delete(keys.pushed(0))
            await other.push_many(backlog_traj("rq", i) for i in range(3))  # restarts the count: 0 -> 3
            await producer.push_many(backlog_traj("rd", i) for i in range(8, 13))  # answers 8: "<= the reading's"
            hold.go_return.set()
            await reading
            hold.restore()
            real = await backlog_truth(redis_url, namespace)
            if (again := await _read_again(producer)) != real:  # low until then: the known limit of N
                problems.append(f"estimate {again} != backlog {real} after the next reading")
            try:
                await producer.push_many(backlog_traj("rd", i) for i in range(20, 20 + LIMIT - real + 1))
            except BackpressureError:
                pass
            else:
                problems.append(f"pushed past max_backlog: backlog now {await backlog_truth(redis_url, namespace)}")
    finally:
        await admin.aclose()
    assert not problems, problems


# The estimate on the per-sample path


async def test_backpressure_holds_when_redis_reports_no_lag(redis_url, namespace):
    """After an AOF restart (or deletions mid-stream) XINFO GROUPS reports lag nil."""
    from stream_reward.errors import BackpressureError

    config = ProducerConfig(
        namespace=namespace, max_backlog=10, on_backlog="raise", backlog_poll_s=0.0, samples_per_entry=1
    )  # an entry per sample: the test deletes one mid-stream
    async with RolloutProducer(redis_url, config) as producer:
        await producer.open_batch("lag", 40, 4)
        await producer.push_many(graded("lag", i, True) for i in range(12))
        client = connect(redis_url)
        try:
            stream = producer.keys.stream()
            ids = [entry_id for entry_id, _ in await client.xrange(stream, count=3)]
            await client.xdel(stream, ids[1])  # a tombstone, then a group position Redis cannot count from
            await client.execute_command("XGROUP", "SETID", stream, "scorers", ids[0])
            (group,) = await client.xinfo_groups(stream)
            assert group["lag"] is None  # the condition under test
        finally:
            await client.aclose()
        with pytest.raises(BackpressureError, match="exceeds max_backlog 10"):
            await producer.push(graded("lag", 20, True))


async def test_a_stale_backlog_estimate_with_room_lets_pushes_go_and_catches_up_in_the_background(redis_url, namespace):
    """The backlog estimate (last reading + own pushes) only errs high for one producer;
    another producer's pushes it learns from the reading it starts in the background."""
    from stream_reward.errors import BackpressureError

    config = ProducerConfig(namespace=namespace, max_backlog=10, on_backlog="raise", backlog_poll_s=0.05)
    async with (
        RolloutProducer(redis_url, config) as mine,
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as other,
    ):
        await other.open_batch("o", 20, 4)
        await other.push_many(graded("o", i, True) for i in range(20))  # the backlog is now 20, over our limit
        await mine.open_batch("m", 5, 4)
        await mine.push(graded("m", 0, True))  # our estimate says 0: it goes, and a reading starts
        await asyncio.sleep(0.1)
        # The reading counts samples exactly (each entry is stamped with the samples queued
        # before it): the other's 20 and our 1.
        with pytest.raises(BackpressureError, match="backlog 21 \\+ 1 exceeds max_backlog 10"):
            await mine.push(graded("m", 1, True))


async def test_pushes_waiting_for_room_share_one_backlog_reading(redis_url, namespace):
    from stream_reward.errors import BackpressureError

    config = ProducerConfig(namespace=namespace, max_backlog=10, on_backlog="raise", backlog_poll_s=0.05)
    async with RolloutProducer(redis_url, config) as mine:
        await mine.open_batch("w", 60, 4)
        await mine.push_many(graded("w", i, True) for i in range(10))  # our estimate is at the limit
        await asyncio.sleep(0.06)  # and stale
        client = connect(redis_url)
        try:
            await client.config_resetstat()
            replies = await asyncio.gather(
                *(mine.push(graded("w", i, True)) for i in range(10, 60)), return_exceptions=True
            )
            stats = await client.info("commandstats")
        finally:
            await client.aclose()
    assert all(isinstance(r, BackpressureError) for r in replies)
    assert stats["cmdstat_xinfo|groups"]["calls"] <= 2  # one reading for all 50, not one each


async def test_a_stale_estimate_does_not_let_many_concurrent_pushes_past_max_backlog(redis_url, namespace) -> None:
    """Another producer filled the backlog (20 > max_backlog 10). A producer whose estimate is
    stale lets every concurrent push of the loop turn go before its reading returns."""
    config = ProducerConfig(namespace=namespace, max_backlog=10, on_backlog="raise", backlog_poll_s=0.05)
    async with (
        RolloutProducer(redis_url, config) as mine,
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as other,
    ):
        await other.open_batch("o", 20, 4)
        await other.push_many(traj("o", i) for i in range(20))
        await mine.open_batch("m", 100, 4)
        results = await asyncio.gather(*(mine.push(traj("m", i)) for i in range(100)), return_exceptions=True)
        went = sum(r is None for r in results)
        assert all(r is None or isinstance(r, BackpressureError) for r in results)
        # The design lets a stale estimate's push go; it must not let max_backlog be exceeded tenfold.
        assert went <= config.max_backlog, f"{went} pushes went with a backlog of 20 over max_backlog 10"


@pytest.mark.parametrize("mode", ["raise", "wait"])
async def test_score_refused_or_given_up_at_max_backlog_releases_its_uid_and_count(redis_url, namespace, mode) -> None:
    """The split room check (_has_room / _make_room / _count) on score()'s path: a
    BackpressureError ("raise") or a cancel while waiting for room ("wait") leaves no uid
    reserved, no waiter, and the backlog estimate uncounted; the same uids score fine once
    workers drained the backlog."""
    cfg = ProducerConfig(namespace=namespace, max_backlog=3, on_backlog=mode, backlog_poll_s=0.02)
    async with RolloutProducer(redis_url, cfg) as p:
        await p.open_batch("b", 40, 8)
        await p.push_many([traj("b", i) for i in range(30, 33)])  # the backlog is full
        await asyncio.sleep(0.05)
        samples = [traj("b", i) for i in range(10)]
        if mode == "raise":
            got = await settle([p.score(t, timeout_s=5) for t in samples], 5)
            assert all(isinstance(g, BackpressureError) for g in got), got
        else:
            tasks = [asyncio.ensure_future(p.score(t, timeout_s=5)) for t in samples]
            await asyncio.sleep(0.3)
            assert not any(x.done() for x in tasks), [x for x in tasks if x.done()]
            for x in tasks:
                x.cancel()
            got = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(isinstance(g, asyncio.CancelledError) for g in got), got
        assert [t.uid for t in samples if t.uid in p._uids("b")] == []
        assert p._backlog == 3, p._backlog
        if p._listener is not None:
            clean(p._listener)
        assert sorted(i for _, _, i in await queued(redis_url, p.keys)) == [30, 31, 32]
        async with worker(redis_url, namespace):
            await wait_until(lambda: _zero(p.backlog()), 10, 0.02)  # drained: room again
            await asyncio.sleep(0.05)  # past backlog_poll_s: the next push reads the backlog again
            rs = await asyncio.wait_for(asyncio.gather(*(p.score(t, timeout_s=10) for t in samples[:3])), 15)
        assert [r.score for r in rs] == [expected(t) for t in samples[:3]]
        clean(p._listener)


@pytest.mark.parametrize("verdict", ["fresh", "duplicate", "conflict", "failed_flush"])
async def test_the_backlog_estimate_counts_only_what_score_queued(redis_url, namespace, verdict) -> None:
    """_ScoreCall.apply's backlog correction (readings held off): a FRESH push adds
    one to the estimate, and so does a DUPLICATE (it may be this call's own sample, found by a
    send retried after its reply was lost: the estimate errs high until the next reading,
    never low), and so does a failed flush (its sample may have been queued before the reply
    was lost); a refusal adds nothing; the refused or failed sample's uid is free again."""
    cfg = ProducerConfig(namespace=namespace, backlog_poll_s=1000)
    async with RolloutProducer(redis_url, cfg) as a, RolloutProducer(redis_url, cfg) as p:
        await a.open_batch("c", 10, 8)
        await a.push_many([traj("c", 0), traj("c", 1, uid="taken")])
        await p.push(traj("c", 9))
        if p._backlog_reading is not None:
            await p._backlog_reading
        before = p._backlog
        t = {
            "fresh": traj("c", 2),
            "duplicate": traj("c", 0),
            "conflict": traj("c", 1, uid="mine"),
        }.get(verdict, traj("c", 3))
        if verdict == "failed_flush":

            async def broken(calls: list, cluster: bool) -> list:  # the flush's round trip fails
                raise BrokerError("injected")

            p._call_push = broken  # type: ignore[method-assign]
        got = await outcome(asyncio.wait_for(p.score(t, timeout_s=0.1), 5))
        error, added, kept = {
            "fresh": (ResultTimeoutError, 1, True),
            "duplicate": (ResultTimeoutError, 1, True),
            "conflict": (PushConflictError, 0, False),
            "failed_flush": (BrokerError, 1, False),
        }[verdict]
        assert isinstance(got, error), got
        assert p._backlog - before == added, (p._backlog, before)
        assert (t.uid in p._uids("c")) == kept
        clean(p._listener)


# Lost push replies and killed connections


async def test_max_backlog_control_without_lost_replies(redis_url, namespace) -> None:
    """The control of the next test: the same pushes without a lost reply hit max_backlog."""
    config = ProducerConfig(namespace=namespace, max_backlog=3, on_backlog="raise", backlog_poll_s=60)
    async with RolloutProducer(redis_url, config) as producer:
        await producer.open_batch("m", 8, 4)
        for i in range(3):
            await producer.push(Trajectory("m", i, "test", response="a"))
        with pytest.raises(BackpressureError):
            await producer.push(Trajectory("m", 3, "test", response="a"))


async def test_max_backlog_holds_when_push_replies_are_lost(redis_url, namespace) -> None:
    config = ProducerConfig(namespace=namespace, max_backlog=3, on_backlog="raise", backlog_poll_s=60)
    async with CutProxy(redis_url[len("unix://") :]) as proxy:
        async with RolloutProducer(proxy.url, config) as producer:
            await producer.open_batch("m", 8, 4)
            for i in range(3):
                proxy.arm(b"EVALSHA")
                await producer.push(Trajectory("m", i, "test", response="a"))
            assert proxy.cuts == 3
            assert await producer.backlog() == 3
            with pytest.raises(BackpressureError):
                await producer.push(Trajectory("m", 3, "test", response="a"))


async def test_client_kill_storm_during_concurrent_pushes_counts_each_sample_once(redis_url, namespace) -> None:
    """CLIENT KILL of the producer's lane every few ms while 300 samples are pushed by 60
    concurrent callers: every push returns or raises BrokerError; those that raised are
    pushed again; in the end each sample is counted once."""
    keys = Keys(namespace)
    name = f"pkill-{namespace}"
    admin = connect(redis_url)
    stop = asyncio.Event()
    kills = 0

    async def killer() -> None:
        nonlocal kills
        while not stop.is_set():
            for c in await admin.client_list():
                if c.get("name") == name:
                    try:
                        await admin.client_kill_filter(_id=c["id"])
                        kills += 1
                    except ResponseError:
                        pass
            await asyncio.sleep(random.random() * 0.01)

    try:
        url = f"{redis_url}?client_name={name}"
        async with RolloutProducer(url, ProducerConfig(namespace=namespace)) as producer:
            await producer.open_batch("k", 300, 4)
            await producer.push(Trajectory("k", 0, "test", response="a"))
            killing = asyncio.ensure_future(killer())
            failed: list[int] = []

            async def pusher(lo: int) -> None:
                for i in range(lo, 300, 60):
                    if i == 0:
                        continue
                    try:
                        await asyncio.wait_for(producer.push(Trajectory("k", i, "test", response="a")), 20)
                    except BrokerError:
                        failed.append(i)

            await asyncio.gather(*(pusher(lo) for lo in range(60)))
            stop.set()
            await killing
            assert kills > 0, "no connection was killed: nothing tested"
            for i in failed:
                await producer.push(Trajectory("k", i, "test", response="a"))
        assert int(await admin.hget(keys.pushed(0), "samples")) == 300
    finally:
        stop.set()
        await admin.aclose()


async def test_a_multi_partition_flush_whose_reply_is_lost_counts_each_sample_once(redis_url, namespace) -> None:
    """One flush of several EVALSHA calls (3 partitions, pipelined): the replies are lost
    after all ran; the retry finds every sample a duplicate and nothing is counted twice."""
    config = ProducerConfig(namespace=namespace, partitions=3)
    keys = Keys(namespace, 3)
    admin = connect(redis_url)
    try:
        async with CutProxy(redis_url[len("unix://") :]) as proxy:
            async with RolloutProducer(proxy.url, config) as producer:
                await producer.open_batch("p", 60, 4)
                await producer.push_many([Trajectory("p", i, "test", response="a") for i in range(30)])
                proxy.arm(b"EVALSHA")
                n = await asyncio.wait_for(
                    producer.push_many([Trajectory("p", i, "test", response="a") for i in range(30, 60)]), 10
                )
                assert n == 30 and proxy.cuts == 1
        counts = [int(await admin.hget(keys.pushed(p), "samples") or 0) for p in range(3)]
        assert sum(counts) == 60 and sum(1 for c in counts if c) >= 2, counts
    finally:
        await admin.aclose()


# Samples, not entries


async def test_backlog_counts_samples_not_entries(redis_url, namespace) -> None:
    """max_backlog bounds samples; backlog() must report what it bounds, whatever the
    entries hold: 40 samples in entries of 16, and 5 more pushed one at a time."""
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
        await producer.open_batch("m", 45, 8)
        await producer.push_many(gsm(i) for i in range(40))
        for i in range(40, 45):
            await producer.push(gsm(i))
        assert await producer.backlog() == 45
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as other:
        # Another producer knows none of these entries: it counts them by the pushed counts.
        assert await other.backlog() == 45


async def test_a_redriven_dead_letter_is_stamped_and_counted_in_the_backlog(redis_url, namespace) -> None:
    """A redrive queues the letter again outside a push: the backlog must still count it,
    exactly, and the letter's old stamp must not stand for the new entry's."""
    from stream_reward.ops.deadletters import redrive_dead_letters

    keys = Keys(namespace)
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
        await producer.open_batch("m", 40, 8)
        await producer.push_many(gsm(i) for i in range(39))
        # A sample whose payload no worker can read, with a stale stamp: dead-lettered.
        await producer.client.xadd(keys.stream(), {b"d": b"\xc1", b"h": entry_header("m", 39, "m/39", 1), b"n": b"7"})
        worker = Worker(redis_url, RuleScorer(), ConsumerConfig(namespace=namespace, block_ms=20))
        try:
            await asyncio.wait_for(worker.run(burst=True), 30)
        finally:
            await worker.aclose()
        assert await producer.backlog() == 0
        assert len(await list_dead_letters(redis_url, namespace=namespace)) == 1
        assert await redrive_dead_letters(redis_url, namespace=namespace) == 1
        assert await producer.backlog() == 1
        (entry_id, fields), *_ = (await producer.client.xrange(keys.stream(), min="-", max="+"))[-1:]
        assert fields[b"n"] == b"39"  # after the 39 the script pushed (the hand-made entry counted nothing)
