"""Attacks on the exact backlog estimate, by a helper: "the estimate never counts this
producer's own pushes twice and never misses them; where it cannot know, it errs high,
never low". No worker runs, so the backlog is exactly what was pushed less what the
group was delivered. A reading is held in flight by wrapping the producer's read (after
or before its server round trips), a push by wrapping its send (before it reaches Redis,
or after it landed, holding its reply back). The truth is read by a second producer."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from helpers import CutProxy, ReadHold, SendHold, backlog_ready, backlog_traj, backlog_truth

from stream_reward import ProducerConfig, RolloutProducer, Trajectory
from stream_reward.errors import BackpressureError, PushConflictError
from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys

pytestmark = pytest.mark.anyio

LIMIT = 20


async def _fresh_reading(producer: RolloutProducer) -> None:
    await producer._start_backlog_reading()


def _config(namespace: str, **kw: Any) -> ProducerConfig:
    base: dict[str, Any] = dict(namespace=namespace, max_backlog=LIMIT, on_backlog="raise", backlog_poll_s=60.0)
    base.update(kw)
    return ProducerConfig(**base)


# ---------------------------------------------------------------------------------------
# 1. A push counted before a reading started lands after its HMGET, and its reply comes
#    after the reading completed: in between the estimate misses it (errs LOW), and a push
#    that does not fit goes through.


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


# 2. The mirror: a push counted after a reading started lands before its HMGET, and its
#    reply comes after the reading completed: in between it is counted twice, and a push
#    that fits is refused.


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


# ---------------------------------------------------------------------------------------
# 3. A reply lost and the push resent (the lane's retry): the resend's verdicts are
#    DUPLICATE: the first send ran, so they count as the fresh ones would.


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


# ---------------------------------------------------------------------------------------
# 4. The slow path during a reading: samples refused (another producer holds their
#    index with other content) in a call whose reply comes while the reading is in flight.


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


# ---------------------------------------------------------------------------------------
# 5. The pushed-count hash deleted by hand: the reading cannot read the stream's count
#    (falls back to the lag), so no reply can be placed against it. A push counted before the
#    reading and landing after it must still be counted (err high, never low).


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


# 6. The count runs backwards: every entry delivered, acked and trimmed (as workers
#    XTRIM), and the pushed hash lost while a reading is in flight after its HMGET. The
#    next push's script restarts the count at 0, so its reply's count is below the
#    reading's: it must not be taken for a call the reading counted.


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


# ---------------------------------------------------------------------------------------
# 7. Controls the change claims to handle: several partitions in one flush, both sides
#    of a reading; samples_per_entry > 1; another producer pushing on both sides.


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


# 8. A reading that fails after the server answered, while replies came in; the next
#    reading must still be exact.


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


# 9. SCRIPT FLUSH while a reading is in flight: NOSCRIPT, reload, resend after the count.


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


# 10. Stress: backlog_poll_s=0 (a reading after every push), several flushes in flight,
#     random delays on sends, replies and readings; three partitions. Once every push
#     and reading has settled, the estimate is exact.


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


# 11. score() cancelled while a reading is in flight, before its flush: nothing queued.


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


# 12. No simulated delays: many concurrent pushers, a reading after every push, until
#     max_backlog refuses them; the group then takes everything, and again. The backlog
#     may never pass max_backlog (refusals are allowed: other tests look at those).


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


# 13. No simulated delays either: one large push in flight (its reply comes late: the
#     server takes time to read and run it) while new one-sample pushes arrive and each
#     starts a reading (backlog_poll_s=0). A reading started after the large push was
#     counted can end before its reply is in; pushes checked in between must still see it.


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
