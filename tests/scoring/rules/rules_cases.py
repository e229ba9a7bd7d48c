"""The rule-scorer case table, with verl 0.9.1's outputs for each case.

One table for two readers: ``tests/scoring/rules/test_rules.py`` checks ``stream_reward.scoring.rules``
against ``expected`` (verl is not a dependency), and
``benchmarks/verl_rules_crosscheck.py`` recomputes every case with verl itself.
``expected`` was recorded from ``verl.utils.reward_score.default_compute_score``
(verl 0.9.1); change it only by rerunning the crosscheck against verl.

Pure data on purpose: no project imports, so any interpreter can load it by path.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["Case", "CASES"]


class Case(NamedTuple):
    id: str
    data_source: str
    solution_str: str
    ground_truth: Any
    expected: Any  # float, or the math_dapo dict {"score", "acc", "pred"}


G = "openai/gsm8k"
M = "lighteval/MATH"
ML = "DigitalLearningGmbH/MATH-lighteval"
M5 = "HuggingFaceH4/MATH-500"
D = "math_dapo"

CASES: list[Case] = [
    # openai/gsm8k: strict "#### <number>" in the last 300 characters, compared as strings
    Case("gsm8k-strict-correct", G, "She sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0),
    Case("gsm8k-strict-wrong", G, "#### 71", "72", 0.0),
    Case("gsm8k-comma-thousands", G, "#### 1,000", "1000", 1.0),
    Case("gsm8k-comma-and-decimal", G, "#### 1,234.5", "1234.5", 1.0),
    Case("gsm8k-dollar-before-number", G, "#### $1000", "1000", 0.0),
    Case("gsm8k-negative", G, "#### -5", "-5", 1.0),
    Case("gsm8k-decimal-not-normalized", G, "#### 2.50", "2.5", 0.0),
    Case("gsm8k-trailing-period", G, "The answer is\n#### 72.", "72", 0.0),
    Case("gsm8k-missing-hashes", G, "The answer is 72", "72", 0.0),
    Case("gsm8k-no-space-after-hashes", G, "####72", "72", 0.0),
    Case("gsm8k-two-spaces-after-hashes", G, "####  72", "72", 0.0),
    Case("gsm8k-last-of-several", G, "#### 5\nwait, recompute\n#### 72", "72", 1.0),
    Case("gsm8k-answer-before-tail", G, "#### 72\n" + "and that is final. " * 20, "72", 0.0),
    Case("gsm8k-answer-at-tail-start", G, "#### 72" + "x" * 293, "72", 1.0),
    Case("gsm8k-hashes-cut-by-tail", G, "#### 72" + "x" * 294, "72", 0.0),
    Case("gsm8k-empty-response", G, "", "72", 0.0),
    Case("gsm8k-int-ground-truth", G, "#### 72", 72, 0.0),
    Case("gsm8k-boxed-ignored", G, "\\boxed{72}", "72", 0.0),
    Case("gsm8k-number-then-text", G, "#### 72 dollars", "72", 1.0),
    Case("gsm8k-leading-zero", G, "#### 072", "72", 0.0),
    # MATH sources: the last \boxed{...} (brace matched), strip_string, string equality
    Case("math-boxed-int", M, "So the total is $\\boxed{5}$.", "5", 1.0),
    Case("math-nested-braces", M, "Thus $x = \\boxed{\\frac{1}{2}}$", "\\frac{1}{2}", 1.0),
    Case("math-dfrac-vs-frac", M, "\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),
    Case("math-tfrac-and-inverse-space", M5, "\\boxed{\\tfrac{1}{2}\\!}", "\\frac{1}{2}", 1.0),
    Case("math-half-decimal", M, "\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    Case("math-half-leading-dot", M, "\\boxed{.5}", "\\frac12", 1.0),
    Case("math-quarter-decimal", M, "\\boxed{0.25}", "\\frac{1}{4}", 0.0),
    Case("math-frac-shorthand", ML, "\\boxed{\\frac12}", "\\frac{1}{2}", 1.0),
    Case("math-a-slash-b", M, "\\boxed{3/4}", "\\frac{3}{4}", 1.0),
    Case("math-negative-slash", M, "\\boxed{-1/2}", "-\\frac{1}{2}", 0.0),
    Case("math-fbox", M, "\\fbox{5}", "5", 0.0),
    Case("math-boxed-then-fbox", M, "\\boxed{4} or \\fbox{5}", "4", 1.0),
    Case("math-boxed-space", M, "so the answer is $\\boxed 5$.", "5", 1.0),
    Case("math-boxed-space-wins", M5, "\\boxed 3 is wrong, so \\boxed{5}", "5", 0.0),
    Case("math-last-boxed-wins", M, "\\boxed{3}, no: \\boxed{5}", "5", 1.0),
    Case("math-unclosed-box", M, "\\boxed{5", "5", 0.0),
    Case("math-boxed-without-brace", M, "\\boxed\\frac{1}{2}", "\\frac{1}{2}", 0.0),
    Case("math-empty-box", M, "\\boxed{}", "", 1.0),
    Case("math-text-unit", M, "\\boxed{5 \\text{ cm}}", "5", 1.0),
    Case("math-two-units-raw-compare", M, "\\boxed{5\\text{ cm}\\text{ m}}", "5\\text{ cm}\\text{ m}", 1.0),
    Case("math-two-units-mismatch", M, "\\boxed{5\\text{ cm}\\text{ m}}", "5", 0.0),
    Case("math-text-choice", M, "\\boxed{\\text{(B)}}", "\\text{(B)}", 1.0),
    Case("math-text-choice-vs-letter", M, "\\boxed{\\text{(B)}}", "B", 0.0),
    Case("math-percent-escaped", M, "\\boxed{50\\%}", "50", 1.0),
    Case("math-percent-bare", M, "\\boxed{50%}", "50", 0.0),
    Case("math-degrees", M, "\\boxed{90^\\circ}", "90", 1.0),
    Case("math-dollar-sign", M, "\\boxed{\\$18.90}", "18.90", 1.0),
    Case("math-left-right", M, "\\boxed{\\left( 3, 4 \\right)}", "(3,4)", 1.0),
    Case("math-short-lhs-dropped", M, "\\boxed{k = 7}", "7", 1.0),
    Case("math-long-lhs-kept", M, "\\boxed{xyz = 7}", "7", 0.0),
    Case("math-sqrt-shorthand", M, "\\boxed{2\\sqrt3}", "2\\sqrt{3}", 1.0),
    Case("math-trailing-sqrt-raw-compare", M, "\\boxed{\\sqrt}", "\\sqrt", 1.0),
    Case("math-comma-thousands", M, "\\boxed{1,000}", "1000", 0.0),
    Case("math-no-box", M, "The answer is 5", "5", 0.0),
    Case("math-empty-response", M, "", "5", 0.0),
    Case("math-none-ground-truth", M, "\\boxed{5}", None, 0.0),
    Case("math-int-ground-truth", M, "\\boxed{5}", 5, 0.0),
    Case("math-answer-far-from-end", M5, "\\boxed{42}" + " and more text" * 100, "42", 1.0),
    Case("math-newline-inside-box", M, "\\boxed{1\n2}", "12", 1.0),
    # math_dapo, math, math_dapo_reasoning, aime*: the last "Answer:" line in the last 300
    # characters, normalized; failing that the last \boxed{} of the last 100, compared raw
    Case("dapo-answer-int", D, "Let me think.\nAnswer: 34", "34", {"score": 1.0, "acc": True, "pred": "34"}),
    Case("dapo-answer-wrong", D, "Answer: 35", "34", {"score": -1.0, "acc": False, "pred": "35"}),
    Case("dapo-answer-case-insensitive", "aime2024", "ANSWER : 34", "34", {"score": 1.0, "acc": True, "pred": "34"}),
    Case("dapo-answer-newline-after-colon", D, "Answer:\n34", "34", {"score": 1.0, "acc": True, "pred": "34"}),
    Case("dapo-answer-boxed", "aime_2025", "Answer: \\boxed{34}", "34", {"score": 1.0, "acc": True, "pred": "34"}),
    Case(
        "dapo-answer-dollars",
        D,
        "Answer: $\\frac{1}{2}$",
        "\\frac{1}{2}",
        {"score": 1.0, "acc": True, "pred": "\\frac{1}{2}"},
    ),
    Case(
        "dapo-answer-frac-shorthand",
        D,
        "Answer: \\frac12",
        "\\frac{1}{2}",
        {"score": 1.0, "acc": True, "pred": "\\frac{1}{2}"},
    ),
    Case(
        "dapo-answer-dfrac-not-normalized",
        D,
        "Answer: \\dfrac{1}{2}",
        "\\frac{1}{2}",
        {"score": -1.0, "acc": False, "pred": "\\dfrac{1}{2}"},
    ),
    Case("dapo-answer-decimal-vs-frac", D, "Answer: 0.5", "\\frac{1}{2}", {"score": -1.0, "acc": False, "pred": "0.5"}),
    Case("dapo-answer-units", D, "Answer: 12 inches", "12", {"score": 1.0, "acc": True, "pred": "12"}),
    Case("dapo-answer-commas", D, "Answer: 1,000", "1000", {"score": 1.0, "acc": True, "pred": "1000"}),
    Case("dapo-answer-equation", D, "Answer: x = 5", "5", {"score": 1.0, "acc": True, "pred": "5"}),
    Case("dapo-answer-negative", D, "Answer: -3", "-3", {"score": 1.0, "acc": True, "pred": "-3"}),
    Case("dapo-answer-trailing-period", D, "Answer: 34.", "34", {"score": -1.0, "acc": False, "pred": "34."}),
    Case("dapo-answer-text", D, "Answer: \\text{(C)}", "(C)", {"score": 1.0, "acc": True, "pred": "(C)"}),
    Case("dapo-last-answer-wins", D, "Answer: 3\nAnswer: 5", "5", {"score": 1.0, "acc": True, "pred": "5"}),
    Case(
        "dapo-answer-before-tail",
        D,
        "Answer: 34\n" + "y" * 300,
        "34",
        {"score": -1.0, "acc": False, "pred": "[INVALID]"},
    ),
    Case("dapo-ground-truth-dollars", D, "Answer: 34", "$34$", {"score": 1.0, "acc": True, "pred": "34"}),
    Case(
        "dapo-box-fallback-correct",
        D,
        "so the result is \\boxed{34}",
        "34",
        {"score": 1.0, "acc": True, "pred": "34"},
    ),
    Case("dapo-box-fallback-raw-compare", D, "\\boxed{ 34}", "34", {"score": -1.0, "acc": False, "pred": " 34"}),
    Case(
        "dapo-box-fallback-nested",
        "math",
        "\\boxed{\\frac{1}{2}}",
        "\\frac{1}{2}",
        {"score": 1.0, "acc": True, "pred": "\\frac{1}{2}"},
    ),
    Case(
        "dapo-box-before-last-100",
        D,
        "\\boxed{34}" + "x" * 120,
        "34",
        {"score": -1.0, "acc": False, "pred": "[INVALID]"},
    ),
    Case("dapo-box-unclosed", D, "\\boxed{34", "34", {"score": -1.0, "acc": False, "pred": "[INVALID]"}),
    Case("dapo-fbox-ignored", D, "\\fbox{34}", "34", {"score": -1.0, "acc": False, "pred": "[INVALID]"}),
    Case(
        "dapo-literal-invalid-answer",
        "math_dapo_reasoning",
        "Answer: [INVALID]\n\\boxed{34}",
        "34",
        {"score": 1.0, "acc": True, "pred": "34"},
    ),
    Case("dapo-no-answer", D, "I do not know.", "34", {"score": -1.0, "acc": False, "pred": "[INVALID]"}),
    Case("dapo-empty-response", "aime", "", "34", {"score": -1.0, "acc": False, "pred": "[INVALID]"}),
]

# Where ``compute_score`` deliberately differs from verl (never a silent 0
# because of a type): a numeric ground truth compares as its string form, and one
# that is neither a string nor a number fails its sample with this reason. The rule
# functions themselves (``rule_for``) keep verl's output above.
OURS: dict[str, Any] = {
    "gsm8k-int-ground-truth": 1.0,
    "math-int-ground-truth": 1.0,
    "math-none-ground-truth": "bad_ground_truth",
}
