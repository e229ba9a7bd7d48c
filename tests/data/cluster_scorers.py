"""Scorers for the cluster tests (loaded by file path into worker processes)."""

import asyncio
import os


async def echo_slow(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """The response read as a number, after extra_info["sleep_s"] seconds: every sample
    has its own known score, so a score that went to the wrong sample shows."""
    await asyncio.sleep((extra_info or {}).get("sleep_s", 0.0))
    return {"score": float(solution_str), "pid": os.getpid()}
