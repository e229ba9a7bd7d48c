"""``--scorer math-verify`` through its scorer processes vs math-verify called in a loop.

The baseline is what a verl user runs today: verl 0.9.1's ``math_verify.compute_score``
convention (a ``math_metric`` with LaTeX gold and expression-or-LaTeX predictions, the
ground truth in ``\\boxed{}``) called once per sample, one after another, in this process.
The other side scores the same samples through ``--scorer math-verify``: the pool of
scorer processes (one per core by default), fed concurrently from an event loop. Rounds
alternate which side goes first, so background load hits both alike.

``ratio`` = pool samples/s / loop samples/s (goal >= 1.5 on 2 cores); the verdicts of the
two sides must agree sample for sample. ``composite`` is ``stream-reward bench composite``'s
row with math-verify as the correctness component: a format rule, math-verify and a judge
over HTTP (50 ms a request) as three ``[[reward.components]]``, against the same three called
one after another in one function (goal >= 2); ``--no-composite`` leaves it out. The samples are MATH-style answers with a few
sentences of working, every one distinct and fresh each round (math-verify and sympy cache what they have seen:
repeats would measure the caches), half of them right.

    stream-reward bench math_verify --json      (or: python -m stream_reward.bench.math_verify --json)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from typing import Any

from stream_reward.bench._common import bench_main, bench_parser, cpu_seconds, plot_figure, save_figure, say
from stream_reward.bench.composite import measure_row
from stream_reward.config import ManagerConfig
from stream_reward.scoring.registry import build_scorer
from stream_reward.wire.trajectory import Trajectory

# The filler a response's working is drawn from; {a} and {b} are small numbers.
_WORKING = [
    "First we expand the product to get ${a}x^2 + {b}x$.",
    "Dividing both sides by ${a}$ gives $x = \\frac{{{b}}}{{{a}}}$ as a candidate.",
    "Since ${a} + {b} = {s}$, the sum is fixed.",
    "We check the boundary case $x = {a}$ separately.",
    "By the Pythagorean theorem, $c^2 = {a}^2 + {b}^2$.",
    "Substituting back, the expression becomes $\\sqrt{{{a}}} \\cdot \\sqrt{{{b}}}$.",
    "The discriminant is ${b}^2 - 4 \\cdot {a}$, which is what we need.",
]


def _answer(rng: random.Random) -> tuple[str, str, str]:
    """(gold, an equal answer written another way, a wrong answer) of a random kind."""
    a, b = rng.randint(2, 97), rng.randint(2, 97)
    kind = rng.randrange(8)
    if kind == 0:
        return f"\\frac{{{a}}}{{{4 * a}}}", "0.25", f"\\frac{{{a}}}{{{4 * a + 1}}}"
    if kind == 1:
        return f"\\sqrt{{{a * a * 3}}}", f"{a}\\sqrt{{3}}", f"{a}\\sqrt{{2}}"
    if kind == 2:
        return f"[{a}, {a + b})", f"[{a},{a + b})", f"({a}, {a + b})"
    if kind == 3:
        return f"\\{{{a},{b},{a + b}\\}}", f"\\{{{a + b}, {b}, {a}\\}}", f"\\{{{a}, {b}\\}}"
    if kind == 4:
        return f"({a}, -{b})", f"\\left({a}, -{b}\\right)", f"({b}, -{a})"
    if kind == 5:
        return f"{a}\\%", f"{a}", f"{a + 1}\\%"
    if kind == 6:
        return f"\\frac{{{a}\\pi}}{{{b}}}", f"{a}\\pi/{b}", f"\\frac{{{b}\\pi}}{{{a}}}"
    return f"{a * b}", f"x = {a * b}", f"{a * b + 1}"


def make_samples(n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` distinct (response, ground truth) pairs, every other one right."""
    rng = random.Random(seed)
    samples: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    while len(samples) < n:
        gold, same, wrong = _answer(rng)
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        working = " ".join(line.format(a=a, b=b, s=a + b) for line in rng.sample(_WORKING, 4))
        answer = same if len(samples) % 2 == 0 else wrong
        sample = (f"{working} Therefore the answer is $\\boxed{{{answer}}}$.", gold)
        if sample not in seen:
            seen.add(sample)
            samples.append(sample)
    return samples


def verl_compute_score(model_output: str, ground_truth: str) -> float:
    """verl 0.9.1's ``math_verify.compute_score``, restated: the baseline's per-sample call."""
    from math_verify.errors import TimeoutException
    from math_verify.metric import math_metric
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

    verify = math_metric(
        gold_extraction_target=(LatexExtractionConfig(),),
        pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()),
    )
    try:
        score, _ = verify(["\\boxed{" + ground_truth + "}"], [model_output])
    except (Exception, TimeoutException):
        return 0.0
    return float(score)


def _children_cpu_s() -> float:
    """CPU seconds of this process's children so far (the scorer processes), from /proc."""
    total, me = 0.0, str(os.getpid())
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii") as handle:
                    parent = handle.read().rsplit(")", 1)[1].split()[1]
            except (OSError, IndexError):
                continue
            if parent == me:
                total += cpu_seconds(int(entry))
    return total


def _loop(samples: list[tuple[str, str]]) -> tuple[float, float, list[float]]:
    """Wall seconds, CPU seconds and scores of the baseline loop."""
    started, cpu = time.perf_counter(), time.process_time()
    scores = [verl_compute_score(response, truth) for response, truth in samples]
    return time.perf_counter() - started, time.process_time() - cpu, scores


async def _pooled(scorer: Any, trajs: list[Trajectory]) -> tuple[float, float, list[float], int]:
    """Wall seconds, CPU seconds of the scorer processes, scores and timeouts through the pool."""
    started, cpu = time.perf_counter(), _children_cpu_s()
    scored = await asyncio.gather(*(scorer.score(t) for t in trajs))
    elapsed = time.perf_counter() - started
    return (
        elapsed,
        _children_cpu_s() - cpu,
        [s.score for s in scored],
        sum(bool(s.extra.get("timeout")) for s in scored),
    )


async def run(args: argparse.Namespace) -> dict[str, Any]:
    processes = args.processes or os.cpu_count() or 1
    scorer = build_scorer(ManagerConfig(scorer="math-verify", num_processes=processes, timeout=args.timeout_s))
    pool_s = loop_s = pool_cpu_s = loop_cpu_s = 0.0
    agree = True
    right = timeouts = 0
    try:
        # Warm-up, as in a long-running worker: every scorer process started and every kind of
        # answer parsed once on both sides (sympy imports parts of itself on first use).
        warm = make_samples(16 * processes, args.seed - 1)
        await _pooled(scorer, _trajs(warm))
        _loop(warm)
        for i in range(args.rounds):
            # Fresh samples each round: sympy caches what it has seen, and a real run rarely
            # scores the same response twice.
            samples = make_samples(args.n, args.seed + i)
            for side in ("pool", "loop") if i % 2 == 0 else ("loop", "pool"):
                say(args, f"round {i + 1}/{args.rounds}: {side}")
                if side == "pool":
                    elapsed, cpu, pool_scores, timed_out = await _pooled(scorer, _trajs(samples))
                    pool_s, pool_cpu_s, timeouts = pool_s + elapsed, pool_cpu_s + cpu, timeouts + timed_out
                else:
                    elapsed, cpu, loop_scores = _loop(samples)
                    loop_s, loop_cpu_s = loop_s + elapsed, loop_cpu_s + cpu
            agree = agree and pool_scores == loop_scores
            right += int(sum(loop_scores))
    finally:
        await getattr(scorer, "aclose")()  # noqa: B009 - not in the Scorer protocol
    done = args.n * args.rounds
    composite = None
    if args.composite:
        say(args, "composite: format + math-verify + judge, as components and as one function")
        composite = await measure_row(args.n, 32, 50.0, "math-verify", args.seed)
    return {
        "n": args.n,
        "rounds": args.rounds,
        "processes": processes,
        "cpu_count": os.cpu_count(),
        "pool_samples_per_s": round(done / pool_s, 2),
        "loop_samples_per_s": round(done / loop_s, 2),
        "ratio": round(loop_s / pool_s, 3),
        "loop_ms_per_sample": round(1000 * loop_s / done, 2),
        # CPU per sample on each side, and the cores each side got: on a machine shared with
        # other work the pool cannot go faster than the cores it is given.
        "pool_cpu_ms_per_sample": round(1000 * pool_cpu_s / done, 2),
        "loop_cpu_ms_per_sample": round(1000 * loop_cpu_s / done, 2),
        "pool_cores_busy": round(pool_cpu_s / pool_s, 2),
        "loop_cores_busy": round(loop_cpu_s / loop_s, 2),
        "right": right,
        "pool_timeouts": timeouts,
        "scores_agree": agree,
        "load_average_1m": round(os.getloadavg()[0], 2),
        "composite": composite,
    }


def _trajs(samples: list[tuple[str, str]]) -> list[Trajectory]:
    return [Trajectory("bench-mv", i, "math", response=r, ground_truth=t) for i, (r, t) in enumerate(samples)]


def plot(path: str, result: dict[str, Any]) -> None:
    plt = plot_figure(path)
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.bar(
        [f"--scorer math-verify\n({result['processes']} processes)", "compute_score\nin a loop"],
        [result["pool_samples_per_s"], result["loop_samples_per_s"]],
    )
    ax.set_ylabel("samples / s")
    ax.set_title(f"math-verify, {result['n']} samples x {result['rounds']} rounds")
    save_figure(fig, path)


def _goals(result: dict[str, Any]) -> dict[str, bool]:
    goals = {"ratio >= 1.5": result["ratio"] >= 1.5, "scores agree": result["scores_agree"]}
    if result["composite"] is not None:
        goals["composite ratio >= 2"] = result["composite"]["ratio"] >= 2
    return goals


def _skip() -> str | None:
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return "math-verify is not installed: pip install 'stream-reward[math]'"
    return None


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = bench_parser("math_verify", __doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200, help="samples per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--processes", type=int, default=None, help="scorer processes (default: cores)")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="per-sample timeout of the pool")
    parser.add_argument("--no-composite", dest="composite", action="store_false", help="leave out the composite row")
    args = parser.parse_args(argv)
    if args.n < 1 or args.rounds < 1 or (args.processes is not None and args.processes < 1):
        parser.error("--n, --rounds and --processes must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    return bench_main("math_verify", argv, _parse, run, plot, _goals, skip=_skip)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
