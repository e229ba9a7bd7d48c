"""``stream-reward bench latency``: push -> result latency at a fixed offered rate.

A producer pushes GSM8K trajectories on a fixed schedule (``--rate`` per second,
in small pushes every millisecond or so, as rollouts would finish); worker
processes score them with the rule scorers; ``RewardAggregator.stream()`` in the
same process records when each result lands. A sample's latency is its landing
time minus the moment its push started. The first ``--warmup-s`` are not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from typing import Any

from stream_reward.bench._common import (
    GcWatch,
    Progress,
    Workers,
    add_torch_threads,
    bench_main,
    bench_parser,
    gsm8k_pool,
    percentile,
    plot_figure,
    quiet_server,
    save_figure,
    setup_torch,
)

NAMESPACE = "latency"
RESPONSE_LEN = 512


def parse(argv: list[str]) -> argparse.Namespace:
    parser = bench_parser("latency", __doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=5000.0, help="offered trajectories per second")
    parser.add_argument("--duration-s", type=float, default=20.0, help="measured seconds (after the warm-up)")
    parser.add_argument("--warmup-s", type=float, default=1.0, help="seconds pushed but not counted")
    parser.add_argument("--bytes", type=int, default=512, help="approximate response size")
    parser.add_argument("--processes", type=int, default=2, help="worker processes")
    add_torch_threads(parser)
    return parser.parse_args(argv)


async def run(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    setup_torch(args)  # a trainer has torch loaded: keep its import out of what is measured

    from stream_reward.config import ProducerConfig
    from stream_reward.trainer.aggregator import RewardAggregator
    from stream_reward.trainer.producer import RolloutProducer
    from stream_reward.wire.trajectory import Trajectory

    pool = gsm8k_pool(random.Random(args.seed), 1024, args.bytes)
    total_s = args.warmup_s + args.duration_s
    n = int(args.rate * total_s)
    pushed_at = [0.0] * n
    landed_at = [0.0] * n
    batch_id = "latency"
    with quiet_server() as server, Workers(server.url, NAMESPACE, args.processes, "--scorer", "rules") as workers:
        await workers.ready()
        async with (
            RolloutProducer(server.url, ProducerConfig(namespace=NAMESPACE)) as producer,
            RewardAggregator(server.url, namespace=NAMESPACE) as agg,
        ):
            await producer.open_batch(batch_id, n, RESPONSE_LEN)
            start = time.perf_counter()

            async def produce() -> None:
                sent = 0
                while sent < n:
                    now = time.perf_counter()
                    due = min(n, int((now - start) * args.rate) + 1)
                    if due > sent:
                        chunk = [
                            Trajectory(
                                batch_id=batch_id,
                                index=i,
                                data_source="openai/gsm8k",
                                response=pool[i % 1024]["response"],
                                ground_truth=pool[i % 1024]["ground_truth"],
                                valid_response_length=pool[i % 1024]["valid_response_length"],
                            )
                            for i in range(sent, due)
                        ]
                        t = time.perf_counter()
                        await producer.push_many(chunk)
                        for i in range(sent, due):
                            pushed_at[i] = t
                        sent = due
                    # Sleep until the next sample is due (the loop's timer resolution is ~1 ms).
                    await asyncio.sleep(max(0.0, start + sent / args.rate - time.perf_counter()))

            async def land(bar: Progress) -> None:
                async for result in agg.stream(batch_id, timeout_s=total_s + 120):
                    landed_at[result.index] = time.perf_counter()
                    bar.advance()

            with Progress(args, f"latency at {args.rate:,.0f}/s", total=n) as bar, GcWatch() as gcw:
                await asyncio.gather(produce(), land(bar))
    counted = [i for i in range(n) if pushed_at[i] - start >= args.warmup_s]
    landed = [i for i in counted if landed_at[i] > 0]
    lat_ms = [(landed_at[i] - pushed_at[i]) * 1000 for i in landed]
    window = (max(landed_at[i] for i in landed) - min(pushed_at[i] for i in landed)) if landed else float("nan")
    result = {
        "p50_ms": round(percentile(lat_ms, 50), 3),
        "p90_ms": round(percentile(lat_ms, 90), 3),
        "p99_ms": round(percentile(lat_ms, 99), 3),
        "max_ms": round(max(lat_ms), 3) if lat_ms else None,
        "offered_per_s": args.rate,
        "achieved_per_s": round(len(landed) / window, 1) if landed else 0.0,
        "duration_s": args.duration_s,
        "samples": len(counted),
        "landed": len(landed),
        "processes": args.processes,
        "payload_bytes": args.bytes,
        **{f"main_{k}": v for k, v in gcw.summary().items()},
    }
    trace = {"t": [pushed_at[i] - start for i in landed], "lat_ms": lat_ms}
    return result, trace


def plot(path: str, result: dict[str, Any], trace: dict[str, Any]) -> None:
    plt = plot_figure(path)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    ax1.plot(trace["t"], trace["lat_ms"], ",", alpha=0.5)
    ax1.set_xlabel("push time (s)")
    ax1.set_ylabel("push -> result latency (ms)")
    ax1.set_yscale("log")
    ax1.set_title(f"offered {result['offered_per_s']:,.0f}/s, achieved {result['achieved_per_s']:,.0f}/s")
    ax2.hist(trace["lat_ms"], bins=100, log=True)
    for q, style in (("p50_ms", "--"), ("p99_ms", ":")):
        ax2.axvline(result[q], color="red", linestyle=style, label=f"{q[:-3]} {result[q]:.1f} ms")
    ax2.set_xlabel("latency (ms)")
    ax2.legend()
    save_figure(fig, path)


def goals(result: dict[str, Any]) -> dict[str, bool]:
    return {
        "p50 <= 5 ms": result["p50_ms"] <= 5.0,
        "p99 <= 20 ms": result["p99_ms"] <= 20.0,
        "every sample landed": result["landed"] == result["samples"],
    }


def main(argv: list[str] | None = None) -> int:
    return bench_main("latency", argv, parse, run, plot, goals)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
