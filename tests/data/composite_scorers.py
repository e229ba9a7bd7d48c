"""Component scorers of the composite-reward tests (loaded by file path)."""

import asyncio


async def format_ok(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """1.0 when the response holds an <answer> tag, with the tag count as an extra key."""
    await asyncio.sleep(0)
    count = solution_str.count("<answer>")
    return {"score": 1.0 if count else 0.0, "tags": count}


async def broken(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    raise RuntimeError("the component's backend is down")


async def not_finite(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return float("nan") if solution_str.startswith("nan") else float("inf")


async def no_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return {"verdict": "yes"}


async def broken_later(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    await asyncio.sleep(0.5)
    raise RuntimeError("the component's backend went down mid-sample")


async def ignores_cancel(data_source, solution_str, ground_truth, extra_info=None, hold_s=5.0, **kwargs):
    """Swallows its cancellation and keeps going for ``hold_s`` (a broad except around an await)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + hold_s
    while loop.time() < end:
        try:
            await asyncio.sleep(end - loop.time())
        except asyncio.CancelledError:
            continue
    return 1.0


def sync_not_finite(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """A sync component (it runs in the scorer process pool) whose score is NaN."""
    return float("nan")


def sync_no_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return {"verdict": "yes"}


async def with_undeclared(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """A declared key only on some samples, and one that is never declared."""
    out = {"score": 1.0, "noise": 1}
    if "####" in solution_str:
        out["hit"] = True
    return out


async def key_per_sample(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """A key of its own on every sample (a column per test case, say): keys from the data."""
    return {"score": 1.0, f"case_{solution_str}": 1}
