"""``stream-reward bench throughput``: trajectories per second through the whole
pipeline (RolloutProducer -> worker processes -> RewardAggregator.collect), against
a bare redis-py loop with the same process layout, run in the same invocation.

The bare baseline uses no project code: one producer process XADDs msgpack
payloads in pipelined batches while it XREADs the results; each consumer process
loops XREADGROUP COUNT 256 -> unpack -> the same GSM8K strict check inline -> one
XADD of the read batch's results + XACK in one round trip. It has none of the
project's guarantees (write-once ledger, dead letters, reclaim, backpressure,
rm_scores), which is exactly what the ratio prices.

Runs alternate (baseline, pipeline, baseline, ...) ``--repeats`` times, each on a
fresh private server, and the medians are reported: the machine is noisy, and
interleaving spreads the noise over both sides.

``--bare-bundle K`` adds a third side to the alternation: the same bare loop with K
trajectories packed into each stream entry. It prices the per-entry cost of a Redis
stream (XADD, the pending-entries list, XACK, the client's reply parsing), which the
pipeline and the plain baseline both pay once per trajectory.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import signal
import statistics
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
    cpu_seconds,
    gsm8k_pool,
    payload_bytes,
    plot_figure,
    quiet_server,
    save_figure,
    say,
    setup_torch,
    stop_procs,
)

NAMESPACE = "bench"
RESPONSE_LEN = 1024
POOL = 1024
GROUP_SIZE = 8


def parse(argv: list[str]) -> argparse.Namespace:
    parser = bench_parser("throughput", __doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000, help="trajectories per run")
    parser.add_argument("--bytes", type=int, default=2048, help="approximate response size of a trajectory")
    parser.add_argument("--processes", type=int, default=2, help="consumer (worker) processes")
    parser.add_argument("--scorer", default="rules", help="worker --scorer spec")
    parser.add_argument("--batch-size", type=int, default=4096, help="trajectories per trainer batch (collect() each)")
    parser.add_argument("--push-chunk", type=int, default=256, help="trajectories per pipelined push")
    parser.add_argument(
        "--repeats", type=int, default=3, help="alternating baseline/pipeline runs; medians are reported"
    )
    parser.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.freeze() the producer process's start-up heap (torch) before the runs, as a tuned trainer would",
    )
    parser.add_argument(
        "--bare-bundle",
        type=int,
        default=0,
        metavar="K",
        help="also run the bare loop with K trajectories per stream entry (what bundling could buy)",
    )
    parser.add_argument("--skip-baseline", action="store_true", help=argparse.SUPPRESS)
    add_torch_threads(parser)
    return parser.parse_args(argv)


# ---------------------------------------------------------------------- pipeline
async def run_pipeline(args: argparse.Namespace, pool: list[dict[str, Any]], bar: Progress) -> dict[str, Any]:
    from stream_reward.config import ProducerConfig
    from stream_reward.trainer.aggregator import RewardAggregator
    from stream_reward.trainer.producer import RolloutProducer
    from stream_reward.wire.trajectory import Trajectory

    n = args.n
    batches = [(f"b{k}", min(args.batch_size, n - start)) for k, start in enumerate(range(0, n, args.batch_size))]
    with quiet_server() as server, Workers(server.url, NAMESPACE, args.processes, "--scorer", args.scorer) as workers:
        await workers.ready()
        opened = {bid: asyncio.Event() for bid, _ in batches}
        scored = ok = 0
        cpu0 = {pid: cpu_seconds(pid) for pid in [*workers.pids, server.pid or 0]}
        main_cpu0 = time.process_time()
        start = time.perf_counter()
        async with (
            RolloutProducer(server.url, ProducerConfig(namespace=NAMESPACE)) as producer,
            RewardAggregator(server.url, namespace=NAMESPACE) as agg,
        ):

            async def produce() -> None:
                for bid, size in batches:
                    await producer.open_batch(bid, size, RESPONSE_LEN)
                    opened[bid].set()
                    for lo in range(0, size, args.push_chunk):
                        chunk = []
                        for i in range(lo, min(size, lo + args.push_chunk)):
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

            async def collect() -> None:
                nonlocal scored, ok
                for bid, _size in batches:
                    await opened[bid].wait()
                    rewards = await agg.collect(bid, timeout_s=600)
                    scored += rewards.n
                    ok += sum(1 for s in rewards.status if s == "ok")
                    bar.advance(rewards.n)

            await asyncio.gather(produce(), collect())
        elapsed = time.perf_counter() - start
        cpu = {f"worker{k}": round(cpu_seconds(pid) - cpu0[pid], 3) for k, pid in enumerate(workers.pids)}
        cpu["server"] = round(cpu_seconds(server.pid or 0) - cpu0[server.pid or 0], 3)
        cpu["producer"] = round(time.process_time() - main_cpu0, 3)
    return {"traj_per_s": n / elapsed, "elapsed_s": elapsed, "scored": scored, "ok": ok, "cpu_s": cpu}


# ---------------------------------------------------------------------- bare baseline
BL_STREAM, BL_GROUP, BL_RESULTS, BL_READY = "bl:traj", "bl:group", "bl:results", "bl:ready"
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")


def baseline_consumer(url: str, name: str, bundle: int = 1) -> int:
    """The bare consumer loop (a separate process): no project code at all. With
    ``bundle`` > 1 each entry holds a list of that many trajectories."""
    import msgpack
    import redis

    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    client = redis.Redis.from_url(url)
    try:
        client.xgroup_create(BL_STREAM, BL_GROUP, id="0", mkstream=True)
    except redis.ResponseError:
        pass  # BUSYGROUP: the other consumer made it
    client.incr(BL_READY)
    while not stop["flag"]:
        reply: Any = client.xreadgroup(BL_GROUP, name, {BL_STREAM: ">"}, count=max(1, 256 // bundle), block=100)
        if not reply:
            continue
        entries = reply[0][1]
        results, ids = [], []
        for entry_id, fields in entries:
            unpacked = msgpack.unpackb(fields[b"d"])
            for obj in unpacked if bundle > 1 else (unpacked,):
                matches = _STRICT.findall(obj["r"][-300:])
                answer = matches[-1].replace(",", "") if matches else None
                results.append((obj["u"], 1.0 if answer == obj["gt"] else 0.0))
            ids.append(entry_id)
        pipe = client.pipeline(transaction=False)
        pipe.xadd(BL_RESULTS, {"r": msgpack.packb(results)})
        pipe.xack(BL_STREAM, BL_GROUP, *ids)
        pipe.execute()
    client.close()
    return 0


async def run_baseline(
    args: argparse.Namespace, pool: list[dict[str, Any]], bar: Progress, bundle: int = 1
) -> dict[str, Any]:
    import msgpack
    import redis.asyncio as aredis

    n = args.n
    with quiet_server() as server:
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "stream_reward.bench.throughput", "_consumer", server.url, f"c{k}", str(bundle)],
                stdin=subprocess.DEVNULL,
                env=child_env(),
            )
            for k in range(args.processes)
        ]
        try:
            client = aredis.Redis.from_url(server.url)
            reader = aredis.Redis.from_url(server.url)
            try:
                while int(await client.get(BL_READY) or 0) < args.processes:
                    if any(p.poll() is not None for p in procs):
                        raise RuntimeError("a baseline consumer exited at start")
                    await asyncio.sleep(0.02)
                cpu0 = {pid: cpu_seconds(pid) for pid in [*(p.pid for p in procs), server.pid or 0]}
                main_cpu0 = time.process_time()
                start = time.perf_counter()
                done = 0

                async def produce() -> None:
                    for lo in range(0, n, args.push_chunk):
                        pipe = client.pipeline(transaction=False)
                        objs = []
                        for i in range(lo, min(n, lo + args.push_chunk)):
                            s = pool[i % POOL]
                            objs.append(
                                {
                                    "u": f"b/{i}",
                                    "r": s["response"],
                                    "gt": s["ground_truth"],
                                    "p": s["prompt"],
                                    "vl": s["valid_response_length"],
                                }
                            )
                        if bundle > 1:
                            for at in range(0, len(objs), bundle):
                                pipe.xadd(BL_STREAM, {"d": msgpack.packb(objs[at : at + bundle])})
                        else:
                            for obj in objs:
                                pipe.xadd(BL_STREAM, {"d": msgpack.packb(obj)})
                        await pipe.execute()

                async def collect() -> None:
                    nonlocal done
                    cursor = "0-0"
                    while done < n:
                        reply: Any = await reader.xread({BL_RESULTS: cursor}, count=1000, block=1000)
                        for _stream, entries in reply or []:
                            for entry_id, fields in entries:
                                cursor = entry_id
                                k = len(msgpack.unpackb(fields[b"r"]))
                                done += k
                                bar.advance(k)

                await asyncio.gather(produce(), collect())
                elapsed = time.perf_counter() - start
                cpu = {f"consumer{k}": round(cpu_seconds(p.pid) - cpu0[p.pid], 3) for k, p in enumerate(procs)}
                cpu["server"] = round(cpu_seconds(server.pid or 0) - cpu0[server.pid or 0], 3)
                cpu["producer"] = round(time.process_time() - main_cpu0, 3)
            finally:
                await client.aclose()
                await reader.aclose()
        finally:
            stop_procs(procs)
    return {"traj_per_s": n / elapsed, "elapsed_s": elapsed, "scored": done, "cpu_s": cpu}


# ---------------------------------------------------------------------- main
async def run(args: argparse.Namespace) -> dict[str, Any]:
    setup_torch(args)  # a trainer has torch loaded: keep its import out of what is measured

    if args.gc_freeze:
        import gc

        gc.collect()
        gc.freeze()
    rng = random.Random(args.seed)
    pool = gsm8k_pool(rng, POOL, args.bytes)
    if args.bare_bundle < 0 or args.bare_bundle == 1:
        raise SystemExit("--bare-bundle takes K >= 2 (trajectories per stream entry)")
    runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "pipeline": [], "bundled": []}
    sides = ["pipeline"] if args.skip_baseline else ["baseline", "pipeline"]
    if args.bare_bundle:
        sides.append("bundled")
    with Progress(args, "throughput", total=args.n * args.repeats * len(sides)) as bar:
        for rep in range(args.repeats):
            for side in sides:
                bar.update(
                    completed=(rep * len(sides) + sides.index(side)) * args.n,
                    description=f"{side} {rep + 1}/{args.repeats}",
                )
                if side == "pipeline":
                    runs[side].append(await run_pipeline(args, pool, bar))
                else:
                    bundle = args.bare_bundle if side == "bundled" else 1
                    runs[side].append(await run_baseline(args, pool, bar, bundle))
                say(args, f"{side} run {rep + 1}: {runs[side][-1]['traj_per_s']:,.0f} traj/s")
    rate = statistics.median(r["traj_per_s"] for r in runs["pipeline"])
    base = statistics.median(r["traj_per_s"] for r in runs["baseline"]) if runs["baseline"] else float("nan")
    last = runs["pipeline"][-1]
    entry_bytes = payload_bytes(pool[0])
    return {
        "n": args.n,
        "traj_per_s": round(rate, 1),
        "baseline_traj_per_s": round(base, 1),
        "ratio": round(rate / base, 3) if base == base else None,
        "processes": args.processes,
        "layout": f"1 producer+aggregator process, {args.processes} consumer processes, 1 server, {_cores()} cores",
        "scorer": args.scorer,
        "payload_bytes": entry_bytes,
        "scored": last["scored"],
        "ok": last["ok"],
        "repeats": args.repeats,
        "runs_traj_per_s": [round(r["traj_per_s"]) for r in runs["pipeline"]],
        "runs_baseline_traj_per_s": [round(r["traj_per_s"]) for r in runs["baseline"]],
        # CPU time of every process involved (producer, consumers, server) per
        # trajectory: less sensitive than wall time to other load on the machine.
        "cpu_us_per_traj": round(
            statistics.median(sum(r["cpu_s"].values()) for r in runs["pipeline"]) / args.n * 1e6, 1
        ),
        "baseline_cpu_us_per_traj": (
            round(statistics.median(sum(r["cpu_s"].values()) for r in runs["baseline"]) / args.n * 1e6, 1)
            if runs["baseline"]
            else None
        ),
        "gc_freeze": args.gc_freeze,
        "cpu_s": last["cpu_s"],
        "baseline_cpu_s": runs["baseline"][-1]["cpu_s"] if runs["baseline"] else None,
        "all_scored": all(r["scored"] == args.n for side in runs.values() for r in side),
        **(_bundled(args, runs["bundled"], base) if runs["bundled"] else {}),
    }


def _bundled(args: argparse.Namespace, runs: list[dict[str, Any]], base: float) -> dict[str, Any]:
    rate = statistics.median(r["traj_per_s"] for r in runs)
    return {
        "bare_bundle": args.bare_bundle,
        "bundled_traj_per_s": round(rate, 1),
        "bundled_over_baseline": round(rate / base, 3) if base == base else None,
        "bundled_cpu_us_per_traj": round(statistics.median(sum(r["cpu_s"].values()) for r in runs) / args.n * 1e6, 1),
        "runs_bundled_traj_per_s": [round(r["traj_per_s"]) for r in runs],
    }


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


def plot(path: str, result: dict[str, Any]) -> None:
    plt = plot_figure(path)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [3, 2]})
    reps = list(range(1, len(result["runs_traj_per_s"]) + 1))
    ax1.plot(reps, result["runs_traj_per_s"], "o-", label="stream-reward pipeline")
    if result["runs_baseline_traj_per_s"]:
        ax1.plot(reps, result["runs_baseline_traj_per_s"], "s--", label="bare redis-py loop")
    ax1.set_xticks(reps)
    ax1.set_xlabel("run")
    ax1.set_ylabel("trajectories / s")
    ax1.set_ylim(bottom=0)
    ax1.set_title(
        f"{result['n']:,} x {result['payload_bytes']} B, {result['processes']} consumer processes: "
        f"ratio {result['ratio']}",
        fontsize=10,
    )
    ax1.legend(loc="lower right")
    # Where the CPU goes, per trajectory, in the last run of each side.
    sides = [("pipeline", result["cpu_s"])]
    if result["baseline_cpu_s"]:
        sides.append(("baseline", result["baseline_cpu_s"]))
    colors = {"producer": "#1f77b4", "server": "#ff7f0e", "consumers": "#2ca02c"}
    for x, (_label, cpu) in enumerate(sides):
        parts = {
            "producer": cpu["producer"],
            "server": cpu["server"],
            "consumers": sum(v for k, v in cpu.items() if k not in ("producer", "server")),
        }
        bottom = 0.0
        for part, seconds in parts.items():
            us = seconds / result["n"] * 1e6
            ax2.bar(x, us, bottom=bottom, color=colors[part], label=part if x == 0 else None)
            bottom += us
    ax2.set_xticks(range(len(sides)), [label for label, _ in sides])
    ax2.set_ylabel("CPU us / trajectory (all processes)")
    ax2.set_title("CPU per trajectory", fontsize=10)
    ax2.legend(fontsize=8)
    save_figure(fig, path)


def goals(result: dict[str, Any]) -> dict[str, bool]:
    ratio = result["ratio"]
    return {"ratio >= 0.8": ratio is not None and ratio >= 0.8, "every trajectory scored": result["all_scored"]}


def main(argv: list[str] | None = None) -> int:
    return bench_main("throughput", argv, parse, run, plot, goals)


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "_consumer":
        sys.exit(baseline_consumer(sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 1))
    sys.exit(main(sys.argv[1:]))
