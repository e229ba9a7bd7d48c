"""Scorers for the fault-injection tests (loaded by file path into worker processes)."""

import asyncio
import os


async def _while_held(info: dict) -> None:
    """Return once the file info["hold"] does not exist (at once without one; at most a
    minute): a test that must kill workers before some samples are scored holds them,
    rather than racing a sleep against how fast a loaded machine starts the next process."""
    hold = info.get("hold")
    for _ in range(6000):
        if not (hold and os.path.exists(hold)):
            break
        await asyncio.sleep(0.01)


async def slow(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Takes extra_info["sleep_s"] seconds (default 0.2), then scores 1.0; kills its process on
    'poison'. While the file extra_info["hold"] exists it does not finish (see _while_held)."""
    if solution_str == "poison":
        os._exit(3)
    info = extra_info or {}
    await _while_held(info)
    await asyncio.sleep(info.get("sleep_s", 0.2))
    return {"score": 1.0, "pid": os.getpid()}


async def logged(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """As ``slow``, and first appends "<tag> <pid>" to the file extra_info["log"]: which
    process scored which sample, however many processes score (small appends are atomic).
    While the file extra_info["hold"] exists it does not finish (see _while_held)."""
    info = extra_info or {}
    with open(info["log"], "a") as f:
        f.write(f"{info['tag']} {os.getpid()}\n")
    await _while_held(info)
    await asyncio.sleep(info.get("sleep_s", 0.2))
    return {"score": 1.0}
