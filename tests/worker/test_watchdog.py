"""The loop watchdog: an async scorer that blocks the event loop is named, with its sample,
and the sample's timeout still fires.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import read_err, sleepy_batch, timed_wait, undelivered_samples, wait_until, worker_program_argv

from stream_reward import ProducerConfig, RewardAggregator, RolloutProducer
from stream_reward.wire.keys import Keys

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]

BLOCKING = "python:tests/data/failwell_scorers.py:blocking"


async def test_async_scorer_blocking_the_loop_is_named_and_its_timeout_fires(redis_url, namespace):
    proc = subprocess.Popen(
        worker_program_argv(redis_url, namespace, "--scorer", BLOCKING, "--timeout-s", "1", "--concurrency", "1"),
        cwd=ROOT,
        stderr=subprocess.PIPE,
    )
    try:
        async with (
            RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await producer.open_batch("block", 1, 4)
            await producer.push_many(sleepy_batch("block", 1, 30.0))

            async def delivered() -> bool:
                return await undelivered_samples(producer.client, Keys(namespace)) == 0

            # Timed from the delivery, not the push: the worker's start (5 s and more of
            # imports on a loaded machine) is no part of the 1 s timeout under test.
            await wait_until(delivered, timeout_s=30)
            started = time.monotonic()
            rewards = await agg.collect("block", timeout_s=25)
            took = time.monotonic() - started
    finally:
        proc.send_signal(signal.SIGTERM)
        timed_wait(proc, 20)
    stderr = read_err(proc)
    assert rewards.status == ["failed"] and took < 10, (rewards.status, took)
    assert "blocking" in stderr and "block" in stderr and "event loop" in stderr, stderr
    assert "on sample 'block/0' (batch 'block', index 0)" in stderr, stderr  # the sample is named
