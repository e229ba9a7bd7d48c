"""``stream-reward bench memory``: one worker process fed many small trajectories.

Memory must not grow with the number of trajectories scored: the worker's RSS
at the end should be what it was at 10% of the run, and the server's memory
should stay bounded by what the producer may have outstanding (``max_backlog``
entries not yet read, plus those in flight and those acked but not yet trimmed),
not by the total pushed. Batches are collected as they complete, as a trainer
would, with a short ``collected_ttl_s`` so collected results leave the server.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from typing import Any

from stream_reward.bench._common import (
    Progress,
    Workers,
    add_torch_threads,
    bench_main,
    bench_parser,
    gsm8k_pool,
    plot_figure,
    quiet_server,
    rss_bytes,
    save_figure,
    setup_torch,
)

NAMESPACE = "memory"
RESPONSE_LEN = 256


def parse(argv: list[str]) -> argparse.Namespace:
    parser = bench_parser("memory", __doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000, help="trajectories pushed")
    parser.add_argument("--bytes", type=int, default=200, help="approximate response size (small)")
    parser.add_argument("--batch-size", type=int, default=10_000, help="trajectories per collected batch")
    parser.add_argument("--max-backlog", type=int, default=20_000, help="producer max_backlog (entries not yet read)")
    parser.add_argument("--collected-ttl-s", type=int, default=2, help="aggregator collected_ttl_s")
    parser.add_argument("--sample-s", type=float, default=0.25, help="sampling interval")
    add_torch_threads(parser)
    return parser.parse_args(argv)


async def run(args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    setup_torch(args)  # a trainer has torch loaded: keep its import out of what is measured

    from stream_reward.config import ProducerConfig
    from stream_reward.trainer.aggregator import RewardAggregator
    from stream_reward.trainer.producer import RolloutProducer
    from stream_reward.wire.codec import encode_result, encode_trajectory
    from stream_reward.wire.connection import connect
    from stream_reward.wire.keys import Keys
    from stream_reward.wire.trajectory import ScoreResult, Trajectory

    pool = gsm8k_pool(random.Random(args.seed), 1024, args.bytes)
    n = args.n
    batches = [(f"m{k}", min(args.batch_size, n - lo)) for k, lo in enumerate(range(0, n, args.batch_size))]
    keys = Keys(NAMESPACE)
    samples: list[dict[str, Any]] = []
    collected = 0
    with quiet_server() as server, Workers(server.url, NAMESPACE, 1, "--scorer", "rules") as workers:
        await workers.ready()
        pid = workers.pids[0]
        monitor = connect(server.url)
        used_start = int((await monitor.info("memory"))["used_memory"])
        opened = {bid: asyncio.Event() for bid, _ in batches}
        start = time.perf_counter()
        async with (
            RolloutProducer(server.url, ProducerConfig(namespace=NAMESPACE, max_backlog=args.max_backlog)) as producer,
            RewardAggregator(server.url, namespace=NAMESPACE, collected_ttl_s=args.collected_ttl_s) as agg,
        ):

            async def produce() -> None:
                for bid, size in batches:
                    await producer.open_batch(bid, size, RESPONSE_LEN)
                    opened[bid].set()
                    for lo in range(0, size, 500):
                        await producer.push_many(
                            [
                                Trajectory(
                                    batch_id=bid,
                                    index=i,
                                    data_source="openai/gsm8k",
                                    response=pool[i % 1024]["response"],
                                    ground_truth=pool[i % 1024]["ground_truth"],
                                    valid_response_length=pool[i % 1024]["valid_response_length"],
                                )
                                for i in range(lo, min(size, lo + 500))
                            ]
                        )

            async def collect(bar: Progress) -> None:
                nonlocal collected
                for bid, _ in batches:
                    await opened[bid].wait()
                    rewards = await agg.collect(bid, timeout_s=600)
                    collected += rewards.n
                    bar.advance(rewards.n)

            async def sample() -> None:
                while True:
                    info = await monitor.info("memory")
                    samples.append(
                        {
                            "t": time.perf_counter() - start,
                            "collected": collected,
                            "worker_rss": rss_bytes(pid),
                            "used_memory": int(info["used_memory"]),
                            "stream_len": int(await monitor.xlen(keys.stream())),
                        }
                    )
                    await asyncio.sleep(args.sample_s)

            with Progress(args, "memory", total=n) as bar:
                sampler = asyncio.create_task(sample())
                await asyncio.gather(produce(), collect(bar))
                sampler.cancel()
        elapsed = time.perf_counter() - start
        rss_end = rss_bytes(pid)
        used_end = int((await monitor.info("memory"))["used_memory"])
        await monitor.aclose()
    # RSS at 10%: the first sample taken once a tenth of the trajectories were collected.
    at10 = next((s for s in samples if s["collected"] >= n // 10), samples[0] if samples else None)
    rss_10 = at10["worker_rss"] if at10 else rss_end
    peak = max((s["used_memory"] for s in samples), default=used_end)
    entry_bytes = len(
        encode_trajectory(
            Trajectory(
                batch_id="m0",
                index=0,
                data_source="openai/gsm8k",
                response=pool[0]["response"],
                ground_truth=pool[0]["ground_truth"],
                valid_response_length=1,
            )
        )
    )
    result_bytes = len(
        encode_result(ScoreResult("m0/0", "m0", 0, 1.0, valid_response_length=1, data_source="openai/gsm8k"))
    )
    # What may be outstanding on the server, each item at its payload plus ~64 bytes
    # of stream / hash overhead:
    # * trajectories: max_backlog unread + what the worker holds (its concurrency)
    #   + what it acked since its last trim (it trims every 2 s);
    # * results (stored twice: the write-once hash and the done stream): the batch
    #   being collected, the next one filling, and those collected within the last
    #   collected_ttl_s (+1 s for the server's active expiry to get to them).
    rate = n / elapsed
    outstanding = args.max_backlog + 256 + int(rate * 2.0)
    results_held = 2 * args.batch_size + int(rate * (args.collected_ttl_s + 1))
    bound = used_start + outstanding * (entry_bytes + 64) + results_held * 2 * (result_bytes + 64)
    result = {
        "n": n,
        "traj_per_s": round(rate, 1),
        "worker_rss_10pct_bytes": rss_10,
        "worker_rss_end_bytes": rss_end,
        "rss_growth": round(rss_end / rss_10, 4) if rss_10 else None,
        "server_used_memory_start_bytes": used_start,
        "server_used_memory_peak_bytes": peak,
        "server_used_memory_end_bytes": used_end,
        "server_bound_bytes": bound,
        "server_peak_over_bound": round(peak / bound, 3),
        "stream_len_peak": max((s["stream_len"] for s in samples), default=0),
        "max_backlog": args.max_backlog,
        "entry_payload_bytes": entry_bytes,
        "result_payload_bytes": result_bytes,
        "collected": collected,
    }
    return result, samples


def plot(path: str, result: dict[str, Any], samples: list[dict[str, Any]]) -> None:
    plt = plot_figure(path)
    fig, ax1 = plt.subplots(figsize=(8, 4.5))
    t = [s["t"] for s in samples]
    ax1.plot(t, [s["worker_rss"] / 2**20 for s in samples], label="worker RSS (MiB)", color="#1f77b4")
    ax1.plot(t, [s["used_memory"] / 2**20 for s in samples], label="server used_memory (MiB)", color="#ff7f0e")
    ax1.axhline(result["server_bound_bytes"] / 2**20, color="#ff7f0e", linestyle=":", label="server bound")
    ax1.set_xlabel("seconds")
    ax1.set_ylabel("MiB")
    ax1.set_ylim(bottom=0)
    ax2 = ax1.twinx()
    ax2.plot(t, [s["collected"] for s in samples], color="#7f7f7f", alpha=0.5, label="collected")
    ax2.set_ylabel("trajectories collected")
    lines = ax1.get_legend_handles_labels()
    extra = ax2.get_legend_handles_labels()
    ax1.legend(lines[0] + extra[0], lines[1] + extra[1], loc="upper left", fontsize=8)
    ax1.set_title(f"memory: {result['n']:,} trajectories, rss_growth {result['rss_growth']}")
    save_figure(fig, path)


def goals(result: dict[str, Any]) -> dict[str, bool]:
    return {
        "rss_growth <= 1.10": result["rss_growth"] is not None and result["rss_growth"] <= 1.10,
        "server memory within the backlog bound": result["server_used_memory_peak_bytes"]
        <= result["server_bound_bytes"],
        "every trajectory collected": result["collected"] == result["n"],
    }


def main(argv: list[str] | None = None) -> int:
    return bench_main("memory", argv, parse, run, plot, goals)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
