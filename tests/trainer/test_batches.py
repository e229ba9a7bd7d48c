"""Opening a batch (trainer/batches.py): a batch id is unique in its namespace while its
keys live. Reopening one is refused (BatchExistsError, saying when it was opened or
collected) rather than answered with its stored rewards; ``resume=True`` continues an
open, uncollected batch of the same size, width and policy, and refuses any other.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from helpers import WIDTH, CutProxy, producer_and_aggregator, samples, wait_until, worker

from stream_reward import BatchPolicy, RewardAggregator, RolloutProducer
from stream_reward.config import ProducerConfig
from stream_reward.errors import BatchExistsError, BrokerError
from stream_reward.wire.connection import connect

pytestmark = pytest.mark.anyio


async def test_reopening_a_batch_id_is_refused_not_answered_with_old_rewards(redis_url: str, namespace: str) -> None:
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
        worker(redis_url, namespace),
    ):
        await producer.open_batch("b", 3, WIDTH)
        await producer.push_many(samples("b", ["a", "a", "a"]))
        assert (await agg.collect("b", timeout_s=20)).scores == [1.0, 1.0, 1.0]
        # The same id again (all wrong this time): refused, saying the batch was collected.
        with pytest.raises(BatchExistsError, match="collected") as info:
            await producer.open_batch("b", 3, WIDTH)
        assert "unique" in str(info.value)
        # Open and not collected: refused too, saying when it was opened.
        await producer.open_batch("c", 2, WIDTH)
        with pytest.raises(BatchExistsError, match="opened"):
            await producer.open_batch("c", 5, WIDTH)
        # A restarted producer continuing its own batch resumes it; another size or policy is refused.
        await producer.open_batch("c", 2, WIDTH, resume=True)
        with pytest.raises(BatchExistsError, match="size"):
            await producer.open_batch("c", 3, WIDTH, resume=True)
        with pytest.raises(BatchExistsError, match="on_failure"):
            await producer.open_batch("c", 2, WIDTH, resume=True, policy=BatchPolicy(on_failure="drop"))


async def test_open_batch_whose_reply_was_lost_succeeds_on_its_retry(redis_url: str, namespace: str) -> None:
    """The open ran, its reply was cut, and redis-py sent it again: the retry finds the
    batch it created itself and succeeds. Anyone else opening that id is still refused."""
    config = ProducerConfig(namespace=namespace)
    async with CutProxy(redis_url[len("unix://") :]) as proxy:
        async with RolloutProducer(proxy.url, config) as producer, RolloutProducer(redis_url, config) as other:
            await producer.open_batch("warm", 1, WIDTH)  # the open script is loaded: the cut hits its run
            proxy.arm(b"cut-open")
            await producer.open_batch("cut-open", 2, WIDTH)
            assert proxy.cuts == 1
            with pytest.raises(BatchExistsError, match="opened"):
                await other.open_batch("cut-open", 2, WIDTH)
            with pytest.raises(BatchExistsError, match="opened"):
                await producer.open_batch("cut-open", 2, WIDTH)  # opened: a second open is a reuse


@pytest.mark.parametrize("shift_s", [-3600.0, 3600.0])
async def test_a_producer_clock_an_hour_off_neither_misses_its_deadline_nor_hits_it_at_once(
    redis_url: str, namespace: str, shift_s: float
) -> None:
    """The deadline is the server's time: a producer an hour behind would never reach it
    on its own clock, one an hour ahead would be past it at once."""
    real_time = time.time
    async with producer_and_aggregator(redis_url, namespace) as (producer, agg):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(
                time, "time", lambda: real_time() + shift_s
            )  # this process's clock only; the server keeps its own
            await producer.open_batch("b", 2, WIDTH, policy=BatchPolicy(deadline_s=1.0))
            await producer.push_many(samples("b", ["a", "a"]))  # no worker: neither is ever scored
        began = time.monotonic()
        rewards = await agg.collect("b", timeout_s=15, on_timeout="resolve")
        elapsed = time.monotonic() - began
    assert [r.reason for r in rewards.results] == ["deadline", "deadline"]  # not "timeout": the deadline fired
    assert 0.8 <= elapsed < 10  # and not at once


async def test_an_open_refused_for_memory_succeeds_once_memory_is_back(own_url: str, namespace: str) -> None:
    """An open refused with ``OOM command not allowed`` (noeviction at maxmemory) is waited
    out with backoff, not raised at the first refusal: the batch opens once memory frees."""
    admin = connect(own_url)
    try:
        async with RolloutProducer(own_url, ProducerConfig(namespace=namespace)) as producer:
            await producer.open_batch("warm", 1, WIDTH)  # groups made, script loaded
            await admin.config_set("maxmemory", 1)  # below what is used: every write is refused
            opening = asyncio.ensure_future(producer.open_batch("m", 2, WIDTH))

            async def refused_twice() -> bool:
                stats = await admin.info("errorstats")
                return opening.done() or int(stats.get("errorstat_OOM", {}).get("count", 0)) >= 2

            await wait_until(refused_twice)
            assert not opening.done(), opening.exception()
            await admin.config_set("maxmemory", 0)
            await asyncio.wait_for(opening, 30)
            assert await admin.exists(producer.keys.batch_meta("m"))
    finally:
        await admin.aclose()


async def test_a_user_without_script_rights_is_told_what_was_refused(own_url: str, namespace: str) -> None:
    """A permanent refusal (an ACL user without EVALSHA) is not waited out like OOM: it is
    raised at once, saying what the producer was doing and that the user lacks the right."""
    admin = connect(own_url)
    try:
        await admin.execute_command(
            "ACL", "SETUSER", "noscripts", "on", ">pw", "~*", "&*", "+@all", "-evalsha", "-eval"
        )
        url = own_url.replace("unix://", "unix://noscripts:pw@", 1)
        async with RolloutProducer(url, ProducerConfig(namespace=namespace)) as producer:
            with pytest.raises(BrokerError, match=r"^open_batch 'b' on .*lacks the permission"):
                await producer.open_batch("b", 1, WIDTH)
            with pytest.raises(BrokerError, match=r"^push of 1 trajectories failed: .*lacks the permission"):
                await producer.push_many(samples("b", ["a"]))
    finally:
        await admin.aclose()
