"""``stream-reward demo``: a simulated rollout step, scored as it streams.

N GSM8K-style problems are "generated" over a long-tailed spread of finish times;
each trajectory is pushed the moment it finishes, worker processes score it
meanwhile, and the aggregator returns rm_scores shortly after the last push.
A second batch of N pushed at once measures the pipeline's throughput.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

from stream_reward.config import DEFAULT_NAMESPACE, ProducerConfig
from stream_reward.trainer.aggregator import RewardAggregator
from stream_reward.trainer.producer import RolloutProducer
from stream_reward.trainer.tensors import import_torch
from stream_reward.wire.trajectory import Trajectory

__all__ = ["DemoReport", "run_demo", "make_gsm8k_sample"]

RESPONSE_LEN = 256


def make_gsm8k_sample(rng: random.Random, batch_id: str, index: int, group_size: int = 8) -> Trajectory:
    """A small arithmetic problem and a response that is right about 70% of the time."""
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
    answer = a + b * c
    roll = rng.random()
    if roll < 0.70:
        final = f"#### {answer:,}" if answer >= 1000 else f"#### {answer}"
    elif roll < 0.90:
        final = f"#### {answer + rng.choice([-10, -1, 1, 7])}"
    else:
        final = f"So the answer is {answer}."  # no '####': strict extraction finds nothing
    response = f"First {b} * {c} = {b * c}. Then {a} + {b * c} = {answer}.\n{final}"
    tokens = len(response.split())
    return Trajectory(
        batch_id=batch_id,
        index=index,
        data_source="openai/gsm8k",
        prompt=f"What is {a} + {b} * {c}?",
        response=response,
        ground_truth=str(answer),
        valid_response_length=min(tokens, RESPONSE_LEN),
        group=f"{batch_id}-g{index // group_size}",
    )


@dataclass
class DemoReport:
    n: int
    status: dict[str, int]
    accuracy: float
    throughput_traj_per_s: float  # a burst of n pushed at once, first push -> rm_scores
    reward_tail_s: float
    generation_s: float
    step_s: float
    rm_scores_shape: list[int]

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


async def run_demo(
    redis_url: str,
    n: int = 2000,
    *,
    namespace: str = DEFAULT_NAMESPACE,
    generation_s: float = 3.0,
    seed: int = 0,
    progress: Any = None,
) -> DemoReport:
    rng = random.Random(seed)
    batch_id = f"demo-{int(time.time() * 1000)}"
    # Samples are made as they "finish", not all up front: making 200,000 takes seconds of
    # CPU in the loop's thread, where a Ctrl-C could not cancel anything until it ended.
    sample_rng = random.Random(seed + 1)
    # Long-tailed generation times (lognormal), scaled so the slowest finishes at generation_s,
    # and the order samples finish in. torch draws them in C: Python's random took 5 s for
    # 2,000,000, in the loop's thread.
    torch = import_torch("the demo")
    gen = torch.Generator().manual_seed(seed)
    raw = torch.empty(n, dtype=torch.float64).log_normal_(0.0, 0.6, generator=gen).sort().values
    finish: list[float] = (raw * (generation_s / float(raw[-1]))).tolist() if n else []
    order: list[int] = torch.randperm(n, generator=gen).tolist()

    start = time.perf_counter()
    last_push = 0.0
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await producer.open_batch(batch_id, n, RESPONSE_LEN)

        async def rollouts() -> None:
            nonlocal last_push
            pos = 0
            while pos < n:
                now = time.perf_counter() - start
                ready: list[Trajectory] = []
                # At most 1,000 a push: a demo running behind its clock still yields, so
                # a Ctrl-C lands between pushes rather than after a backlog of them.
                while pos < n and finish[pos] <= now and len(ready) < 1000:
                    ready.append(make_gsm8k_sample(sample_rng, batch_id, order[pos]))
                    pos += 1
                if ready:
                    await producer.push_many(ready)  # everything that finished since the last tick
                if pos < n:
                    await asyncio.sleep(max(0.0, min(0.005, finish[pos] - now)))
            last_push = time.perf_counter()

        async def landing() -> None:
            if progress is None:
                return
            async for _ in agg.stream(batch_id):
                progress()

        pusher = asyncio.create_task(rollouts())
        watcher = asyncio.create_task(landing())
        try:
            rewards = await agg.collect(batch_id, timeout_s=120)
            done = time.perf_counter()
            await pusher
        finally:
            # Interrupted (Ctrl-C) or failed: stop both before the clients close under
            # them, and take their errors here rather than as "never retrieved" noise.
            for task in (pusher, watcher):
                task.cancel()
            await asyncio.gather(pusher, watcher, return_exceptions=True)
        # Then the pipeline's capacity: the same number of trajectories pushed at
        # once, timed from the first push to rm_scores.
        burst_id = f"{batch_id}-burst"
        burst: list[Trajectory] = []
        for pos in range(0, n, 1000):  # made before the clock starts, a Ctrl-C apart
            burst.extend(make_gsm8k_sample(rng, burst_id, i) for i in range(pos, min(n, pos + 1000)))
            await asyncio.sleep(0)
        burst_start = time.perf_counter()
        await producer.open_batch(burst_id, n, RESPONSE_LEN)
        for pos in range(0, n, 1000):
            await producer.push_many(burst[pos : pos + 1000])
        await agg.collect(burst_id, timeout_s=120)
        burst_s = time.perf_counter() - burst_start
    ok_scores = [s for s, st in zip(rewards.scores, rewards.status) if st == "ok"]
    return DemoReport(
        n=rewards.n,
        status=rewards.status_counts(),
        accuracy=sum(1 for s in ok_scores if s > 0) / max(1, len(ok_scores)),
        throughput_traj_per_s=n / burst_s,
        reward_tail_s=done - last_push,
        generation_s=last_push - start,
        step_s=done - start,
        rm_scores_shape=list(rewards.rm_scores.shape),
    )
