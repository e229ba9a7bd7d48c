"""What a collected batch leaves on the trainer's heap.

A trainer holds a batch's rewards through its step, and the aggregator holds the
results while the batch fills. An object the garbage collector tracks per sample,
alive that long, is promoted to the oldest generation and counts toward its next
full collection, which walks the whole heap of a process that has torch (and a
model) loaded: measured in ``bench throughput``, 3 full collections of ~0.12 s per
100,000 samples in the producer process. The results are kept as tuples of atoms,
which the collector stops tracking after one pass, and made ScoreResults on first use.
"""

from __future__ import annotations

import gc

import pytest
from helpers import producer_and_aggregator

from stream_reward import RolloutProducer, ScoreResult
from stream_reward.wire.codec import encode_result
from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys
from stream_reward.wire.ledger import LedgerItem, LedgerWriter

pytestmark = pytest.mark.anyio

N = 3000


def result(batch: str, i: int) -> ScoreResult:
    extra = {"acc": i % 2 == 0, "pred": str(i)} if i % 3 else {}
    status = "failed" if i % 7 == 0 else "ok"
    return ScoreResult(
        f"{batch}/{i}",
        batch,
        i,
        float(i % 5),
        status,
        extra,
        "scorer_error" if status == "failed" else None,
        "boom" if status == "failed" else None,
        1 + i % 2,
        i % 11,
        "openai/gsm8k",
        f"g{i // 8}",
        1_700_000_000.5 + i,
    )


async def store(redis_url: str, namespace: str, producer: RolloutProducer, batch: str) -> list[ScoreResult]:
    await producer.open_batch(batch, N, 16)
    results = [result(batch, i) for i in range(N)]
    client = connect(redis_url)
    try:
        ledger = LedgerWriter(client, Keys(namespace), "scorers", result_ttl_s=60)
        for lo in range(0, N, 500):
            items = [LedgerItem("", batch, r.uid, encode_result(r)) for r in results[lo : lo + 500]]
            assert await ledger.write(0, items) == len(items)
    finally:
        await client.aclose()
    return results


async def test_a_collected_batch_holds_no_tracked_object_per_sample_until_its_results_are_asked_for(
    redis_url, namespace
) -> None:
    async with producer_and_aggregator(redis_url, namespace) as (producer, agg):
        await store(redis_url, namespace, producer, "warm")
        await agg.collect("warm", timeout_s=30)  # connections, scripts, torch's first calls
        expected = await store(redis_url, namespace, producer, "b")
        gc.collect()
        before = len(gc.get_objects())
        rewards = await agg.collect("b", timeout_s=30)
        gc.collect()
        held = len(gc.get_objects()) - before
        # Before: one ScoreResult per sample (3,000 and more); the lists of the batch's fields are a handful.
        assert held < N // 20, held
        # What the results were, unchanged: every field, made once and kept.
        assert rewards.results == expected
        assert rewards.results is rewards.results
        assert rewards.scores == [r.score if r.status == "ok" else 0.0 for r in expected]  # the default policy
        assert rewards.status == [r.status for r in expected]
        assert rewards.errors == [r.error for r in expected]
        assert rewards.reward_extra_info["acc"] == [r.extra.get("acc") for r in expected]
        # Each sample's extra is its own dict, as a ScoreResult's always was.
        rewards.results[1].extra["mine"] = 1
        assert "mine" not in rewards.results[2].extra
