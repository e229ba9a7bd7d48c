"""``stream-reward bench verl_loop``: verl 0.9.1's agent-loop reward path, verl's naive
manager against StreamRewardLoopManager, in the same run.

The path measured is the one verl's agent loop takes: ``RewardLoopWorker.compute_score``
per one-row sample, ``--n`` of them in flight at once (the body of
``compute_score_batch``), each timed from call to result. Both workers are verl's own
``RewardLoopWorker`` built from verl's ``ppo_trainer.yaml`` (Hydra); stream-reward's
differs only by the three overrides (plus ``reward_kwargs.num_workers`` /
``concurrency``). In process, no Ray: one RewardLoopWorker each, as verl's manager
runs ``reward.num_workers`` of them side by side. ``--loop-workers K`` runs K of them
per side, each in its own process as verl's Ray actors are, stream-reward's sharing
one pipeline as on Ray (``stream_reward/bench/verl_loop_pool.py``).

Two scorers:

* ``rule``: no custom function (verl's default_compute_score; stream-reward's rules);
* ``verifier``: an ``async def compute_score`` that POSTs each sample to the reference
  verifier server (``stream_reward/bench/verifier_server.py``, a separate process) answering after
  ``--latency-ms`` (50 ms), given to both through ``custom_reward_function.path``.

Rounds alternate verl / stream-reward after one warm-up each; medians reported:
samples/s, and p50 / p99 per-sample latency. Needs ``verl==0.9.1`` importable;
otherwise the bench reports ``skipped``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from stream_reward.bench._common import Progress, bench_main, bench_parser, gsm8k_pool, percentile, say
from stream_reward.bench.verl_loop_pool import LoopPool, in_process
from stream_reward.bench.vs_verl import build_tokenizer, verl_status

STREAM_OVERRIDES = (
    "reward.reward_manager.source=importlib",
    "reward.reward_manager.module.path=pkg://stream_reward.verl",
    "reward.reward_manager.name=StreamRewardLoopManager",
)
VERIFIER_FN = Path(__file__).with_name("_verl_verifier_fn.py")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = bench_parser("verl_loop", __doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1024, help="one-row samples in flight per round")
    parser.add_argument("--bytes", type=int, default=512, help="approximate response size")
    parser.add_argument("--processes", type=int, default=2, help="stream-reward worker processes")
    parser.add_argument("--concurrency", type=int, default=1024, help="samples in flight per worker process")
    parser.add_argument("--latency-ms", type=float, default=50.0, help="the verifier's answer delay")
    parser.add_argument("--repeats", type=int, default=5, help="alternating rounds per side; medians reported")
    parser.add_argument("--scorers", default="rule,verifier", help="comma-separated: rule, verifier")
    parser.add_argument(
        "--loop-workers",
        type=int,
        default=1,
        help="RewardLoopWorkers per side (verl's reward.num_workers); above 1, each in a process of its own, "
        "the rows split among them, stream-reward's sharing one server and --processes workers",
    )
    args = parser.parse_args(argv)
    if args.loop_workers < 1:
        parser.error("--loop-workers must be >= 1")
    return args


def build_rows(tokenizer: Any, pool: list[dict[str, Any]], n: int) -> list[Any]:
    """``n`` one-row DataProtos (what the agent loop hands the reward worker per trajectory)."""
    from stream_reward.bench.vs_verl import build_batch

    data, _gts, _lengths, _width = build_batch(tokenizer, pool, n)
    return [data[i : i + 1] for i in range(n)]


@contextlib.contextmanager
def verifier_server(latency_ms: float):
    proc = subprocess.Popen(
        [sys.executable, "-m", "stream_reward.bench.verifier_server", "--port", "0", "--rule", "rules"]
        + ["--latency-ms-p50", str(latency_ms)],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        if not url:
            raise RuntimeError("the verifier server did not start")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def run_scorer(args: argparse.Namespace, scorer: str, tokdir: str, rows: list[Any], bar: Progress) -> dict:
    common = ["data.max_response_length=4096"]
    play: Callable[[str], Awaitable[tuple[float, list[float], list[float]]]]
    async with contextlib.AsyncExitStack() as stack:
        if scorer == "verifier":
            url = stack.enter_context(verifier_server(args.latency_ms))
            common += [
                f"reward.custom_reward_function.path={VERIFIER_FN}",
                "reward.custom_reward_function.name=compute_score",
                f"+reward.custom_reward_function.reward_kwargs.url={url}",
            ]
        ours = [*common, *STREAM_OVERRIDES]
        if args.loop_workers > 1:
            ours.append(f"+reward.reward_kwargs.concurrency={args.concurrency}")
            pool = LoopPool(args.loop_workers, tokdir, rows, common, ours, args.processes)
            play = (await stack.enter_async_context(pool)).round
        else:
            ours += [
                f"+reward.reward_kwargs.num_workers={args.processes}",
                f"+reward.reward_kwargs.concurrency={args.concurrency}",
            ]
            play = await in_process(stack, tokdir, rows, common, ours)
        rates: dict[str, list[float]] = {"verl": [], "stream_reward": []}
        lat: dict[str, list[float]] = {"verl": [], "stream_reward": []}
        scores: dict[str, list[float]] = {}
        for rep in range(args.repeats + 1):  # round 0 warms both up, uncounted
            for side in ("verl", "stream_reward"):
                elapsed, latencies, got = await play(side)
                if rep == 0:
                    continue
                rates[side].append(len(rows) / elapsed)
                lat[side].append(percentile(latencies, 50))
                lat[side].append(percentile(latencies, 99))
                scores[side] = got
                bar.advance()
                say(args, f"{scorer} round {rep} {side}: {rates[side][-1]:,.0f} samples/s")
        # The verifier answers by the same rules as the rule scorer: equal scores do not show
        # that the workers called it; its count does (every sample of every round, both sides).
        called = verifier_requests(url) if scorer == "verifier" else None
    verl_rate = statistics.median(rates["verl"])
    sr_rate = statistics.median(rates["stream_reward"])
    return {
        "verl_samples_per_s": round(verl_rate, 1),
        "stream_reward_samples_per_s": round(sr_rate, 1),
        "ratio": round(sr_rate / verl_rate, 2),
        "p50_ms": round(statistics.median(lat["stream_reward"][0::2]), 1),
        "p99_ms": round(statistics.median(lat["stream_reward"][1::2]), 1),
        "verl_p50_ms": round(statistics.median(lat["verl"][0::2]), 1),
        "verl_p99_ms": round(statistics.median(lat["verl"][1::2]), 1),
        "scores_agree": sum(a == b for a, b in zip(scores["verl"], scores["stream_reward"], strict=True)),
        "runs_verl_samples_per_s": [round(r) for r in rates["verl"]],
        "runs_stream_reward_samples_per_s": [round(r) for r in rates["stream_reward"]],
        **({"verifier_requests": called} if called is not None else {}),
    }


def verifier_requests(url: str) -> int:
    with urllib.request.urlopen(f"{url.rstrip('/')}/stats", timeout=10) as resp:
        return int(json.load(resp)["requests"])


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import verl  # type: ignore[import-not-found]

    scorers = [s.strip() for s in args.scorers.split(",") if s.strip()]
    unknown = set(scorers) - {"rule", "verifier"}
    if unknown:
        raise SystemExit(f"bench verl_loop: unknown scorer(s) {sorted(unknown)}; use rule, verifier")
    pool = gsm8k_pool(random.Random(args.seed), 256, args.bytes)
    result: dict[str, Any] = {
        "n": args.n,
        "verl_version": verl.__version__,
        "path": "RewardLoopWorker.compute_score per one-row sample, all in flight (compute_score_batch)",
        "processes": args.processes,
        "loop_workers": args.loop_workers,
        "cpu_count": os.cpu_count(),
    }
    with tempfile.TemporaryDirectory(prefix="verl-loop-tok-") as tokdir:
        tokenizer = build_tokenizer([s["prompt"] + " " + s["response"] for s in pool], tokdir)
        rows = build_rows(tokenizer, pool, args.n)
        with Progress(args, "verl_loop", total=2 * args.repeats * len(scorers)) as bar:
            for scorer in scorers:
                result[scorer] = await run_scorer(args, scorer, tokdir, rows, bar)
    return result


def plot(path: str, result: dict[str, Any]) -> None:
    from stream_reward.bench._common import plot_figure, save_figure

    plt = plot_figure(path)
    scorers = [s for s in ("rule", "verifier") if s in result]
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = range(len(scorers))
    ax.bar([x - 0.2 for x in xs], [result[s]["verl_samples_per_s"] for s in scorers], 0.4, label="verl naive")
    ax.bar(
        [x + 0.2 for x in xs], [result[s]["stream_reward_samples_per_s"] for s in scorers], 0.4, label="stream-reward"
    )
    ax.set_xticks(list(xs), scorers)
    ax.set_ylabel("samples / s")
    ax.legend()
    save_figure(fig, path)


def goals(result: dict[str, Any]) -> dict[str, bool]:
    out = {}
    for scorer in ("rule", "verifier"):
        if scorer in result:
            out[f"{scorer}: ratio >= 1.0 vs verl's naive manager"] = result[scorer]["ratio"] >= 1.0
            out[f"{scorer}: same scores as verl"] = result[scorer]["scores_agree"] == result["n"]
            k = result.get("loop_workers", 1)
            if k > 1:  # the bar, at verl's reward.num_workers
                out[f"{scorer}: ratio >= 1.2 vs verl's naive manager at loop_workers={k}"] = (
                    result[scorer]["ratio"] >= 1.2
                )
    return out


def main(argv: list[str] | None = None) -> int:
    return bench_main("verl_loop", argv, parse, run, plot, goals, skip=verl_status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
