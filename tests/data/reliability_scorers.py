"""Scorers for the fault-injection tests (loaded by file path into worker processes)."""

import asyncio
import os


async def slow(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Takes extra_info["sleep_s"] seconds (default 0.2), then scores 1.0; kills its process on 'poison'."""
    if solution_str == "poison":
        os._exit(3)
    await asyncio.sleep((extra_info or {}).get("sleep_s", 0.2))
    return {"score": 1.0, "pid": os.getpid()}


async def logged(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """As ``slow``, and first appends "<tag> <pid>" to the file extra_info["log"]: which
    process scored which sample, however many processes score (small appends are atomic).
    While the file extra_info["hold"] exists (at most a minute) it does not finish: a test
    that must kill workers before any sample is scored holds them, rather than racing a
    sleep against how fast a loaded machine starts the next process."""
    info = extra_info or {}
    with open(info["log"], "a") as f:
        f.write(f"{info['tag']} {os.getpid()}\n")
    hold = info.get("hold")
    for _ in range(6000):
        if not (hold and os.path.exists(hold)):
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(info.get("sleep_s", 0.2))
    return {"score": 1.0}
