"""The blocking producer (trainer/sync_producer.py): ``SyncRolloutProducer``'s calls from
many threads at once each get their own outcome (result, refusal, failure, timeout), and
``close()`` ends every caller.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from helpers import traj
from trainer_support import graded

from stream_reward import ProducerConfig, SyncRolloutProducer
from stream_reward.errors import BrokerError, PushConflictError, ResultTimeoutError

pytestmark = pytest.mark.anyio


SCORER = "python:tests/data/scorers.py:exact"


def test_sync_producer_score_from_many_threads(redis_url, namespace, spawn_workers):
    from concurrent.futures import ThreadPoolExecutor

    spawn_workers(1, "--scorer", SCORER)
    with SyncRolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
        producer.open_batch("th", 40, 4)
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda i: producer.score(graded("th", i, i % 2 == 0), timeout_s=60), range(40)))
        closing = time.monotonic()
    # Closing ends the listener's blocking read at once, not after its 30 s idle drop.
    assert time.monotonic() - closing < 5
    assert [r.score for r in results] == [1.0 if i % 2 == 0 else 0.0 for i in range(40)]


def test_sync_score_refusal_failure_timeouts_and_close_from_threads(redis_url, namespace) -> None:
    cfg = ProducerConfig(namespace=namespace)
    sp = SyncRolloutProducer(redis_url, cfg)
    try:
        sp.open_batch("q", 100, 8)
        sp.push(traj("q", 0, uid="taken"))
        start = time.monotonic()
        with pytest.raises(PushConflictError):
            sp.score(traj("q", 0, uid="mine"))  # no timeout, no worker: must raise at once
        assert time.monotonic() - start < 2
        start = time.monotonic()
        with pytest.raises(ResultTimeoutError):
            sp.score(traj("q", 1), timeout_s=0.2)
        assert 0.2 <= time.monotonic() - start < 2
        with pytest.raises(ResultTimeoutError):
            sp.score(traj("q", 2), timeout_s=0)

        async def broken(entries: list) -> list[int]:
            await asyncio.sleep(0.05)
            raise BrokerError("sync injected")

        producer = sp._producer
        real = producer._flush

        def swap(f) -> None:
            producer._coalescer, producer._flush = None, f

        sp._thread.loop.call_soon_threadsafe(swap, broken)
        time.sleep(0.05)
        with pytest.raises(BrokerError, match="sync injected"):
            sp.score(traj("q", 3), timeout_s=0)
        sp._thread.loop.call_soon_threadsafe(swap, real)
        time.sleep(0.05)
        with pytest.raises(ResultTimeoutError):
            sp.score(traj("q", 3), timeout_s=0.05)  # its uid was released by the failure

        # close() while threads wait in score() with no timeout: each ends.
        outcomes: list[object] = []

        def one(i: int) -> None:
            try:
                outcomes.append(sp.score(traj("q", i)))
            except BaseException as exc:  # noqa: BLE001
                outcomes.append(exc)

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(10, 40)]
        for th in threads:
            th.start()
        time.sleep(0.5)
        sp.close()
        for th in threads:
            th.join(5)
        assert not any(th.is_alive() for th in threads), "threads still in score() after close()"
        assert len(outcomes) == 30 and all(isinstance(o, BrokerError) for o in outcomes), outcomes[:3]
    finally:
        sp.close()
