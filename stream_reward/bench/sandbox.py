"""Sandboxed vs plain-subprocess throughput of the local code sandbox.

Scores a set of small real problems (a correct and a broken solution each, all
four ground-truth forms) through ``SandboxScorer``, and in the same run executes
the same programs as fresh unsandboxed ``python3`` subprocesses (``python -I -S
-c`` per test case, the way a naive reward function runs them) with the same
parallelism. Rounds alternate between the two so background load hits both alike.

``multi_case_ratio`` = sandboxed samples/s / baseline samples/s with every case
of every problem (goal >= 1.5); ``single_case_ratio`` the same with only each
problem's first case (goal >= 2.0): the worst case for the sandbox, where a
sample is a single program run. The sandbox's slots are started by a warm-up
round, as in a long-running worker.

    stream-reward bench sandbox --json      (or: python -m stream_reward.bench.sandbox --json)
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any

from stream_reward.bench._common import bench_parser, emit, plot_figure
from stream_reward.bench.sandbox_languages import language_rows
from stream_reward.bench.sandbox_problems import first_case_only, long_samples, samples_of
from stream_reward.scoring.sandbox.scorer import SandboxConfig, SandboxScorer, case_script, parse_tests
from stream_reward.wire.trajectory import Trajectory


async def _sandboxed(scorer: SandboxScorer, samples: list[tuple[Trajectory, float]]) -> tuple[float, list[float]]:
    start = time.perf_counter()
    results = await asyncio.gather(*(scorer.score(t) for t, _ in samples))
    return time.perf_counter() - start, [r.score for r in results]


async def _plain_case(code: str, stdin: str, expected: str | None, timeout_s: float) -> bool:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        "-S",
        "-c",
        code,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(stdin.encode()), timeout_s)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        return False
    if proc.returncode != 0:
        return False
    if expected is None:
        return True
    norm = lambda s: [line.rstrip() for line in s.rstrip().split("\n")]  # noqa: E731
    return norm(out.decode("utf-8", "replace")) == norm(expected)


async def _baseline(
    samples: list[tuple[Trajectory, float]], concurrency: int, timeout_s: float
) -> tuple[float, list[float]]:
    sem = asyncio.Semaphore(concurrency)

    async def one(traj: Trajectory) -> float:
        form, cases = parse_tests(traj.ground_truth)
        program = traj.response.split("```python\n", 1)[1].rsplit("```", 1)[0]
        async with sem:  # like the sandbox: one slot runs one sample's cases in turn
            passed = 0
            for case in cases:
                code, stdin = case_script(form, program, case)
                passed += await _plain_case(code, stdin, case["stdout"] if form == "stdin" else None, timeout_s)
        return passed / len(cases)

    start = time.perf_counter()
    scores = await asyncio.gather(*(one(t) for t, _ in samples))
    return time.perf_counter() - start, list(scores)


def run(
    n_problems: int = 20,
    concurrency: int | None = None,
    rounds: int = 5,
    backend: str = "auto",
    with_languages: bool = True,
) -> dict[str, Any]:
    concurrency = concurrency or os.cpu_count() or 1
    config = SandboxConfig(concurrency=concurrency, backend=backend, timeout_s=5.0, cpu_s=5.0)
    scorer = SandboxScorer(config)
    samples = samples_of(n_problems)
    one_case = first_case_only(samples)
    runs = sum(len(parse_tests(t.ground_truth)[1]) for t, _ in samples)

    async def timed(which: list[tuple[Trajectory, float]]) -> tuple[float, float, list[float], list[float]]:
        """Total sandbox and baseline seconds over all rounds, alternating which goes first."""
        sandbox_s = baseline_s = 0.0
        sandbox_scores: list[float] = []
        baseline_scores: list[float] = []
        for i in range(rounds):
            for side in (0, 1) if i % 2 == 0 else (1, 0):
                if side == 0:
                    t, sandbox_scores = await _sandboxed(scorer, which)
                    sandbox_s += t
                else:
                    t, baseline_scores = await _baseline(which, concurrency, config.timeout_s)
                    baseline_s += t
        return sandbox_s, baseline_s, sandbox_scores, baseline_scores

    long_cases = long_samples(2 * concurrency)
    long_ok: list[bool] = []
    by_form: dict[str, list[tuple[Trajectory, float]]] = {}
    for sample in one_case:
        by_form.setdefault(parse_tests(sample[0].ground_truth)[0], []).append(sample)
    for form, subset in by_form.items():  # as many samples as the whole set: no round is only its tail
        by_form[form] = (subset * (1 + len(one_case) // len(subset)))[: len(one_case)]

    async def go() -> tuple[
        tuple[float, float, list[float], list[float]],
        tuple[float, float, list[float], list[float]],
        dict[str, tuple[float, float]],
    ]:
        await _sandboxed(scorer, samples[: 2 * concurrency])  # warm-up: starts every slot, page cache
        await _baseline(samples[:4], concurrency, config.timeout_s)
        forms = {}
        for form, subset in by_form.items():  # where the single-case time goes, form by form
            sandbox_s, baseline_s, _, _ = await timed(subset)
            forms[form] = (sandbox_s, baseline_s)
        long_s, long_base_s, long_scores, _ = await timed(long_cases)
        forms["long_cases"] = (long_s, long_base_s)
        long_ok.append(long_scores == [1.0] * len(long_cases))
        return await timed(samples), await timed(one_case), forms

    try:
        (sandbox_s, baseline_s, sandbox_scores, baseline_scores), (one_s, one_base_s, _, _), forms = asyncio.run(go())
        languages = language_rows(scorer, concurrency) if with_languages else {}
    finally:
        scorer.close()
    expected_ok = all(long_ok) and all(
        (s == 1.0) if e == 1.0 else (s < 1.0) for s, (_, e) in zip(sandbox_scores, samples, strict=True)
    )
    runs_per_s = runs * rounds / sandbox_s
    baseline_runs_per_s = runs * rounds / baseline_s
    return {
        "backend": scorer.backend,
        "n": len(samples),
        "problems": n_problems,
        "runs": runs,
        "rounds": rounds,
        "concurrency": concurrency,
        "runs_per_s": round(runs_per_s, 2),
        "baseline_runs_per_s": round(baseline_runs_per_s, 2),
        "ratio": round(runs_per_s / baseline_runs_per_s, 3),
        "samples_per_s": round(len(samples) * rounds / sandbox_s, 2),
        "baseline_samples_per_s": round(len(samples) * rounds / baseline_s, 2),
        # Worst case for the one-sandbox-per-sample design: every sample has a single case.
        "one_case_runs_per_s": round(len(samples) * rounds / one_s, 2),
        "one_case_baseline_runs_per_s": round(len(samples) * rounds / one_base_s, 2),
        "one_case_ratio": round(one_base_s / one_s, 3),
        "single_case_ratio": round(one_base_s / one_s, 3),
        "multi_case_ratio": round(baseline_s / sandbox_s, 3),
        # The single-case rows by test form: the check and assert forms add the trusted
        # checker (a process per sample, the test's calls relayed through the host).
        "single_case_by_form": {
            form: {
                "samples": len(by_form[form]),
                "runs_per_s": round(len(by_form[form]) * rounds / s, 2),
                "baseline_runs_per_s": round(len(by_form[form]) * rounds / b, 2),
                "ratio": round(b / s, 3),
            }
            for form, (s, b) in forms.items()
            if form in by_form
        },
        # Stdin cases of ~20 ms of computing each (4 per sample): what a case costs
        # beyond the program's own work, where the warm start matters less.
        "long_cases": {
            "cases": 4 * len(long_cases),
            "runs_per_s": round(4 * len(long_cases) * rounds / forms["long_cases"][0], 2),
            "baseline_runs_per_s": round(4 * len(long_cases) * rounds / forms["long_cases"][1], 2),
            "ratio": round(forms["long_cases"][1] / forms["long_cases"][0], 3),
        },
        "load_average_1m": round(os.getloadavg()[0], 2),
        "scores_as_expected": expected_ok,
        "scores_agree_with_baseline": sandbox_scores == baseline_scores,
        # Per language: repeated programs (one compile each) vs a naive verifier compiling per sample.
        "languages": languages,
    }


def plot(path: str, result: dict[str, Any]) -> None:
    plt = plot_figure(path)
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = ["all cases", "one case per sample"]
    x = range(len(labels))
    ax.bar(
        [i - 0.2 for i in x],
        [result["runs_per_s"], result["one_case_runs_per_s"]],
        width=0.4,
        label=f"sandboxed ({result['backend']})",
    )
    ax.bar(
        [i + 0.2 for i in x],
        [result["baseline_runs_per_s"], result["one_case_baseline_runs_per_s"]],
        width=0.4,
        label="plain subprocess",
    )
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("runs / s")
    ax.set_title(f"code sandbox, concurrency {result['concurrency']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("sandbox", __doc__.splitlines()[0])
    parser.add_argument("--n-problems", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backend", default="auto", choices=["auto", "bwrap", "unshare"])
    parser.add_argument("--no-languages", action="store_true", help="skip the per-language rows")
    args = parser.parse_args(list(argv or []))
    if args.n_problems < 1 or args.rounds < 1 or (args.concurrency is not None and args.concurrency < 1):
        print("bench sandbox: --n-problems, --rounds and --concurrency must be >= 1", file=sys.stderr)
        return 2
    result = run(
        n_problems=args.n_problems,
        concurrency=args.concurrency,
        rounds=args.rounds,
        backend=args.backend,
        with_languages=not args.no_languages,
    )
    if args.plot:
        plot(args.plot, result)
    emit(
        args,
        "sandbox: sandboxed vs plain subprocess runs",
        result,
        goals={
            "single_case_ratio >= 2.0": result["single_case_ratio"] >= 2.0,
            "multi_case_ratio >= 1.5": result["multi_case_ratio"] >= 1.5,
            **{
                f"{language} ratio >= 1.0": row["ratio"] >= 1.0
                for language, row in result["languages"].items()
                if "ratio" in row
            },
            "scores as expected": result["scores_as_expected"]
            and result["scores_agree_with_baseline"]
            and all(r.get("scores_as_expected", True) for r in result["languages"].values()),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
