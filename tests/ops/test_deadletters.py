"""Redriving dead letters: a letter is queued again once, by two concurrent redrives or by
one run twice in a row.
"""

from __future__ import annotations

import asyncio

import pytest
from helpers import _letter_of_first_sample, exact_traj

from stream_reward import ProducerConfig, RolloutProducer
from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys

pytestmark = pytest.mark.anyio


async def test_two_concurrent_redrives_queue_a_letter_once(redis_url, namespace) -> None:
    """Two operators (or a retried CLI) redrive at once: both list the letter, both run the
    requeue script; the script XADDs before its XDEL and never checks the XDEL deleted
    anything, so the letter is queued twice."""
    from stream_reward.ops.deadletters import redrive_dead_letters

    keys = Keys(namespace)
    client = connect(redis_url)
    try:
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
            await producer.open_batch("r", 4, 8)
            await producer.push_many(exact_traj("r", i) for i in range(4))
            await _letter_of_first_sample(client, keys)
            before = await client.xlen(keys.stream())
            moved = await asyncio.gather(
                redrive_dead_letters(redis_url, namespace=namespace),
                redrive_dead_letters(redis_url, namespace=namespace),
            )
            added = await client.xlen(keys.stream()) - before
            assert added == 1, f"one letter queued {added} times (redrives returned {moved})"
            assert sum(moved) == 1
            assert int(await client.hget(keys.pushed(0), "requeued")) == 1
    finally:
        await client.aclose()


async def test_a_redrive_run_twice_in_a_row_queues_the_letter_once(redis_url, namespace) -> None:
    from stream_reward.ops.deadletters import redrive_dead_letters

    keys = Keys(namespace)
    client = connect(redis_url)
    try:
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
            await producer.open_batch("r", 4, 8)
            await producer.push_many(exact_traj("r", i) for i in range(4))
            await _letter_of_first_sample(client, keys)
            assert await redrive_dead_letters(redis_url, namespace=namespace) == 1
            assert await redrive_dead_letters(redis_url, namespace=namespace) == 0
            assert await client.xlen(keys.stream()) == 2
    finally:
        await client.aclose()
