"""Scorers for the cluster tests (loaded by file path into worker processes)."""

import asyncio
import os

# A worker process started with this variable naming a file holds its samples marked
# extra_info["holdable"] while the file exists (at most a minute): a test can keep one
# worker's entries pending until it kills that worker, however slowly it gets there.
HOLD_ENV = "SR_TEST_HOLD_FILE"  # not STREAM_REWARD_*: those are settings


async def echo_slow(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """The response read as a number, after extra_info["sleep_s"] seconds: every sample
    has its own known score, so a score that went to the wrong sample shows."""
    info = extra_info or {}
    hold = os.environ.get(HOLD_ENV)
    if hold and info.get("holdable"):
        for _ in range(6000):
            if not os.path.exists(hold):
                break
            await asyncio.sleep(0.01)
    await asyncio.sleep(info.get("sleep_s", 0.0))
    return {"score": float(solution_str), "pid": os.getpid()}
