"""``stream-reward bench quota``: how much of a strict RPM quota two worker processes
use, sharing one global limiter through Redis, without a single 429.

The reference verifier server (``stream_reward.bench.verifier_server``, its own process)
enforces ``--quota-rpm`` as a token bucket refilled continuously with only
``--server-burst-s`` of headroom (50 ms by default: 5 requests at 100/s), and
answers 429 past it. The workers (``--scorer http:URL --max-rpm ...``, one
``--quota-key``) are given the same rate less ``--margin``; more work is queued
than the quota can serve in ``--duration-s``. Measured on the server's side,
from its first request: requests accepted per minute (``achieved_rpm``), its
ratio to the quota (``utilization``) and the 429s it had to send.

Why a margin at all: the GCRA schedule is exact on Redis's clock, but a request
reaches the server a few ms after its slot, by a delay that varies (event loops,
two CPUs shared by four processes). A request held up behind a late one arrives
close to it; the server's headroom absorbs that up to ``burst - 1`` intervals,
and the margin refills the headroom after a hiccup.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import time
from typing import Any

from stream_reward.bench._common import (
    Workers,
    bench_parser,
    child_env,
    emit,
    plot_figure,
    quiet_server,
    save_figure,
    say,
    stop_procs,
)

QUOTA_KEY = "bench-quota"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = bench_parser("quota", __doc__.splitlines()[0])
    parser.add_argument(
        "--duration-s", type=float, default=30.0, help="measured seconds, from the server's first request"
    )
    parser.add_argument("--quota-rpm", type=float, default=6000.0, help="the server's strict quota")
    parser.add_argument("--margin", type=float, default=0.01, help="the limiter runs at quota * (1 - margin)")
    parser.add_argument("--server-burst-s", type=float, default=0.1, help="the server's headroom, in seconds of quota")
    parser.add_argument("--processes", type=int, default=2, help="worker processes sharing the quota")
    parser.add_argument("--concurrency", type=int, default=32, help="samples in flight per worker")
    parser.add_argument("--latency-ms-p50", type=float, default=20.0, help="verifier latency, median")
    parser.add_argument("--latency-ms-p99", type=float, default=80.0, help="verifier latency, 99th percentile")
    parser.add_argument("--redis", default=None, help="Redis URL; none: a private embedded server")
    return parser.parse_args(argv)


def start_verifier(args: argparse.Namespace, burst: float) -> tuple[subprocess.Popen[str], str]:
    argv = [
        sys.executable,
        "-m",
        "stream_reward.bench.verifier_server",
        "--port",
        "0",
        "--rpm",
        str(args.quota_rpm),
        "--rpm-burst",
        str(burst),
        "--latency-ms-p50",
        str(args.latency_ms_p50),
        "--latency-ms-p99",
        str(args.latency_ms_p99),
        "--seed",
        str(args.seed),
    ]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, env=child_env())
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()
    if not url.startswith("http://"):
        stop_procs([proc])
        proc.stdout.close()
        raise RuntimeError(f"verifier server did not start (first line {url!r})")
    return proc, url


async def get_stats(session: Any, url: str, *, log: bool = False) -> dict[str, Any]:
    async with session.get(f"{url}/stats", params={"log": "1"} if log else None) as resp:
        return await resp.json()


async def measure(args: argparse.Namespace, redis_url: str, namespace: str) -> dict[str, Any]:
    import aiohttp

    from stream_reward.config import ProducerConfig, QuotaConfig
    from stream_reward.scoring.quota import QuotaLimiter
    from stream_reward.trainer.producer import RolloutProducer
    from stream_reward.wire.trajectory import Trajectory

    rate = args.quota_rpm / 60
    burst = max(2.0, rate * args.server_burst_s)
    limiter_rpm = args.quota_rpm * (1 - args.margin)
    server, url = start_verifier(args, burst)
    say(args, f"verifier {url}: {args.quota_rpm:g} rpm, {burst:g} requests of headroom; limiter at {limiter_rpm:g} rpm")
    try:
        worker_args = (
            "--scorer",
            f"http:{url}",
            "--max-rpm",
            str(limiter_rpm),
            "--quota-key",
            QUOTA_KEY,
            "--concurrency",
            str(args.concurrency),
            "--read-count",
            str(args.concurrency),
            "--drain-timeout-s",
            "1",
            "--retries",
            "3",
        )
        # More work than the quota can serve in the run: the limiter, not the queue,
        # sets the pace. Queued before the workers start, so that pushing does not
        # compete for the CPUs with the first requests.
        n = math.ceil(rate * (args.duration_s + 5) * 1.2) + 50
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace, max_backlog=0)) as producer:
            await producer.open_batch("quota", n, 16)
            for lo in range(0, n, 1000):
                await producer.push_many(
                    Trajectory("quota", i, "bench", response=str(i), ground_truth=str(i), valid_response_length=1)
                    for i in range(lo, min(n, lo + 1000))
                )
        with Workers(redis_url, namespace, args.processes, *worker_args):
            async with aiohttp.ClientSession() as session:
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 60
                while (await get_stats(session, url))["requests"] == 0:
                    if loop.time() > deadline:
                        raise RuntimeError("the workers sent no request within 60 s")
                    await asyncio.sleep(0.02)
                await asyncio.sleep(args.duration_s + 0.5)
                stats = await get_stats(session, url, log=True)
            limiter = QuotaLimiter(redis_url, QuotaConfig(QUOTA_KEY), namespace=namespace)
            try:
                quota_state = await limiter.state()
            finally:
                await limiter.aclose()
    finally:
        stop_procs([server])
        if server.stdout is not None:
            server.stdout.close()
    log = stats["log"]
    t0 = min(t for t, _, _ in log)
    window = [(t - t0, status) for t, _, status in log if t - t0 < args.duration_s]
    accepted = sum(1 for _, status in window if status == 200)
    rejected = sum(1 for _, status in window if status == 429)
    per_second = [0] * math.ceil(args.duration_s)
    for dt, status in window:
        if status == 200:
            per_second[int(dt)] += 1
    achieved_rpm = accepted / args.duration_s * 60
    return {
        "quota_rpm": args.quota_rpm,
        "limiter_rpm": round(limiter_rpm, 3),
        "achieved_rpm": round(achieved_rpm, 1),
        "utilization": round(achieved_rpm / args.quota_rpm, 4),
        "http_429": rejected,
        "http_429_total": stats["http_429"],
        "processes": args.processes,
        "duration_s": args.duration_s,
        "requests": len(window),
        "server_burst": burst,
        "latency_ms_p50": args.latency_ms_p50,
        "latency_ms_p99": args.latency_ms_p99,
        "per_second_min": min(per_second) if per_second else 0,
        "per_second_max": max(per_second) if per_second else 0,
        # The server judges the quota when its handler runs: a stall of its own loop
        # (a busy machine) bunches requests that left the workers evenly spaced.
        "server_stalls_over_20ms": len([1 for t, _ in stats["loop_stalls"] if t >= t0]),
        "server_max_stall_ms": round(max((lag for t, lag in stats["loop_stalls"] if t >= t0), default=0.0) * 1000, 1),
        "limiter_requests": quota_state["requests"],
        "limiter_http_429": quota_state["http_429"],
        "_per_second": per_second,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    namespace = f"bench-quota-{os.getpid()}"
    if args.redis:
        try:
            return await measure(args, args.redis, namespace)
        finally:
            await cleanup(args.redis, namespace)
    with quiet_server() as server:
        return await measure(args, server.url, namespace)


async def cleanup(url: str, namespace: str) -> None:
    from stream_reward.wire.connection import connect
    from stream_reward.wire.keys import Keys

    client = connect(url)
    try:
        for pattern in (f"{Keys(namespace).tag()}*", f"{Keys(namespace).quota(QUOTA_KEY)}*"):
            async for key in client.scan_iter(match=pattern.replace("{", "\\{").replace("}", "\\}"), count=1000):
                await client.delete(key)
    finally:
        await client.aclose()


def plot(path: str, result: dict[str, Any]) -> None:
    plt = plot_figure(path)
    per_second = result["_per_second"]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(
        range(len(per_second)), [c * 60 for c in per_second], drawstyle="steps-post", label="accepted (per second x 60)"
    )
    ax.axhline(result["quota_rpm"], color="red", linestyle="--", label=f"quota {result['quota_rpm']:g} rpm")
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("requests per minute")
    ax.set_ylim(0, result["quota_rpm"] * 1.2)
    ax.set_title(
        f"{result['processes']} workers, one global limiter: utilization {result['utilization']:.3f}, "
        f"{result['http_429']} x 429"
    )
    ax.legend(loc="lower right")
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = parse(list(argv or []))
    if args.duration_s <= 0 or args.quota_rpm <= 0 or not 0 <= args.margin < 1 or args.processes < 1:
        print("bench quota: --duration-s, --quota-rpm, --processes must be > 0 and --margin in [0, 1)", file=sys.stderr)
        return 2
    started = time.perf_counter()
    result = asyncio.run(run(args))
    if args.plot:
        plot(args.plot, result)
    per_second = result.pop("_per_second")
    result["wall_s"] = round(time.perf_counter() - started, 1)
    if not args.json:
        say(args, "per second: " + json.dumps(per_second))
    emit(
        args,
        "quota: two workers, one global limiter",
        result,
        goals={"utilization >= 0.97": result["utilization"] >= 0.97, "no 429": result["http_429"] == 0},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
