"""``stream-reward bench scale``: throughput with 1, 2 and 4 worker processes, against
a single Redis node and against a local 3-master Redis Cluster, in one run.

Each configuration is a fresh server (or cluster) and fresh worker processes;
one process produces and collects, as a trainer would: RolloutProducer ->
worker processes -> RewardAggregator.collect, batches of ``--batch-size`` in
GRPO groups of 8. ``--producers`` processes push (one alone would cap every
row near 20k traj/s), this process collects every batch, timed from the
producers' start to the last ``rm_scores``. The single node listens on TCP
loopback like the cluster nodes, so the two differ by the cluster, not by the
transport; it runs the namespace unpartitioned (the default), the cluster with
one partition per master unless told otherwise.

Besides traj/s, every row carries the CPU seconds each side spent, and the run
ends with the CPU cost of one trajectory — in the workers, in Redis, in the
producer + aggregator — which is what sizing a deployment needs (see
docs/scaling.md). On a machine with fewer cores than processes the rows
measure the contention as much as the pipeline: ``cores`` says how many there
were.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from stream_reward.bench._common import (
    Progress,
    Workers,
    bench_main,
    bench_parser,
    child_env,
    cpu_seconds,
    gsm8k_pool,
    payload_bytes,
    plot_figure,
    save_figure,
    say,
    stop_procs,
)

NAMESPACE = "scale"
RESPONSE_LEN = 1024
POOL = 1024
GROUP_SIZE = 8


def parse(argv: list[str]) -> argparse.Namespace:
    parser = bench_parser("scale", __doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=60_000, help="trajectories per configuration")
    parser.add_argument("--processes", default="1,2,4", help="worker process counts, comma-separated")
    parser.add_argument("--redis", default="single,cluster3", help="single, cluster3 or both, comma-separated")
    parser.add_argument(
        "--partitions",
        type=int,
        default=None,
        help="partitions of the namespace on the cluster (default: 3, one per master)",
    )
    parser.add_argument(
        "--single-partitions", type=int, default=1, help="partitions of the namespace on the single node"
    )
    parser.add_argument("--bytes", type=int, default=2048, help="approximate response size of a trajectory")
    parser.add_argument("--batch-size", type=int, default=4096, help="trajectories per trainer batch (collect() each)")
    parser.add_argument("--push-chunk", type=int, default=256, help="trajectories per pipelined push")
    parser.add_argument(
        "--producers",
        type=int,
        default=None,
        help="producer processes (default: 2 on 8 cores or more, else 1; one alone tops out "
        "near 20-30k traj/s and caps every row)",
    )
    parser.add_argument("--scorer", default="rules", help="worker --scorer spec")
    parser.add_argument("--concurrency", type=int, default=None, help="worker --concurrency")
    args = parser.parse_args(argv)
    if args.producers is None:
        args.producers = 2 if len(os.sched_getaffinity(0)) >= 8 else 1
    return args


@contextlib.contextmanager
def redis_under_test(kind: str) -> Iterator[tuple[str, list[int]]]:
    """(url, server pids) of a fresh single node or 3-master cluster on loopback."""
    if kind == "single":
        from stream_reward.ops.cluster import _free_ports
        from stream_reward.ops.embedded import EmbeddedServer

        (port,) = _free_ports(1, random.Random())
        with EmbeddedServer(extra_args=["--port", str(port), "--bind", "127.0.0.1"]) as server:
            yield f"redis://127.0.0.1:{port}", [server.pid or 0]
    elif kind == "cluster3":
        from stream_reward.ops.cluster import LocalCluster

        with LocalCluster(masters=3) as cluster:
            yield cluster.url, cluster.pids
    else:
        raise SystemExit(f"unknown --redis kind {kind!r}: single or cluster3")


async def run_one(
    args: argparse.Namespace, kind: str, processes: int, partitions: int, bar: Progress
) -> dict[str, Any]:
    from stream_reward.config import ProducerConfig
    from stream_reward.trainer.aggregator import RewardAggregator
    from stream_reward.trainer.producer import RolloutProducer

    n = args.n
    batches = [(f"b{k}", min(args.batch_size, n - start)) for k, start in enumerate(range(0, n, args.batch_size))]
    worker_args = ["--partitions", str(partitions), "--scorer", args.scorer]
    if args.concurrency:
        worker_args += ["--concurrency", str(args.concurrency)]
    with redis_under_test(kind) as (url, server_pids), Workers(url, NAMESPACE, processes, *worker_args) as workers:
        await workers.ready()
        async with RolloutProducer(url, ProducerConfig(namespace=NAMESPACE, partitions=partitions)) as opener:
            for bid, size in batches:
                await opener.open_batch(bid, size, RESPONSE_LEN)
            go = opener.client
            producers = [
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "stream_reward.bench.scale",
                        "_produce",
                        json.dumps(
                            {
                                "url": url,
                                "partitions": partitions,
                                "batches": batches[k :: args.producers],
                                "seed": args.seed + k,
                                "bytes": args.bytes,
                                "push_chunk": args.push_chunk,
                            }
                        ),
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    env=child_env(),
                )
                for k in range(args.producers)
            ]
            try:
                while int(await go.get(_READY) or 0) < args.producers:  # imported, connected, pool built
                    if any(p.poll() is not None for p in producers):
                        raise RuntimeError("a producer process exited at start")
                    await asyncio.sleep(0.01)
                pids = [*workers.pids, *server_pids]
                cpu0 = {pid: cpu_seconds(pid) for pid in pids}
                main_cpu0 = time.process_time()
                start = time.perf_counter()
                await go.set(_GO, 1)
                scored = ok = 0
                async with RewardAggregator(url, namespace=NAMESPACE) as agg:
                    for bid, _size in batches:
                        rewards = await agg.collect(bid, timeout_s=600)
                        scored += rewards.n
                        ok += sum(1 for s in rewards.status if s == "ok")
                        bar.advance(rewards.n)
                elapsed = time.perf_counter() - start
                worker_cpu = [round(cpu_seconds(pid) - cpu0[pid], 3) for pid in workers.pids]
                server_cpu = [round(cpu_seconds(pid) - cpu0[pid], 3) for pid in server_pids]
                main_cpu = round(time.process_time() - main_cpu0, 3)
                producer_cpu = [round(json.loads(p.communicate(timeout=60)[0])["cpu_s"], 3) for p in producers]
            finally:
                stop_procs(producers)
    cpu: dict[str, Any] = {
        "workers": worker_cpu,
        "redis": server_cpu,
        "producers": producer_cpu,
        "aggregator": main_cpu,
    }
    return {
        "processes": processes,
        "redis": kind,
        "partitions": partitions,
        "traj_per_s": round(n / elapsed, 1),
        "elapsed_s": round(elapsed, 3),
        "scored": scored,
        "ok": ok,
        "cpu_s": cpu,
        "cpu_us_per_traj": {
            side: round((sum(v) if isinstance(v, list) else v) * 1e6 / n, 1) for side, v in cpu.items()
        },
    }


_READY, _GO = "bench:scale:ready", "bench:scale:go"


def produce(spec: dict[str, Any]) -> int:
    """One producer process: push its batches as fast as Redis takes them, once told to go.
    Prints its CPU seconds (from go to the last push) as JSON on stdout."""
    import json as json_

    from stream_reward.config import ProducerConfig
    from stream_reward.trainer.producer import RolloutProducer
    from stream_reward.wire.trajectory import Trajectory

    pool = gsm8k_pool(random.Random(spec["seed"]), POOL, spec["bytes"])

    async def run() -> float:
        async with RolloutProducer(
            spec["url"], ProducerConfig(namespace=NAMESPACE, partitions=spec["partitions"])
        ) as producer:
            client = producer.client
            await client.incr(_READY)
            while not await client.get(_GO):
                await asyncio.sleep(0.002)
            cpu0 = time.process_time()
            for bid, size in spec["batches"]:
                for lo in range(0, size, spec["push_chunk"]):
                    chunk = []
                    for i in range(lo, min(size, lo + spec["push_chunk"])):
                        s = pool[i % POOL]
                        chunk.append(
                            Trajectory(
                                batch_id=bid,
                                index=i,
                                data_source="openai/gsm8k",
                                response=s["response"],
                                ground_truth=s["ground_truth"],
                                prompt=s["prompt"],
                                valid_response_length=s["valid_response_length"],
                                group=f"{bid}-{i // GROUP_SIZE}",
                            )
                        )
                    await producer.push_many(chunk)
            return time.process_time() - cpu0

    print(json_.dumps({"cpu_s": asyncio.run(run())}), flush=True)
    return 0


def cost_model(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """CPU microseconds one trajectory costs on each side, per kind of Redis (medians
    over that kind's rows), and the rates they allow per core. A Redis node runs
    commands on one thread, so one core is its ceiling."""
    model: dict[str, Any] = {}
    for kind in sorted({r["redis"] for r in rows}):
        mine = [r["cpu_us_per_traj"] for r in rows if r["redis"] == kind]
        cost = {side: round(statistics.median(m[side] for m in mine), 1) for side in mine[0]}
        cost["traj_per_s_per_worker_core"] = round(1e6 / cost["workers"]) if cost["workers"] else None
        cost["traj_per_s_per_producer_core"] = round(1e6 / cost["producers"]) if cost["producers"] else None
        cost["traj_per_s_per_aggregator_core"] = round(1e6 / cost["aggregator"]) if cost["aggregator"] else None
        nodes = len(next(r for r in rows if r["redis"] == kind)["cpu_s"]["redis"])
        # Busiest node: the per-trajectory cost it carries, when the partitions spread evenly.
        per_node = cost["redis"] / nodes
        cost["redis_nodes"] = nodes
        cost["traj_per_s_per_redis_node_core"] = round(1e6 / per_node) if per_node else None
        model[kind] = cost
    return model


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from stream_reward.trainer.tensors import import_torch

    import_torch("the benchmarks")  # a trainer has it loaded; keep its import out of the timed runs

    kinds = [k.strip() for k in args.redis.split(",") if k.strip()]
    counts = [int(p) for p in args.processes.split(",") if p.strip()]
    configs = [(kind, p) for kind in kinds for p in counts]
    rows = []
    with Progress(args, "scale", total=args.n * len(configs)) as bar:
        for k, (kind, processes) in enumerate(configs):
            partitions = args.single_partitions if kind == "single" else (args.partitions or 3)
            bar.update(completed=k * args.n, description=f"{kind} x {processes}")
            rows.append(await run_one(args, kind, processes, partitions, bar))
            say(args, f"{kind:8} {processes} processes, {partitions} partitions: {rows[-1]['traj_per_s']:,.0f} traj/s")
    best = {kind: max((r["traj_per_s"] for r in rows if r["redis"] == kind), default=None) for kind in kinds}
    return {
        "n": args.n,
        "rows": rows,
        "best_traj_per_s": best,
        "cost": cost_model(rows),
        "producers": args.producers,
        "cores": len(os.sched_getaffinity(0)),
        "scorer": args.scorer,
        "payload_bytes": payload_bytes(gsm8k_pool(random.Random(args.seed), 1, args.bytes)[0]),
        "layout": f"{args.producers} producer processes, 1 aggregator process, worker processes, "
        "Redis on 127.0.0.1 (a single node, or 3 masters)",
        "all_scored": all(r["scored"] == r["ok"] == args.n for r in rows)
        if args.scorer == "rules"
        else all(r["scored"] == args.n for r in rows),
    }


def plot(path: str, result: dict[str, Any]) -> None:
    plt = plot_figure(path)
    fig, ax = plt.subplots(figsize=(6, 4))
    for kind in sorted({r["redis"] for r in result["rows"]}):
        mine = [r for r in result["rows"] if r["redis"] == kind]
        ax.plot(
            [r["processes"] for r in mine],
            [r["traj_per_s"] for r in mine],
            "o-",
            label=f"{kind} ({mine[0]['partitions']} partitions)",
        )
    ax.set_xlabel("worker processes")
    ax.set_ylabel("trajectories / s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"scale, {result['n']:,} trajectories per point, {result['cores']} cores")
    ax.legend()
    save_figure(fig, path)


def goals(result: dict[str, Any]) -> dict[str, bool]:
    return {"every trajectory scored": result["all_scored"]}


def main(argv: list[str] | None = None) -> int:
    # scale never checked --plot up front; check_plot=False keeps that as it was.
    return bench_main("scale", argv, parse, run, plot, goals, check_plot=False)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "_produce":
        sys.exit(produce(json.loads(sys.argv[2])))
    sys.exit(main(sys.argv[1:]))
