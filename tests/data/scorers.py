"""verl-style compute_score functions used by the tests (loaded by file path)."""

import asyncio
import os
import time


def exact(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """1.0 when the response equals the ground truth; a dict with extra keys for odd indices."""
    score = 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0
    if extra_info and extra_info.get("as_dict"):
        return {"score": score, "acc": score > 0, "len": len(solution_str)}
    return score


def slow_or_hang(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Hangs forever on the response 'hang', dies on 'crash'; otherwise scores 1."""
    if solution_str == "hang":
        while True:
            time.sleep(1)
    if solution_str == "crash":
        os._exit(17)
    if solution_str == "raise":
        raise ValueError("the scorer refused this sample")
    return 1.0


async def async_exact(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    await asyncio.sleep(0.001)
    if solution_str == "hang":
        await asyncio.sleep(3600)
    return {"score": float(solution_str == ground_truth), "echo": kwargs.get("tag")}


def batched(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
    return [float(s == g) for s, g in zip(solution_strs, ground_truths)]
