"""Starting, scoring and refusing one sample (worker/samples.py).

It promises: a sample the worker refuses (a payload that does not decode, too many
deliveries) is a `failed` result of its batch and index whenever its entry names them,
also when it names no usable uid, so its batch completes instead of waiting for its deadline.
"""

from __future__ import annotations

import asyncio

import msgpack
import pytest
from helpers import WIDTH, Exact, producer_and_aggregator, samples

from stream_reward.config import ConsumerConfig
from stream_reward.ops.deadletters import list_dead_letters
from stream_reward.wire.codec import encode_trajectory
from stream_reward.wire.entries import entry_header
from stream_reward.wire.keys import Keys
from stream_reward.worker.consumer import Worker

pytestmark = pytest.mark.anyio


def _payload(uid: object) -> bytes:
    """Sample 2 of batch "r" as a producer encodes it, its uid replaced (``...``: left out)."""
    fields = msgpack.unpackb(encode_trajectory(samples("r", ["a", "a", "a"])[2]))
    del fields["u"]
    if uid is not ...:
        fields["u"] = uid
    return msgpack.packb(fields)


# The entry of sample 2: a header whose uid is null, one whose uid is a number, none at all.
ENTRIES = {
    "null uid": lambda: {"d": _payload(None), "h": entry_header("r", 2, None, len(_payload(None)))},  # type: ignore[arg-type]
    "numeric uid": lambda: {"d": _payload(7), "h": entry_header("r", 2, 7, len(_payload(7)))},  # type: ignore[arg-type]
    "no header, no uid": lambda: {"d": _payload(...)},
}


@pytest.mark.parametrize("entry", list(ENTRIES))
async def test_a_refused_sample_whose_entry_names_no_uid_is_a_failed_result_of_its_batch_and_index(
    redis_url: str, namespace: str, entry: str
) -> None:
    keys = Keys(namespace)
    async with producer_and_aggregator(redis_url, namespace) as (producer, agg):
        await producer.open_batch("r", 3, WIDTH)
        await producer.push_many(samples("r", ["a", "a"]))
        await producer.client.xadd(keys.stream(), ENTRIES[entry]())
        w = Worker(redis_url, Exact(), ConsumerConfig(namespace=namespace, block_ms=20))
        await asyncio.wait_for(w.run(burst=True), 30)
        await w.aclose()
        rewards = await agg.collect("r", timeout_s=10)  # complete: not left to a deadline or timeout
    assert rewards.status == ["ok", "ok", "failed"]
    assert rewards.results[2].reason == "malformed" and "names no usable uid" in (rewards.errors[2] or "")
    letters = await list_dead_letters(redis_url, namespace=namespace)
    assert len(letters) == 1  # and it is kept for inspection, once
