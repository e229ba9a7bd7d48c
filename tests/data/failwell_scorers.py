"""Scorers for the failing-well tests (loaded by file path into worker processes)."""

import asyncio
import time


async def slow(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Takes extra_info["sleep_s"] seconds (default 0.2), then scores 1.0."""
    await asyncio.sleep((extra_info or {}).get("sleep_s", 0.2))
    return 1.0


async def blocking(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """An async scorer that wrongly blocks the event loop for extra_info["sleep_s"] seconds."""
    time.sleep((extra_info or {}).get("sleep_s", 5.0))  # noqa: ASYNC251  (the fault under test)
    return 1.0
