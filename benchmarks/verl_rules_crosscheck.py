"""Recompute the rule-scorer cases with verl itself and compare with ours.

    python benchmarks/verl_rules_crosscheck.py [--verl-python PATH] [--fuzz N] [--seed S]

Cases come from ``tests/scoring/rules/rules_cases.py`` (the table the unit tests use), plus
``--fuzz N`` seeded random responses per data source, built from the tokens
the rules react to. verl is used in-process when this interpreter can import
it; otherwise ``--verl-python`` (or ``$VERL_PYTHON``) names an interpreter that
can, for example a throwaway venv with ``pip install verl==0.9.1``, and verl
runs there in a subprocess.

Prints ``{"cases": N, "fuzz": M, "verl": VERSION, "mismatches": [...]}`` and
exits 0 when nothing differs, 1 when something does, 2 when verl is not
installed (with a message on stderr saying so).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import random
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CASES_FILE = REPO / "tests" / "scoring" / "rules" / "rules_cases.py"

FUZZ_SOURCES = ("openai/gsm8k", "lighteval/MATH", "HuggingFaceH4/MATH-500", "math_dapo", "aime2024")
FUZZ_TOKENS = (
    "\\boxed{", "\\boxed ", "\\boxed", "\\fbox{", "{", "}", "$", "\\$", "\n", " ", "1", "2", "0.5",
    ".5", ",", "-", "#### ", "####", "Answer:", "answer :", "ANSWER: ", "\\frac", "\\dfrac", "12",
    "\\sqrt", "\\text{ ", "\\text{", "\\textbf{", "\\overline{", "cm", "a ", "=", "k=", "/", "3/4",
    "\\%", "%", "^\\circ", "\\left(", "\\right)", "x", "é", "\\!", "\\\\", "[INVALID]", "{,}",
)  # fmt: skip
FUZZ_TRUTHS = ("1", "2", "12", "-1", "1000", "1,000", "0.5", "\\frac{1}{2}", "3/4", "\\frac{3}{4}", "")

# Runs inside the verl interpreter: JSON [[data_source, solution, truth], ...] on
# stdin, JSON [{"ok": result} | {"raise": "TypeName"}, ...] on stdout. verl prints
# from its scorers, so its stdout goes to stderr while it works.
_CHILD = """
import contextlib, json, sys
with contextlib.redirect_stdout(sys.stderr):
    from importlib.metadata import version
    from verl.utils.reward_score import default_compute_score
    inputs = json.load(sys.stdin)
    out = []
    for ds, sol, gt in inputs:
        try:
            out.append({"ok": default_compute_score(ds, sol, gt)})
        except Exception as exc:
            out.append({"raise": type(exc).__name__})
json.dump({"verl": version("verl"), "results": out}, sys.stdout)
"""


def load_cases() -> list[Any]:
    spec = importlib.util.spec_from_file_location("rules_cases", CASES_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.CASES)


def fuzz_inputs(n: int, seed: int) -> list[tuple[str, str, str]]:
    rng = random.Random(seed)
    inputs = []
    for source in FUZZ_SOURCES:
        for _ in range(n):
            length = rng.choice((3, 10, 40, 150))
            response = "".join(rng.choice(FUZZ_TOKENS) for _ in range(rng.randint(0, length)))
            truth = rng.choice(FUZZ_TRUTHS) if rng.random() < 0.7 else "".join(rng.choices(FUZZ_TOKENS, k=2))
            inputs.append((source, response, truth))
    return inputs


def run_verl_in_process(inputs: list[tuple[str, str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    from importlib.metadata import version

    from verl.utils.reward_score import default_compute_score

    out = []
    with contextlib.redirect_stdout(io.StringIO()):
        for ds, sol, gt in inputs:
            try:
                out.append({"ok": default_compute_score(ds, sol, gt)})
            except Exception as exc:
                out.append({"raise": type(exc).__name__})
    return version("verl"), out


def run_verl_subprocess(python: str, inputs: list[tuple[str, str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    proc = subprocess.run(
        [python, "-c", _CHILD],
        input=json.dumps(inputs),
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{python} could not run verl:\n{proc.stderr[-2000:]}")
    reply = json.loads(proc.stdout)
    return reply["verl"], reply["results"]


def import_rules() -> Any:
    sys.path.insert(0, str(REPO))
    try:
        from stream_reward.scoring import rules
    except ImportError:
        # A verl-only venv lacks redis, aiohttp, ... which stream_reward/__init__
        # imports; the rules need none of them, so skip the package __init__.
        package = types.ModuleType("stream_reward")
        package.__path__ = [str(REPO / "stream_reward")]
        sys.modules["stream_reward"] = package
        from stream_reward.scoring import rules
    return rules


def run_ours(inputs: list[tuple[str, str, Any]]) -> list[dict[str, Any]]:
    compute_score = import_rules().compute_score
    out = []
    for ds, sol, gt in inputs:
        try:
            out.append({"ok": compute_score(ds, sol, gt)})
        except Exception as exc:
            out.append({"raise": type(exc).__name__})
    return out


def same(a: Any, b: Any) -> bool:
    """Equal values of the same types (a 1 is not a 1.0, a True is not a 1.0)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--verl-python", default=os.environ.get("VERL_PYTHON"), help="an interpreter that can import verl"
    )
    parser.add_argument("--fuzz", type=int, default=2000, help="random responses per data source (default 2000)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    cases = load_cases()
    labels = [c.id for c in cases] + [f"fuzz-{i}" for i in range(args.fuzz * len(FUZZ_SOURCES))]
    inputs = [(c.data_source, c.solution_str, c.ground_truth) for c in cases] + fuzz_inputs(args.fuzz, args.seed)

    if importlib.util.find_spec("verl") is not None:
        verl_version, theirs = run_verl_in_process(inputs)
    elif args.verl_python:
        verl_version, theirs = run_verl_subprocess(args.verl_python, inputs)
    else:
        print(
            "verl not installed: this interpreter cannot import verl; install it (pip install verl==0.9.1) "
            "or point --verl-python / $VERL_PYTHON at an interpreter that can",
            file=sys.stderr,
        )
        return 2

    ours = run_ours(inputs)
    mismatches = []
    for label, (ds, sol, gt), verl_out, our_out in zip(labels, inputs, theirs, ours):
        # Both raising counts as agreement; the error types may differ (verl asserts).
        if ("raise" in verl_out and "raise" in our_out) or same(verl_out.get("ok"), our_out.get("ok")):
            continue
        mismatches.append(
            {"id": label, "data_source": ds, "solution_str": sol, "ground_truth": gt, "verl": verl_out, "ours": our_out}
        )
    stale = [c.id for c, verl_out in zip(cases, theirs) if "raise" in verl_out or not same(c.expected, verl_out["ok"])]
    report = {"cases": len(cases), "fuzz": len(inputs) - len(cases), "verl": verl_version, "mismatches": mismatches}
    if stale:
        report["stale_expected"] = stale  # the table's recorded outputs disagree with this verl
    print(json.dumps(report, indent=2, ensure_ascii=False))
    return 1 if mismatches or stale else 0


if __name__ == "__main__":
    sys.exit(main())
