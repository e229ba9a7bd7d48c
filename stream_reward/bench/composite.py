"""``stream-reward bench composite``: a reward of three components — a format rule, a
correctness check and an LLM judge over HTTP (the reference verifier server in its own
process, ``--judge-latency-ms`` per request) — as a ``CompositeScorer``, against the same
three called one after another in one function.

Both sides use the same scorer objects on the same samples in the same run; only the
orchestration differs. The composite scores ``--concurrency`` samples at a time, as a
worker does, runs a sample's components at once and skips the judge when the format
check failed (``skip_unless``). The one function calls format, correctness and judge in
turn and is called once per sample in a loop, as verl's naive manager calls a
``compute_score``; ``inline_concurrent_samples_per_s`` gives the same function the
composite's concurrency, so the share of the gain that is concurrency across samples
shows. ``ratio`` (the goal, >= 2) is composite over the function in a loop.

No Redis and no worker processes: this measures the scoring of a sample, which is what
a composite changes; the pipeline around it is the same either way.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from stream_reward.bench._common import bench_main, bench_parser, child_env, gsm8k_pool, percentile, stop_procs
from stream_reward.config import ManagerConfig
from stream_reward.scoring.registry import build_scorer
from stream_reward.scoring.scorer import Scored, Scorer
from stream_reward.wire.trajectory import Trajectory

__all__ = ["composite_row", "measure_row", "format_reward", "main"]

FORMAT_SPEC = "stream_reward.bench.composite:format_reward"


async def format_reward(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, **_: Any
) -> float:
    """The format rule: the response ends with a ``#### answer`` line."""
    tail = solution_str.rstrip().rpartition("\n")[2]
    return 1.0 if tail.startswith("#### ") else 0.0


def _components(correct: str, judge_url: str, timeout_s: float) -> list[dict[str, Any]]:
    return [
        {"name": "format", "scorer": FORMAT_SPEC, "weight": 0.2},
        {"name": "correct", "scorer": correct},
        {
            "name": "judge",
            "scorer": f"http:{judge_url}",
            "weight": 0.5,
            "skip_unless": "format",
            "timeout_s": timeout_s,
        },
    ]


def _samples(n: int, seed: int) -> list[Trajectory]:
    """GSM8K-style samples: about 70% right, 10% without a ``####`` line (the format fails)."""
    pool = gsm8k_pool(random.Random(seed), min(n, 512), 400)
    return [
        Trajectory("bench", i, "openai/gsm8k", response=row["response"], ground_truth=row["ground_truth"])
        for i, row in ((i, pool[i % len(pool)]) for i in range(n))
    ]


async def _timed(
    score: Callable[[Trajectory], Awaitable[Any]], trajs: list[Trajectory], concurrency: int
) -> dict[str, Any]:
    latencies: list[float] = []
    slots = asyncio.Semaphore(concurrency)

    async def one(traj: Trajectory) -> None:
        async with slots:
            started = time.perf_counter()
            await score(traj)
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(one(t) for t in trajs))
    wall = time.perf_counter() - started
    return {
        "samples_per_s": round(len(trajs) / wall, 1),
        "p50_ms": round(percentile(latencies, 50) * 1000, 2),
        "p99_ms": round(percentile(latencies, 99) * 1000, 2),
    }


def _start_judge(latency_ms: float) -> tuple[subprocess.Popen[str], str]:
    argv = [sys.executable, "-m", "stream_reward.bench.verifier_server", "--port", "0", "--rule", "rules"]
    argv += ["--latency-ms-p50", str(latency_ms)]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, env=child_env())
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()
    if not url.startswith("http://"):
        _stop(proc)
        raise RuntimeError(f"verifier server did not start (first line {url!r})")
    return proc, url


def _stop(proc: subprocess.Popen[str]) -> None:
    stop_procs([proc])
    if proc.stdout is not None:
        proc.stdout.close()


async def measure_row(n: int, concurrency: int, judge_latency_ms: float, correct: str, seed: int) -> dict[str, Any]:
    """``composite_row`` from a running event loop."""
    proc, url = _start_judge(judge_latency_ms)
    composite: Any = build_scorer(ManagerConfig(components=_components(correct, url, 30.0)))
    parts: list[Scorer] = [scorer for _, scorer in composite.inner.components]
    fmt, check, judge = parts

    async def one_function(traj: Trajectory) -> Scored:
        """What a user writes today: the three calls in turn, in one reward function."""
        f = await fmt.score(traj)
        c = await check.score(traj)
        j = await judge.score(traj)
        return Scored(0.2 * f.score + c.score + 0.5 * j.score)

    try:
        trajs = _samples(n, seed)
        await _timed(composite.score, trajs[:concurrency], concurrency)  # sessions, pools, imports: warm
        judged_before = getattr(judge, "stats", {}).get("requests", 0)
        composite_stats = await _timed(composite.score, trajs, concurrency)
        judged = getattr(judge, "stats", {}).get("requests", 0) - judged_before
        inline_stats = await _timed(one_function, trajs, 1)
        inline_concurrent = await _timed(one_function, trajs, concurrency)
    finally:
        await composite.aclose()
        _stop(proc)
    return {
        "n": n,
        "concurrency": concurrency,
        "judge_latency_ms": judge_latency_ms,
        "correct": correct,
        "composite_samples_per_s": composite_stats["samples_per_s"],
        "composite_p50_ms": composite_stats["p50_ms"],
        "composite_p99_ms": composite_stats["p99_ms"],
        "composite_judge_requests": judged,
        "inline_samples_per_s": inline_stats["samples_per_s"],
        "inline_p50_ms": inline_stats["p50_ms"],
        "inline_p99_ms": inline_stats["p99_ms"],
        "inline_judge_requests": n,
        "inline_concurrent_samples_per_s": inline_concurrent["samples_per_s"],
        "inline_concurrent_p50_ms": inline_concurrent["p50_ms"],
        "ratio": round(composite_stats["samples_per_s"] / inline_stats["samples_per_s"], 2),
        "ratio_same_concurrency": round(composite_stats["samples_per_s"] / inline_concurrent["samples_per_s"], 2),
    }


def composite_row(
    n: int = 200, *, concurrency: int = 32, judge_latency_ms: float = 50.0, correct: str = "rules", seed: int = 0
) -> dict[str, Any]:
    """One comparison row (see the module docstring); ``correct`` is the correctness
    component's scorer spec (``rules``, ``math-verify``, ``FILE.py:FUNC``)."""
    return asyncio.run(measure_row(n, concurrency, judge_latency_ms, correct, seed))


def parse(argv: list[str]) -> argparse.Namespace:
    parser = bench_parser("composite", __doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200, help="samples per side")
    parser.add_argument("--concurrency", type=int, default=32, help="samples in flight for the composite")
    parser.add_argument("--judge-latency-ms", type=float, default=50.0, help="the judge server's latency")
    parser.add_argument("--correct", default="rules", help="the correctness component's scorer spec")
    return parser.parse_args(argv)


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    return await measure_row(args.n, args.concurrency, args.judge_latency_ms, args.correct, args.seed)


def _no_plot(path: str, result: dict[str, Any]) -> None:
    raise SystemExit("bench composite has no plot")


def main(argv: list[str] | None = None) -> int:
    return bench_main(
        "composite",
        argv,
        parse,
        _run,
        _no_plot,
        lambda r: {"ratio >= 2": r["ratio"] >= 2.0},
        check_plot=False,
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
