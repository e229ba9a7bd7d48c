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


def prefix_match(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """The fraction of the ground truth the response matches from the start; a dict
    (with "acc" and "pred") for data_source "dict", a bare float otherwise."""
    truth = str(ground_truth)
    k = 0
    while k < min(len(truth), len(solution_str)) and truth[k] == solution_str[k]:
        k += 1
    score = k / len(truth) if truth else float(solution_str == "")
    if data_source == "dict":
        return {"score": score, "acc": k == len(truth) == len(solution_str), "pred": solution_str}
    return score


def batched_mixed(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
    """Batched prefix_match, plus the batch size and reward kwargs each sample saw."""
    out = []
    for ds, s, g, x in zip(data_sources, solution_strs, ground_truths, extra_infos):
        value = prefix_match(ds, s, g, x)
        if isinstance(value, dict):
            value["batch_len"] = len(solution_strs)
            value["tag"] = kwargs.get("tag")
        out.append(value)
    return out


async def async_batched(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
    await asyncio.sleep(0.001)
    return [{"score": float(s == g), "batch_len": len(solution_strs)} for s, g in zip(solution_strs, ground_truths)]


async def timed(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Sleeps ``extra_info["sleep_s"]`` (default 0.1 s) and reports when it ran, in which process."""
    start = time.time()
    await asyncio.sleep((extra_info or {}).get("sleep_s", 0.1))
    return {"score": 1.0, "start": start, "end": time.time(), "pid": os.getpid()}


async def rate_limited_then_ok(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Asks to be retried (as a 429 would) until ``extra_info["marker"]`` file holds N attempts."""
    from stream_reward.errors import RetryLater

    path = extra_info["marker"]
    with open(path, "a") as f:
        f.write("x")
    with open(path) as f:
        attempts = len(f.read())
    if attempts < extra_info.get("fail_times", 2):
        raise RetryLater("busy", retry_after_s=0.05, rate_limited=True)
    return {"score": 1.0, "attempts_seen": attempts}


def exact_manager(config):
    """A user manager loaded by import path: ManagerConfig -> Scorer (inline exact match)."""
    from stream_reward.scoring.scorer import Scored

    class Exact:
        inline = True

        async def score(self, traj):
            return Scored(float(traj.response == traj.ground_truth))

    return Exact()
