"""``stream-reward bench gateway``: OpenRLHF-format samples per second through the HTTP
gateway, against the ``score`` command's path on the same samples, the same server and
the same workers, in the same run: read the samples' JSONL dump, produce it as one
batch, collect it, write one JSON line per sample (what ``stream-reward score FILE
--out OUT`` does once its process is up; neither side's process start is counted).

The gateway runs as its own process (``stream-reward gateway --redis URL --processes
0``), as it is deployed; this process is the trainer side: it sends ``--n`` samples as
requests of ``--request-size`` samples, ``--concurrency`` at once, in OpenRLHF's wire
format (``query`` = prompt + response; encoding them and reading the replies is
counted, as an OpenRLHF client pays it), and checks every reply. Runs alternate
(score, gateway, ...) ``--repeats`` times; the medians are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from stream_reward.bench._common import (
    add_torch_threads,
    bench_main,
    bench_parser,
    gsm8k_pool,
    quiet_server,
    say,
    setup_torch,
    stop_procs,
)

NAMESPACE = "bench-gateway"
DATA_SOURCE = "openai/gsm8k"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = bench_parser("gateway", __doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16384, help="samples per run (default: 16384)")
    parser.add_argument("--request-size", type=int, default=256, help="samples per request (default: 256)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight (default: 16)")
    parser.add_argument("--processes", type=int, default=2, help="worker processes (default: 2)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each side (default: 3)")
    parser.add_argument("--response-bytes", type=int, default=1024, help="response length (default: 1024)")
    add_torch_threads(parser)
    return parser.parse_args(argv)


def _start_gateway(url: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "stream_reward.cli", "gateway", "--redis", url, "--namespace", NAMESPACE]
        + ["--processes", "0", "--port", "0", "--data-source", DATA_SOURCE],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    base = proc.stdout.readline().strip()
    if not base.startswith("http"):
        stop_procs([proc])
        proc.stdout.close()
        raise SystemExit(f"bench gateway: the gateway did not start (first line {base!r})")
    return proc, base


async def _score_side(url: str, pool: list[dict[str, Any]], n: int, run: int, workdir: str) -> tuple[float, int]:
    """What ``stream-reward score FILE --out OUT`` does once its process is up (its start
    and torch's import are not counted, as the gateway's are not): read the JSONL dump,
    produce it as one batch, collect it, write one JSON line per sample. (seconds, ok)."""
    import json
    import os

    from stream_reward.config import ProducerConfig
    from stream_reward.trainer.aggregator import RewardAggregator
    from stream_reward.trainer.rollouts import produce_rollouts, read_rollouts, result_rows

    batch = f"score-{run}-{time.time_ns()}"
    dump, out = os.path.join(workdir, f"{batch}.jsonl"), os.path.join(workdir, f"{batch}.out.jsonl")
    with open(dump, "w", encoding="utf-8") as handle:
        for i in range(n):
            row = pool[i % len(pool)]
            line = {"data_source": DATA_SOURCE, "response": row["response"], "ground_truth": row["ground_truth"]}
            handle.write(json.dumps({**line, "prompt": row["prompt"]}) + "\n")
    started = time.perf_counter()
    rollouts = read_rollouts(dump, batch)
    await produce_rollouts(url, rollouts, 1, ProducerConfig(namespace=NAMESPACE))
    async with RewardAggregator(url, namespace=NAMESPACE) as agg:
        rewards = await agg.collect(batch, timeout_s=600)
    with open(out, "w", encoding="utf-8") as handle:
        for result in result_rows(rewards):
            handle.write(json.dumps(result, default=repr) + "\n")
    seconds = time.perf_counter() - started
    os.unlink(dump)
    os.unlink(out)
    return seconds, rewards.status.count("ok")


async def _bare_side(url: str, pool: list[dict[str, Any]], n: int, run: int) -> tuple[float, int]:
    """The pipeline alone: trajectories built in memory, produced as one batch, collected;
    no file, no HTTP, no JSON. What the gateway adds shows against this. (seconds, ok)."""
    from stream_reward.config import ProducerConfig
    from stream_reward.trainer.aggregator import RewardAggregator
    from stream_reward.trainer.rollouts import Rollouts, produce_rollouts
    from stream_reward.wire.trajectory import Trajectory

    batch = f"bare-{run}-{time.time_ns()}"
    rows = [pool[i % len(pool)] for i in range(n)]
    trajs = [
        Trajectory(batch, i, DATA_SOURCE, response=r["response"], ground_truth=r["ground_truth"], prompt=r["prompt"])
        for i, r in enumerate(rows)
    ]
    started = time.perf_counter()
    await produce_rollouts(url, Rollouts(batch, trajs, {}), 1, ProducerConfig(namespace=NAMESPACE))
    async with RewardAggregator(url, namespace=NAMESPACE) as agg:
        rewards = await agg.collect(batch, timeout_s=600)
    return time.perf_counter() - started, rewards.status.count("ok")


async def _gateway_side(base: str, pool: list[dict[str, Any]], args: argparse.Namespace) -> tuple[float, int]:
    """OpenRLHF-format requests through the gateway. (seconds, samples answered 200)."""
    import aiohttp

    bodies = []
    for start in range(0, args.n, args.request_size):
        rows = [pool[i % len(pool)] for i in range(start, min(args.n, start + args.request_size))]
        prompts = [r["prompt"] for r in rows]
        bodies.append(
            {
                "query": [r["prompt"] + r["response"] for r in rows],
                "prompts": prompts,
                "labels": [r["ground_truth"] for r in rows],
            }
        )
    slots = asyncio.Semaphore(args.concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def send(body: dict[str, Any]) -> int:
            async with slots, session.post(f"{base}/openrlhf", json=body) as resp:
                reply = await resp.json()
                return len(reply["rewards"]) if resp.status == 200 else 0

        started = time.perf_counter()
        answered = await asyncio.gather(*(send(b) for b in bodies))
        return time.perf_counter() - started, sum(answered)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from stream_reward.ops.pipeline import LocalPipeline

    setup_torch(args)  # the trainer side has torch loaded: its import is no part of either side's time
    pool = gsm8k_pool(random.Random(args.seed), 1024, args.response_bytes)
    score_rates: list[float] = []
    gateway_rates: list[float] = []
    bare_rates: list[float] = []
    all_ok = True
    with quiet_server() as server, tempfile.TemporaryDirectory(prefix="bench-gateway-") as workdir:
        with LocalPipeline(
            server.url, processes=args.processes, namespace=NAMESPACE, worker_args=["--scorer", "rules"]
        ):
            gateway, base = _start_gateway(server.url)
            try:
                # A warm-up of each side: the workers' imports and each side's first batch are not the steady state.
                await _gateway_side(base, pool, argparse.Namespace(**{**vars(args), "n": min(args.n, 64)}))
                await _score_side(server.url, pool, min(args.n, 64), -1, workdir)
                for run_no in range(args.repeats):
                    seconds, ok = await _score_side(server.url, pool, args.n, run_no, workdir)
                    score_rates.append(args.n / seconds)
                    all_ok = all_ok and ok == args.n
                    say(args, f"score:   {args.n / seconds:,.0f} samples/s")
                    seconds, ok = await _bare_side(server.url, pool, args.n, run_no)
                    bare_rates.append(args.n / seconds)
                    all_ok = all_ok and ok == args.n
                    say(args, f"bare:    {args.n / seconds:,.0f} samples/s")
                    seconds, answered = await _gateway_side(base, pool, args)
                    gateway_rates.append(args.n / seconds)
                    all_ok = all_ok and answered == args.n
                    say(args, f"gateway: {args.n / seconds:,.0f} samples/s")
            finally:
                stop_procs([gateway])
                if gateway.stdout is not None:
                    gateway.stdout.close()
    score_rate, gateway_rate = statistics.median(score_rates), statistics.median(gateway_rates)
    return {
        "n": args.n,
        "request_size": args.request_size,
        "concurrency": args.concurrency,
        "processes": args.processes,
        "gateway_samples_per_s": round(gateway_rate, 1),
        "score_samples_per_s": round(score_rate, 1),
        "ratio": round(gateway_rate / score_rate, 3),
        # Against the pipeline alone (no file, HTTP or JSON on either end): the gateway's own cost.
        "bare_samples_per_s": round(statistics.median(bare_rates), 1),
        "ratio_vs_bare": round(gateway_rate / statistics.median(bare_rates), 3),
        "runs_gateway_samples_per_s": [round(r, 1) for r in gateway_rates],
        "runs_score_samples_per_s": [round(r, 1) for r in score_rates],
        "runs_bare_samples_per_s": [round(r, 1) for r in bare_rates],
        "all_answered": all_ok,
    }


def _plot(path: str, result: dict[str, Any]) -> None:
    from stream_reward.bench._common import plot_figure, save_figure

    plt = plot_figure(path)
    fig, ax = plt.subplots()
    ax.bar(["score", "gateway"], [result["score_samples_per_s"], result["gateway_samples_per_s"]])
    ax.set_ylabel("samples/s")
    ax.set_title(f"gateway / score = {result['ratio']:.2f}")
    save_figure(fig, path)


def _goals(result: dict[str, Any]) -> dict[str, bool]:
    return {"ratio >= 0.8": result["ratio"] >= 0.8, "every sample answered": bool(result["all_answered"])}


def main(argv: list[str] | None = None) -> int:
    return bench_main("gateway", argv, parse, run, _plot, _goals)
