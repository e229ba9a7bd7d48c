"""Never a stale, wrong or early-failed reward, end to end (producer -> Redis -> worker
processes -> aggregator): a collect after the deadline returns the stored results; two
uids on one index never end a collect early; a conflict never raises a timeout at zero
seconds; a worker of another consumer group never decides the batch; a bad response fails
its sample as bad input naming the field; a record of another protocol version fails its
sample, not the batch; a namespace whose state vanished is noticed by the collect, the
producer and the worker; an expired batch is told apart from one never opened; missing
samples say whether they were never pushed or ran past the deadline, with their uid.
"""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
from helpers import WIDTH, samples, worker

from stream_reward import BatchPolicy, RewardAggregator, RolloutProducer, Trajectory
from stream_reward.config import ProducerConfig
from stream_reward.errors import CollectTimeoutError, PushConflictError, StateLostError
from stream_reward.scoring.scorer import Scored
from stream_reward.wire.codec import PROTOCOL_VERSION, encode_result
from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys
from stream_reward.wire.ledger import LedgerItem, LedgerWriter
from stream_reward.wire.trajectory import ScoreResult

pytestmark = pytest.mark.anyio


class Constant:
    def __init__(self, value: float) -> None:
        self.value = value

    async def score(self, traj: Trajectory) -> Scored:
        return Scored(self.value)


async def land_result(redis_url: str, namespace: str, result: ScoreResult) -> None:
    """Write a result as a worker would, past the push-time checks."""
    client = connect(redis_url)
    try:
        ledger = LedgerWriter(client, Keys(namespace), "scorers", result_ttl_s=600)
        await ledger.write(0, [LedgerItem("", result.batch_id, result.uid, encode_result(result))])
    finally:
        await client.aclose()


@pytest.mark.parametrize("on_failure", ["fallback", "drop", "mask"])
async def test_collect_after_the_deadline_returns_the_stored_results(
    redis_url: str, namespace: str, on_failure: str
) -> None:
    policy = BatchPolicy(on_failure=on_failure, fallback_score=0.5, deadline_s=1.0)  # type: ignore[arg-type]
    batch = f"late-{on_failure}"
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await producer.open_batch(batch, 3, WIDTH, policy=policy)
        await producer.push_many(samples(batch, ["a", "b"]))  # index 2 is never pushed
        async with worker(redis_url, namespace):
            async for _ in agg.stream(batch, timeout_s=10):
                pass
        await asyncio.sleep(1.2)  # past the deadline, then collect
        rewards = await agg.collect(batch)
    by_index = dict(zip(rewards.indices, zip(rewards.status, rewards.scores)))
    assert by_index[0] == ("ok", 1.0) and by_index[1] == ("ok", 0.0)
    if on_failure == "drop":
        assert 2 not in by_index
    else:
        assert by_index[2][0] == "failed"
        assert rewards.results[-1].reason == "never_pushed"


async def test_two_uids_on_one_index_never_end_collect_early(redis_url: str, namespace: str) -> None:
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
        worker(redis_url, namespace),
    ):
        await producer.open_batch("x", 2, WIDTH)
        # Index 0 twice under two uids (a conflict), index 1 still to come. The push refuses
        # the second; a result for it may still land (a build without the push check, a
        # cluster where claims are per partition): the aggregator must not count it.
        await producer.push(Trajectory("x", 0, "test", response="a", ground_truth="a", uid="u0"))
        with pytest.raises(PushConflictError):
            await producer.push(Trajectory("x", 0, "test", response="b", ground_truth="a", uid="u0-again"))
        await land_result(redis_url, namespace, ScoreResult("u0-again", "x", 0, 0.25))
        collecting = asyncio.create_task(agg.collect("x", timeout_s=20, on_timeout="resolve"))
        await asyncio.sleep(1.0)
        assert not collecting.done()  # two results landed, but only one index is resolved
        await producer.push(Trajectory("x", 1, "test", response="a", ground_truth="a", uid="u1"))
        rewards = await collecting
    assert rewards.status == ["ok", "ok"]
    assert rewards.results[0].uid == "u0" and rewards.results[1].uid == "u1"


async def test_a_conflict_never_raises_a_timeout_at_zero_seconds(redis_url: str, namespace: str) -> None:
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
        worker(redis_url, namespace),
    ):
        await producer.open_batch("y", 2, WIDTH)
        await producer.push(Trajectory("y", 0, "test", response="a", ground_truth="a", uid="p"))
        await land_result(redis_url, namespace, ScoreResult("q", "y", 0, 1.0))  # index 0 again, another uid
        started = time.monotonic()
        with pytest.raises(CollectTimeoutError):
            await agg.collect("y", timeout_s=1.5)
        assert time.monotonic() - started >= 1.4


async def test_a_worker_of_another_group_never_decides_the_batch(redis_url: str, namespace: str) -> None:
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await producer.open_batch("g", 20, WIDTH)
        await producer.push_many(samples("g", ["a"] * 20))
        # The judges group scores everything first, with another scorer ...
        async with worker(redis_url, namespace, Constant(-7.0), group="judges", consumer="j1"):
            client = connect(redis_url)
            try:
                for _ in range(200):
                    groups = await client.xinfo_groups(Keys(namespace).stream())
                    judges = [g for g in groups if g["name"] in (b"judges", "judges")]
                    if judges and judges[0]["pending"] == 0 and judges[0]["entries-read"] == 20:
                        break
                    await asyncio.sleep(0.05)
            finally:
                await client.aclose()
        # ... then the batch's own group: its scores are the batch's rewards.
        async with worker(redis_url, namespace):
            rewards = await agg.collect("g", timeout_s=20)
    assert rewards.scores == [1.0] * 20


async def test_null_response_fails_as_bad_input_naming_the_field(redis_url: str, namespace: str) -> None:
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
        worker(redis_url, namespace),
    ):
        await producer.open_batch("n", 2, WIDTH)
        await producer.push(Trajectory("n", 0, "test", response=None, ground_truth="a"))  # type: ignore[arg-type]
        await producer.push(Trajectory("n", 1, "test", response="a", ground_truth="a"))
        rewards = await agg.collect("n", timeout_s=20)
    assert rewards.status == ["failed", "ok"]
    assert rewards.results[0].reason == "bad_input"
    assert "response" in (rewards.errors[0] or "")


async def test_a_result_of_another_version_fails_its_sample_not_the_batch(redis_url: str, namespace: str) -> None:
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await producer.open_batch("v", 3, WIDTH)
        client = connect(redis_url)
        try:
            ledger = LedgerWriter(client, Keys(namespace), "scorers", result_ttl_s=60)
            old = msgpack.packb([PROTOCOL_VERSION - 1, "v/0", "v", 0, 1.0, "ok", 1, 0.0, None, None, None, 3])
            items = [LedgerItem("", "v", "v/0", old)]
            items += [LedgerItem("", "v", f"v/{i}", encode_result(ScoreResult(f"v/{i}", "v", i, 1.0))) for i in (1, 2)]
            await ledger.write(0, items)
        finally:
            await client.aclose()
        rewards = await agg.collect("v", timeout_s=10)
    assert rewards.status == ["failed", "ok", "ok"]
    assert rewards.results[0].reason == "schema_version"
    assert rewards.results[0].uid == "v/0"


async def test_collect_raises_state_lost_when_the_namespace_vanishes(redis_url: str, namespace: str) -> None:
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await producer.open_batch("s", 2, WIDTH)
        collecting = asyncio.create_task(agg.collect("s", timeout_s=None))
        await asyncio.sleep(0.5)
        client = connect(redis_url)
        try:
            keys = await client.keys(f"{{{namespace}}}*")
            await client.delete(*keys)  # what a restart without persistence leaves of this namespace
        finally:
            await client.aclose()
        with pytest.raises(StateLostError, match="'s'"):
            await asyncio.wait_for(collecting, 5)
        with pytest.raises(StateLostError):
            await agg.collect("s", timeout_s=1)


async def test_producer_and_worker_notice_a_lost_state_and_carry_on(redis_url: str, namespace: str) -> None:
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await producer.open_batch("before", 2, WIDTH)
        await producer.push_many(samples("before", ["a"]))
        await agg.meta("before")  # the aggregator saw the old epoch
        client = connect(redis_url)
        try:
            await client.delete(*await client.keys(f"{{{namespace}}}*"))
        finally:
            await client.aclose()
        with pytest.raises(StateLostError, match="'before'") as info:
            await producer.open_batch("after", 1, WIDTH)
        assert info.value.batches == ["before"]
        # The next batch works: the producer made its stream and group again.
        await producer.open_batch("after", 1, WIDTH)
        await producer.push_many(samples("after", ["a"]))
        async with worker(redis_url, namespace):
            assert (await agg.collect("after", timeout_s=20)).scores == [1.0]


async def test_expired_and_never_opened_are_told_apart(redis_url: str, namespace: str) -> None:
    from stream_reward.errors import ConfigError

    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace, collected_ttl_s=1) as agg,
        worker(redis_url, namespace),
    ):
        await producer.open_batch("e", 1, WIDTH)
        await producer.push_many(samples("e", ["a"]))
        await agg.collect("e", timeout_s=20)
        await asyncio.sleep(1.5)
        with pytest.raises(ConfigError, match="expired"):
            await agg.collect("e", timeout_s=1)
        with pytest.raises(ConfigError, match="never opened"):
            await agg.collect("nope", timeout_s=1)


async def test_missing_samples_say_never_pushed_or_deadline_with_their_uid(redis_url: str, namespace: str) -> None:
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await producer.open_batch("m", 3, WIDTH)
        # Index 0 and 1 pushed (nobody scores them), index 2 never pushed.
        await producer.push(Trajectory("m", 0, "test", response="a", uid="pushed-0", valid_response_length=3))
        await producer.push(Trajectory("m", 1, "test", response="a", uid="pushed-1", valid_response_length=2))
        rewards = await agg.collect("m", timeout_s=0.5, on_timeout="resolve")
    first, second, third = rewards.results
    assert (first.reason, first.valid_response_length, first.uid) == ("timeout", 3, "pushed-0")
    assert (second.reason, second.uid) == ("timeout", "pushed-1")
    assert "pushed as uid 'pushed-1'" in (second.error or "")
    assert third.reason == "never_pushed" and third.uid == ""
    assert "never pushed" in (third.error or "")
