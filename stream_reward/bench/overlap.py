"""``stream-reward bench overlap``: one simulated agent-loop step, scored while it
generates (streaming) and after it (the synchronous baseline), in one invocation.

B trajectories in GRPO groups finish over a long-tailed (lognormal) spread of
generation times. A verifier with a lognormal latency and an RPM quota scores
them, reached through the same worker processes in both modes:

* streaming: each trajectory is pushed the moment it finishes;
* synchronous: nothing is pushed until the last rollout has finished, then all B
  at once (generate all, then score all, with the same verifier and quota).

The verifier is the reference server ``stream_reward.bench.verifier_server`` (its own
process; quota enforced server-side with 429s; latency lognormal from p50/p99;
GSM8K rule scoring), called with ``--scorer http:URL`` and the global Redis
quota (``--max-rpm`` a little under the server's quota). Without that module,
or with ``--verifier simulated``, it is ``compute_score`` below, an async
function the workers load from this file: it paces its requests to the quota
(split evenly over the worker processes) and sleeps a latency drawn by the
bench, so both modes see the same draws.

``ideal_step_s = max(last finish, B / quota rate) + p99 verifier latency``: no
step can end before its last rollout finished or before the quota admitted all
B requests, and the last request still takes a verifier latency.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import random
import subprocess
import sys
import time
from typing import Any

from stream_reward.bench._common import (
    Progress,
    Workers,
    add_torch_threads,
    bench_main,
    bench_parser,
    child_env,
    percentile,
    plot_figure,
    quiet_server,
    save_figure,
    say,
    setup_torch,
    stop_procs,
)

NAMESPACE = "overlap"
QUOTA_KEY = "bench-overlap"
RESPONSE_LEN = 512
Z99 = 2.326347874  # standard normal 99th percentile


def parse(argv: list[str]) -> argparse.Namespace:
    parser = bench_parser("overlap", __doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256, help="trajectories in the step (B)")
    parser.add_argument("--group-size", type=int, default=8, help="GRPO group size")
    parser.add_argument("--generation-s", type=float, default=10.0, help="when the last rollout finishes")
    parser.add_argument(
        "--generation-sigma", type=float, default=0.6, help="lognormal sigma of finish times (the long tail)"
    )
    parser.add_argument("--latency-median-s", type=float, default=0.4, help="verifier latency median")
    parser.add_argument("--latency-p99-s", type=float, default=1.28, help="verifier latency 99th percentile")
    parser.add_argument("--rpm", type=float, default=1800.0, help="verifier quota, requests per minute")
    parser.add_argument("--margin", type=float, default=0.02, help="the workers' limiter runs at quota * (1 - margin)")
    parser.add_argument("--processes", type=int, default=2, help="worker processes (one global quota in Redis)")
    parser.add_argument(
        "--verifier",
        choices=("auto", "server", "simulated"),
        default="auto",
        help="auto: the reference server stream_reward.bench.verifier_server when it is there",
    )
    add_torch_threads(parser)
    args = parser.parse_args(argv)
    if args.verifier == "auto":
        args.verifier = "server" if importlib.util.find_spec("stream_reward.bench.verifier_server") else "simulated"
    return args


def latency_sigma(args: argparse.Namespace) -> float:
    return math.log(args.latency_p99_s / args.latency_median_s) / Z99


# ---------------------------------------------------------------------- the simulated verifier
class Pacer:
    """Admits one request every 1/rate seconds (a quota without bursts)."""

    def __init__(self, rate_per_s: float) -> None:
        self.interval = 1.0 / rate_per_s
        self._next = 0.0

    async def acquire(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        slot = max(now, self._next)
        self._next = slot + self.interval
        if slot > now:
            await asyncio.sleep(slot - now)


_pacers: dict[float, Pacer] = {}


def verdict(solution_str: str, ground_truth: Any) -> float:
    return 1.0 if solution_str.rstrip().endswith(f"#### {ground_truth}") else 0.0


async def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    rate_per_s: float = 30.0,
    **kwargs: Any,
) -> dict[str, Any]:
    """verl-style async compute_score of the simulated verifier (runs in a worker)."""
    pacer = _pacers.get(rate_per_s)
    if pacer is None:  # created lazily, on the worker's own loop
        pacer = _pacers[rate_per_s] = Pacer(rate_per_s)
    await pacer.acquire()
    sent = time.time()
    await asyncio.sleep((extra_info or {}).get("verifier_latency_s", 0.0))
    return {"score": verdict(solution_str, ground_truth), "sent_at": sent}


# ---------------------------------------------------------------------- the verifiers
class ServerVerifier:
    """The reference verifier server in its own process."""

    name = "server"

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""

    def start(self) -> None:
        a = self.args
        argv = [
            sys.executable,
            "-m",
            "stream_reward.bench.verifier_server",
            "--port",
            "0",
            "--rpm",
            str(a.rpm),
            "--latency-ms-p50",
            str(a.latency_median_s * 1000),
            "--latency-ms-p99",
            str(a.latency_p99_s * 1000),
            "--rule",
            "rules",
            "--seed",
            str(a.seed),
        ]
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, env=child_env())
        assert self.proc.stdout is not None
        self.url = self.proc.stdout.readline().strip()
        if not self.url.startswith("http://"):
            self.stop()
            raise RuntimeError(f"verifier server did not start (first line {self.url!r})")

    def worker_args(self) -> list[str]:
        a = self.args
        return ["--scorer", f"http:{self.url}", "--max-rpm", str(a.rpm * (1 - a.margin)), "--quota-key", QUOTA_KEY]

    async def accepted(self, rewards: Any) -> list[float]:
        """Epoch times at which the server accepted a request (status 200)."""
        import aiohttp

        async with aiohttp.ClientSession() as session, session.get(f"{self.url}/stats", params={"log": "1"}) as resp:
            stats = await resp.json()
        self.rejected = stats.get("http_429", 0)
        return [t for t, _path, status in stats["log"] if status == 200]

    def stop(self) -> None:
        if self.proc is not None:
            stop_procs([self.proc])
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self.proc = None


class SimulatedVerifier:
    """``compute_score`` above, run by the workers themselves."""

    name = "simulated"
    rejected = 0

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def start(self) -> None:
        pass

    def worker_args(self) -> list[str]:
        a = self.args
        return [
            "--scorer",
            f"python:{os.path.abspath(__file__)}:compute_score",
            "--reward-kwargs",
            json.dumps({"rate_per_s": a.rpm / 60.0 / a.processes}),
        ]

    async def accepted(self, rewards: Any) -> list[float]:
        return [t for t in rewards.reward_extra_info.get("sent_at", []) if t is not None]

    def stop(self) -> None:
        pass


# ---------------------------------------------------------------------- the step
def make_step(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    raw = [rng.lognormvariate(0.0, args.generation_sigma) for _ in range(args.batch)]
    top = max(raw)
    sigma = latency_sigma(args)
    samples = []
    for i in range(args.batch):
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
        answer = a + b * c
        final = answer if rng.random() < 0.7 else answer + 1
        samples.append(
            {
                "index": i,
                "finish_s": args.generation_s * raw[i] / top,
                "latency_s": rng.lognormvariate(math.log(args.latency_median_s), sigma),
                "response": f"First {b} * {c} = {b * c}. Then {a} + {b * c} = {answer}.\n#### {final}",
                "ground_truth": str(answer),
                "group": f"g{i // args.group_size}",
            }
        )
    return samples


async def run_mode(mode: str, url: str, step: list[dict[str, Any]], verifier: Any, bar: Progress) -> dict[str, Any]:
    from stream_reward.config import ProducerConfig
    from stream_reward.trainer.aggregator import RewardAggregator
    from stream_reward.trainer.producer import RolloutProducer
    from stream_reward.wire.trajectory import Trajectory

    order = sorted(step, key=lambda s: s["finish_s"])
    last_finish = order[-1]["finish_s"]
    pushed_at = [0.0] * len(step)
    landed_at = [0.0] * len(step)
    batch_id = f"{mode}-{int(time.time() * 1000)}"

    def trajectory(s: dict[str, Any]) -> Any:
        return Trajectory(
            batch_id=batch_id,
            index=s["index"],
            data_source="openai/gsm8k",
            response=s["response"],
            ground_truth=s["ground_truth"],
            group=s["group"],
            valid_response_length=24,
            extra_info={"verifier_latency_s": s["latency_s"]},
        )

    async with (
        RolloutProducer(url, ProducerConfig(namespace=NAMESPACE)) as producer,
        RewardAggregator(url, namespace=NAMESPACE) as agg,
    ):
        await producer.open_batch(batch_id, len(step), RESPONSE_LEN)
        start = time.perf_counter()
        wall0 = time.time()

        async def push(ready: list[dict[str, Any]]) -> None:
            await producer.push_many([trajectory(s) for s in ready])
            t = time.perf_counter() - start
            for s in ready:
                pushed_at[s["index"]] = t

        async def rollouts() -> None:
            if mode == "sync":  # generate everything, then hand the whole batch to the reward
                await asyncio.sleep(max(0.0, last_finish - (time.perf_counter() - start)))
                await push(order)
                return
            pos = 0
            while pos < len(order):
                now = time.perf_counter() - start
                ready = []
                while pos < len(order) and order[pos]["finish_s"] <= now:
                    ready.append(order[pos])
                    pos += 1
                if ready:
                    await push(ready)  # everything that finished since the last tick
                if pos < len(order):
                    await asyncio.sleep(max(0.0, order[pos]["finish_s"] - (time.perf_counter() - start)))

        async def landing() -> None:
            async for result in agg.stream(batch_id):
                landed_at[result.index] = time.perf_counter() - start
                bar.advance()

        pusher = asyncio.create_task(rollouts())
        watcher = asyncio.create_task(landing())
        rewards = await agg.collect(batch_id, timeout_s=3600)
        done = time.perf_counter() - start
        await pusher
        await watcher
    accepted = sorted(t - wall0 for t in await verifier.accepted(rewards) if wall0 <= t <= wall0 + done)
    return {
        "step_s": done,
        "last_push_s": max(pushed_at),
        "landed_at": landed_at,
        "accepted_at": accepted,
        "scores": rewards.scores,
        "status": rewards.status_counts(),
    }


async def run(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    setup_torch(args)  # a trainer has torch loaded: keep its import out of what is measured

    step = make_step(args)
    verifier = ServerVerifier(args) if args.verifier == "server" else SimulatedVerifier(args)
    verifier.start()
    try:
        worker_args = [*verifier.worker_args(), "--timeout-s", "3600", "--concurrency", str(max(256, args.batch))]
        with quiet_server() as server, Workers(server.url, NAMESPACE, args.processes, *worker_args) as workers:
            await workers.ready()
            with Progress(args, "overlap: streaming", total=2 * args.batch) as bar:
                streaming = await run_mode("stream", server.url, step, verifier, bar)
                say(args, f"streaming step: {streaming['step_s']:.2f} s")
                bar.update(args.batch, description="overlap: synchronous")
                # Let the quota refill between the modes, so both start from the same state.
                await asyncio.sleep(1.0)
                sync = await run_mode("sync", server.url, step, verifier, bar)
                say(args, f"synchronous step: {sync['step_s']:.2f} s")
    finally:
        verifier.stop()
    last_finish = max(s["finish_s"] for s in step)
    rate = args.rpm / 60.0
    p99 = args.latency_p99_s
    ideal = max(last_finish, args.batch / rate) + p99
    tail = streaming["step_s"] - streaming["last_push_s"]
    result = {
        "batch": args.batch,
        "group_size": args.group_size,
        "stream_step_s": round(streaming["step_s"], 3),
        "sync_step_s": round(sync["step_s"], 3),
        "speedup": round(sync["step_s"] / streaming["step_s"], 3),
        "ideal_step_s": round(ideal, 3),
        "step_over_ideal": round(streaming["step_s"] / ideal, 3),
        "reward_tail_s": round(tail, 3),
        "verifier_p99_s": round(p99, 3),
        "tail_over_p99": round(tail / p99, 3),
        "sync_reward_tail_s": round(sync["step_s"] - sync["last_push_s"], 3),
        "last_finish_s": round(last_finish, 3),
        "quota_bound_s": round(args.batch / rate, 3),
        "rpm": args.rpm,
        "verifier": args.verifier,
        "verifier_latency_p50_s": args.latency_median_s,
        "verifier_http_429": verifier.rejected,
        "processes": args.processes,
        "scored": sum(streaming["status"].values()),
        "ok": streaming["status"].get("ok", 0),
        "scores_match": streaming["scores"] == sync["scores"],
    }
    if args.verifier == "simulated":
        result["verifier_p99_drawn_s"] = round(percentile([s["latency_s"] for s in step], 99), 3)
    return result, {"step": step, "streaming": streaming, "sync": sync}


def plot(path: str, result: dict[str, Any], trace: dict[str, Any]) -> None:
    plt = plot_figure(path)
    fig, axes = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    finishes = sorted(s["finish_s"] for s in trace["step"])
    n = len(finishes)
    for ax, mode, title in (
        (axes[0], "streaming", "streaming: pushed as each rollout finishes"),
        (axes[1], "sync", "synchronous: scored after the last rollout"),
    ):
        data = trace[mode]
        ax.step(finishes, range(1, n + 1), where="post", label="rollouts finished", color="#7f7f7f")
        accepted = data["accepted_at"]
        if accepted:
            ax.step(
                accepted,
                range(1, len(accepted) + 1),
                where="post",
                label="verifier requests accepted",
                color="#ff7f0e",
                alpha=0.8,
            )
        ax.step(sorted(data["landed_at"]), range(1, n + 1), where="post", label="scores landed", color="#1f77b4")
        ax.axvline(data["step_s"], color="#d62728", linestyle="--", label=f"rm_scores ready ({data['step_s']:.2f} s)")
        ax.axvline(
            result["ideal_step_s"], color="#2ca02c", linestyle=":", label=f"ideal ({result['ideal_step_s']:.2f} s)"
        )
        ax.set_ylabel("samples")
        ax.set_title(title, fontsize=10)
        ax.legend(loc="lower right", fontsize=8)
    axes[1].set_xlabel("seconds since the step started")
    fig.suptitle(
        f"overlap: B={result['batch']}, quota {result['rpm']:g} rpm, {result['verifier']} verifier, "
        f"speedup {result['speedup']}x"
    )
    save_figure(fig, path)


def goals(result: dict[str, Any]) -> dict[str, bool]:
    return {
        "step_over_ideal <= 1.05": result["step_over_ideal"] <= 1.05,
        "reward_tail_s <= 1.5 x verifier p99": result["reward_tail_s"] <= 1.5 * result["verifier_p99_s"],
    }


def main(argv: list[str] | None = None) -> int:
    return bench_main("overlap", argv, parse, run, plot, goals)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
