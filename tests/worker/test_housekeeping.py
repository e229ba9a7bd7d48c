"""Housekeeping (stream_reward.worker.housekeeping): a live worker renews the entries it
holds, read but not yet opened included, so that a peer's sweep neither takes a slow sample
from it nor bumps its delivery count.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from helpers import (
    exact_traj,
    identity_score,
    identity_worker,
    quick_worker,
    sample_traj,
    wait_until,
)

from stream_reward import ProducerConfig, RolloutProducer, Trajectory
from stream_reward.scoring.scorer import Scored
from stream_reward.wire.keys import Keys

pytestmark = pytest.mark.anyio


# --- renewals: a live worker's entries are not taken by a peer


async def test_a_live_workers_slow_sample_is_neither_taken_by_a_peer_nor_counted_redelivered(
    redis_url, namespace
) -> None:
    """A sample that scores for longer than ``reclaim_idle_ms`` (an LLM judge, a sandbox)
    while its worker is alive: the worker keeps its entry fresh, so an idle peer's reclaim
    sweep leaves it alone (it would score it twice: quota spent twice) and no sweep bumps
    its delivery count (enough bumps quarantine, then dead-letter, an innocent sample)."""
    calls: dict[str, int] = {}

    class Slow:
        async def score(self, t: Trajectory) -> Scored:
            calls[t.uid] = calls.get(t.uid, 0) + 1
            await asyncio.sleep(2.5)
            return Scored(1.0)

    cfg = {"scorer": Slow(), "concurrency": 1, "reclaim_idle_ms": 600}
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as p:
        await p.open_batch("sl", 1, 8)
        stream = p.keys.stream()
        async with identity_worker(redis_url, namespace, **cfg) as holder:
            await p.push(sample_traj("sl", 0))
            await wait_until(lambda: asyncio.sleep(0, bool(calls)))
            async with identity_worker(redis_url, namespace, **{**cfg, "consumer": "peer"}) as peer:
                deliveries = set()
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline:  # until the holder acks it
                    rows = await p.client.xpending_range(stream, "scorers", min="-", max="+", count=1)
                    if not rows:
                        break
                    deliveries.add(rows[0]["times_delivered"])
                    await asyncio.sleep(0.05)
                pending = await p.client.xpending(stream, "scorers")
        assert pending["pending"] == 0
        assert deliveries == {1}, f"a sweep claimed a live worker's entry again (times delivered: {sorted(deliveries)})"
        assert list(calls.values()) == [1], f"scored more than once (a peer took it from a live worker): {calls}"
        assert holder.stats.duplicates == peer.stats.duplicates == 0


async def test_entries_a_live_worker_read_but_has_not_opened_yet_are_not_taken_by_a_peer(redis_url, namespace) -> None:
    """A worker of concurrency 3 guesses 1 sample an entry and reads 3 entries of 16 at once.
    It opens (and holds, and keeps renewing) the first two at once; the third waits, delivered
    but not held, until the first round of scoring ends: longer than reclaim_idle_ms.
    A live peer's sweep must not take it (scored twice, delivery count bumped)."""
    from helpers import wait_until

    calls: dict[str, int] = {}

    class Slow:
        async def score(self, t: Trajectory) -> Scored:
            calls[t.uid] = calls.get(t.uid, 0) + 1
            await asyncio.sleep(1.6)
            return Scored(identity_score(t))

    keys = Keys(namespace)
    n = 48
    cfg = {"concurrency": 3, "reclaim_idle_ms": 1000}
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as p:
        await p.open_batch("nh", n, 8)
        await p.push_many(exact_traj("nh", i) for i in range(n))
        async with quick_worker(redis_url, namespace, Slow(), consumer="holder", **cfg) as holder:
            await wait_until(lambda: asyncio.sleep(0, bool(calls)))
            async with quick_worker(
                redis_url, namespace, Slow(), consumer="peer", **{**cfg, "concurrency": 64}
            ) as peer:
                deliveries = set()

                async def all_scored() -> bool:
                    rows = await p.client.xpending_range(keys.stream(), "scorers", min="-", max="+", count=100)
                    deliveries.update(r["times_delivered"] for r in rows)
                    return await p.client.hlen(keys.results("nh")) == n and not rows

                await wait_until(all_scored, timeout_s=30)
    twice = {u: c for u, c in calls.items() if c > 1}
    assert deliveries == {1}, f"a sweep claimed a live worker's entry (times delivered: {sorted(deliveries)})"
    assert not twice and peer.stats.reclaimed == 0, f"peer reclaimed {peer.stats.reclaimed}; scored twice: {twice}"
    assert holder.stats.duplicates + peer.stats.duplicates == 0
