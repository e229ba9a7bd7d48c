"""Property: whatever lands on the stream, every entry is either scored or
dead-lettered with a reason, nothing stays pending, and the worker keeps running."""

from __future__ import annotations

import asyncio
import uuid

import msgpack
from helpers import done_results
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stream_reward.config import ConsumerConfig
from stream_reward.scoring.registry import RuleScorer
from stream_reward.wire.codec import decode_trajectory, encode_trajectory
from stream_reward.wire.connection import connect
from stream_reward.wire.entries import entry_fields
from stream_reward.wire.keys import Keys
from stream_reward.wire.trajectory import Trajectory
from stream_reward.worker.consumer import Worker

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=True)
    | st.text(max_size=30)
    | st.binary(max_size=30)
)


def _containers(children):
    return st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)


values = st.recursive(scalars, _containers, max_leaves=8)

record = st.fixed_dictionaries(
    {"v": st.sampled_from([1, 1, 1, 2, "1"])},
    optional={
        "u": st.text(max_size=12) | st.integers(-5, 5),
        "b": st.just("B"),
        "i": st.integers(-2, 5) | st.text(max_size=2),
        "ds": st.sampled_from(["openai/gsm8k", "math_dapo", "lighteval/MATH", "nope", ""]) | values,
        "r": st.text(max_size=200) | values,
        "gt": values,
        "ids": st.binary(max_size=16) | values,
        "vl": st.integers(-3, 50) | values,
        "x": st.dictionaries(st.text(max_size=5), values, max_size=3) | values,
        "rm": st.floats() | values,
    },
)
good = st.builds(
    lambda i, r, gt: Trajectory("B", i, "openai/gsm8k", response=r, ground_truth=gt, uid=f"good-{i}"),
    st.integers(0, 5),
    st.text(max_size=80),
    st.text(max_size=6),
)
payload = st.one_of(
    st.binary(max_size=200),
    record.map(lambda obj: msgpack.packb(obj, use_bin_type=True)),
    good.map(encode_trajectory),
)
entry = st.tuples(payload, st.booleans())  # (payload, with plain b/i/u fields)


async def _run(url: str, entries: list[tuple[bytes, bool]]) -> None:
    namespace = f"fz{uuid.uuid4().hex[:8]}"
    keys = Keys(namespace)
    client = connect(url)
    try:
        ids = []
        for n, (data, plain_fields) in enumerate(entries):
            fields = entry_fields(data, "B", n, f"e{n}") if plain_fields else {"d": data}
            ids.append((await client.xadd(keys.stream(), fields), plain_fields, n))
        worker = Worker(url, RuleScorer(), ConsumerConfig(namespace=namespace, block_ms=20))
        await asyncio.wait_for(worker.run(burst=True), 30)
        await worker.aclose()
        assert (
            worker.stats.scored + worker.stats.failed + worker.stats.duplicates
            >= len(entries) - worker.stats.dead_letters
        )
        pending = await client.xpending(keys.stream(), "scorers")
        assert pending["pending"] == 0
        dead = {
            msgpack.unpackb(f[b"e"], raw=False, strict_map_key=False)["entry_id"]: msgpack.unpackb(
                f[b"e"], raw=False, strict_map_key=False
            )
            for _, f in await client.xrange(keys.dead_letters())
        }
        assert all(d["reason"] and d["error"] for d in dead.values())
        ledger = {r.uid: r for r in await done_results(client, keys.done("B"))}
        assert sorted(ledger) == sorted(k.decode() for k in await client.hkeys(keys.results("B")))
        for (entry_id, plain_fields, n), (data, _) in zip(ids, entries):
            if entry_id in dead:
                if plain_fields:  # its batch is known from the plain fields: resolved as failed
                    assert ledger[f"e{n}"].status == "failed"
                continue
            traj = decode_trajectory(data)  # not dead-lettered, so it must decode...
            assert traj.uid in ledger  # ...and has its one result (ok, or failed with a reason)
            result = ledger[traj.uid]
            assert result.status == "ok" or result.reason
        assert worker.stats.dead_letters == len(dead)
    finally:
        await client.aclose()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(st.lists(entry, min_size=1, max_size=12))
def test_every_entry_is_scored_or_dead_lettered(redis_url, entries):
    asyncio.run(_run(redis_url, entries))
