"""max_backlog with on_backlog="raise" must never refuse a push that fits: the producer's
estimate (last reading + what it pushed since) may not count one of its own pushes twice
when that push lands while a reading is in flight."""

from __future__ import annotations

import asyncio

import pytest
from helpers import backlog_traj, refusals_of_pushes_that_fit

from stream_reward import ProducerConfig, RolloutProducer
from stream_reward.errors import BackpressureError

pytestmark = pytest.mark.anyio


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
