"""The scorer of `bench faults`: exact match, with a little jitter so that kills
land while samples are in flight."""

import asyncio
import random


async def jittery(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    await asyncio.sleep(random.uniform(0.0, 0.04))
    return float(solution_str == ground_truth)
