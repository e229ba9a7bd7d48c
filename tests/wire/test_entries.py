"""Entries that hold several samples (wire/entries.py), as a worker reads them: a garbled
sample fails alone, and what a dead letter keeps is that sample's own entry; an entry whose
headers are lost is split by its payloads.
"""

from __future__ import annotations

import asyncio

import pytest

from stream_reward import ProducerConfig, RewardAggregator, Trajectory
from stream_reward.config import ConsumerConfig
from stream_reward.ops.deadletters import list_dead_letters
from stream_reward.scoring.registry import RuleScorer
from stream_reward.trainer.producer import RolloutProducer
from stream_reward.wire.codec import encode_trajectory
from stream_reward.wire.connection import connect
from stream_reward.wire.entries import entry_header, read_header, read_members
from stream_reward.wire.keys import Keys
from stream_reward.worker.consumer import Worker

pytestmark = pytest.mark.anyio


def gsm(i: int) -> Trajectory:
    return Trajectory("m", i, "openai/gsm8k", response=f"#### {i}", ground_truth=str(i))


async def score_one_entry(redis_url: str, namespace: str, fields: dict) -> tuple:
    """Queue a hand-made entry of batch "m" (3 samples), let a burst worker score it: the
    batch's rewards (missing ones resolved as failed) and how many entries stay pending."""
    keys = Keys(namespace)
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
        await producer.open_batch("m", 3, 8)
        await producer.client.xadd(keys.stream(), fields)
    worker = Worker(redis_url, RuleScorer(), ConsumerConfig(namespace=namespace, block_ms=20))
    try:
        await asyncio.wait_for(worker.run(burst=True), 30)
    finally:
        await worker.aclose()
    async with RewardAggregator(redis_url, namespace=namespace) as agg:
        rewards = await agg.collect("m", timeout_s=3, on_timeout="resolve")
    client = connect(redis_url)
    try:
        return rewards, (await client.xpending(keys.stream(), "scorers"))["pending"]
    finally:
        await client.aclose()


async def test_a_garbled_sample_in_an_entry_of_three_fails_alone(redis_url, namespace) -> None:
    payloads = [encode_trajectory(gsm(0)), b"\xc1not msgpack", encode_trajectory(gsm(2))]
    fields = {
        "d": b"".join(payloads),
        "h": b"".join(entry_header("m", i, f"m/{i}", len(p)) for i, p in enumerate(payloads)),
    }
    assert [m[1] for m in read_members({k.encode(): v for k, v in fields.items()}) or []] == [0, 1, 2]
    rewards, pending = await score_one_entry(redis_url, namespace, fields)
    assert rewards.status == ["ok", "failed", "ok"] and rewards.scores[0] == rewards.scores[2] == 1.0
    assert rewards.results[1].reason == "malformed"
    (letter,) = await list_dead_letters(redis_url, namespace=namespace)
    assert read_header(letter.fields) == ("m", 1, "m/1")  # the sample's own entry, not all three
    assert letter.fields["d"] == b"\xc1not msgpack"
    assert pending == 0  # acked once all three settled


@pytest.mark.parametrize("header", [b"\xc1garbled", None])
async def test_an_entry_of_three_whose_headers_are_lost_is_split_by_its_payloads(redis_url, namespace, header) -> None:
    """The headers of an entry of three are garbled (or missing) but its payloads are whole:
    each sample's payload names its batch, index and uid, so each is scored. Read as one
    sample it would fail to decode (three payloads back to back) and be dead-lettered whole,
    with no result for any of the three: the batch would wait for its deadline."""
    fields = {"d": b"".join(encode_trajectory(gsm(i)) for i in range(3))}
    if header is not None:
        fields["h"] = header
    rewards, pending = await score_one_entry(redis_url, namespace, fields)
    assert rewards.status == ["ok", "ok", "ok"], [(r.status, r.reason) for r in rewards.results]
    assert rewards.scores == [1.0, 1.0, 1.0]
    assert await list_dead_letters(redis_url, namespace=namespace) == []
    assert pending == 0
