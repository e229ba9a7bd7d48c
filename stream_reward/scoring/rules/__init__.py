"""Rule scorers for verl's built-in math data sources, score for score.

verl 0.9.1's ``default_compute_score`` is the reference: a run that moves its
reward onto stream-reward must see the same rewards, so these functions keep
verl's behaviour *including its quirks* (each is marked ``verl quirk:`` below
and pinned by ``tests/scoring/rules/test_rules.py``). What differs is speed and safety: they
run inline on a worker's event loop, so every step is linear in the input and
fast on megabyte-long responses, where verl walks strings one character at a
time in Python.

Routing by ``data_source`` (as verl does it)::

    openai/gsm8k                                   gsm8k_score      -> float
    lighteval/MATH, DigitalLearningGmbH/MATH-lighteval,
    HuggingFaceH4/MATH-500                         math_score       -> float
    math_dapo, math, math_dapo_reasoning, aime*    math_dapo_score  -> dict(score, acc, pred)

Any other ``data_source`` raises ``UnknownDataSourceError``. ``compute_score``
takes a numeric ground truth as its string form and refuses other types with
reason ``bad_ground_truth`` (see ``ground_truth_text``); the rule functions
themselves keep verl's string comparison.
"""

from __future__ import annotations

import logging
import math
import re
from array import array
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

from stream_reward.errors import ScoringError, UnknownDataSourceError

__all__ = [
    "GSM8K_SOURCES",
    "MATH_SOURCES",
    "MATH_DAPO_SOURCES",
    "KNOWN_SOURCES",
    "KNOWN_PREFIXES",
    "is_known_source",
    "rule_for",
    "compute_score",
    "gsm8k_score",
    "extract_gsm8k_answer",
    "math_score",
    "last_boxed_only_string",
    "remove_boxed",
    "strip_string",
    "is_equiv",
    "math_dapo_score",
    "normalize_final_answer",
]

logger = logging.getLogger(__name__)

GSM8K_SOURCES = ("openai/gsm8k",)
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
MATH_DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")
KNOWN_SOURCES = GSM8K_SOURCES + MATH_SOURCES + MATH_DAPO_SOURCES
# verl sends every data_source starting with "aime" (aime2024, aime_2025, ...) to math_dapo.
KNOWN_PREFIXES = ("aime",)


# --------------------------------------------------------------------------- GSM8K

# verl only looks at the tail of a GSM8K response ("300 chars ~ 300 tokens").
# verl quirk: an answer that ends earlier than that is not seen at all.
GSM8K_TAIL_CHARS = 300
# verl quirk: exactly one space after "####"; "-" only in front; "," and "." anywhere.
_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_GSM8K_FLEXIBLE = re.compile(r"(\-?[0-9\.\,]+)")


def extract_gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """The answer verl's gsm8k scorer reads from a response, or None.

    ``strict``: the last ``#### <number>`` in the tail, commas removed.
    ``flexible``: the last number-like run in the tail, commas *kept* (verl quirk).
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', not {method!r}")
    tail = solution_str[-GSM8K_TAIL_CHARS:]
    if method == "strict":
        found = _GSM8K_STRICT.findall(tail)
        # verl also strips "$", which the pattern can never capture.
        return found[-1].replace(",", "").replace("$", "") if found else None
    found = _GSM8K_FLEXIBLE.findall(tail)
    if not found:
        return None
    # The last run that is not a lone "."; verl quirk: when every run is ".",
    # its loop variable is left on the first one, so "." is the answer.
    return next((run for run in reversed(found) if run != "."), found[0])


def gsm8k_score(
    solution_str: str,
    ground_truth: Any,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """verl's gsm8k.compute_score: ``score`` when the extracted answer equals the
    ground truth *as a string*, ``format_score`` when an answer was found but is
    wrong, 0.0 when none was found. verl's dispatcher passes only the defaults."""
    answer = extract_gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    # verl quirk: plain string equality, so "18.0" != "18" and an int ground truth never matches.
    return float(score) if answer == ground_truth else float(format_score)


# ------------------------------------------------------------------ brace matching

# Brace depth over UTF-8 bytes ("{" and "}" never occur inside a multi-byte
# character, so byte offsets are safe cut points).
_STEP = bytes(1 if b == 0x7B else 0xFF if b == 0x7D else 0 for b in range(256))  # +1 / -1 as signed chars
_NOT_BRACE = bytes(b for b in range(256) if b not in (0x7B, 0x7D))


def _closing_offset(raw: bytes) -> int | None:
    """Offset of the first "}" that brings the brace depth, counted from raw[0], to zero.

    That is verl's character loop (depth may go negative first; only a "}" that
    lands on exactly zero counts). Whole windows are ruled out with C-level
    counts and prefix sums; the Python loop runs on at most two windows: the
    one where the depth first climbs to 1 and the one where it drops back to 0
    (once at 1 or more it can only get back to 0 through the hit itself).
    """
    depth = 0
    lo, size, n = 0, 256, len(raw)  # small first window: the common answer closes early
    while lo < n:
        window = raw[lo : lo + size]
        if not _may_cross(window, depth):
            depth += window.count(b"{") - window.count(b"}")
        else:
            for i, byte in enumerate(window):
                if byte == 0x7B:
                    depth += 1
                elif byte == 0x7D:
                    depth -= 1
                    if depth == 0:
                        return lo + i
        lo += size
        size = min(size * 2, 8192)
    return None


def _may_cross(window: bytes, depth: int) -> bool:
    """False when the depth provably stays >= 1 (if it starts >= 1) or <= 0 (if it
    starts <= 0) across ``window``: then the window holds no hit and no climb."""
    braces = window.translate(None, _NOT_BRACE)
    if depth >= 1:
        # Dropping adjacent "{}" keeps the lowest running depth; what is left
        # cannot go lower than depth - (its "}" count).
        for _ in range(3):
            if depth - braces.count(b"}") >= 1:
                return False
            shorter = braces.replace(b"{}", b"")
            if len(shorter) == len(braces):
                break
            braces = shorter
    else:
        # Mirror image: dropping "}{" keeps the highest running depth.
        for _ in range(3):
            if depth + braces.count(b"{") <= 0:
                return False
            shorter = braces.replace(b"}{", b"")
            if len(shorter) == len(braces):
                break
            braces = shorter
    # Exact answer from the running sums (C speed, no per-character bytecode).
    steps = array("b")
    steps.frombytes(braces.translate(_STEP))
    if depth >= 1:
        return depth + min(accumulate(steps), default=0) <= 0
    return depth + max(accumulate(steps), default=0) >= 1


def _braced_span(string: str, start: int) -> str | None:
    """``string[start : i + 1]`` for the brace that closes at depth zero, as verl's loop finds it."""
    raw = string[start:].encode("utf-8", "surrogatepass")
    end = _closing_offset(raw)
    return None if end is None else raw[: end + 1].decode("utf-8", "surrogatepass")


# ---------------------------------------------------------------- MATH (math_reward)


def last_boxed_only_string(string: str) -> str | None:
    """The last ``\\boxed{...}`` (or ``\\fbox{...}``) of a response, as verl's math_reward finds it."""
    if "\\boxed " in string:
        # verl quirk: once "\boxed " (with a space) appears anywhere, the answer is
        # whatever follows its last occurrence up to the next "$", even when a
        # \boxed{...} comes later.
        return "\\boxed " + string.rpartition("\\boxed ")[2].partition("$")[0]
    idx = string.rfind("\\boxed")
    if idx < 0:
        idx = string.rfind("\\fbox")
        if idx < 0:
            return None
    return _braced_span(string, idx)


def remove_boxed(s: str) -> str:
    """The content of ``\\boxed{...}`` or ``\\boxed ...``; ValueError for anything else.

    verl quirk: that includes ``\\fbox{...}``, which ``last_boxed_only_string``
    returns and this rejects, so an fbox answer always scores 0.
    """
    if "\\boxed " in s:
        if not s.startswith("\\boxed "):
            raise ValueError(f"not a \\boxed answer: {s[:80]!r}")
        return s[len("\\boxed ") :]
    if not (s.startswith("\\boxed{") and s.endswith("}")):
        raise ValueError(f"not a \\boxed{{}} answer: {s[:80]!r}")
    return s[len("\\boxed{") : -1]


def math_score(solution_str: str, ground_truth: Any) -> float:
    """verl's math_reward.compute_score: 1.0 when the last boxed answer is
    equivalent to the ground truth after ``strip_string``, else 0.0."""
    try:
        boxed = last_boxed_only_string(solution_str)
        if boxed is not None and is_equiv(remove_boxed(boxed), ground_truth):
            return 1.0
    except Exception as exc:  # verl prints the error and scores 0.0; we log it
        logger.debug("math_score: unusable answer (%s), scored 0", exc)
    return 0.0


def is_equiv(str1: Any, str2: Any) -> bool:
    """Equal after ``strip_string``; plain equality when normalizing either one fails."""
    if str1 is None and str2 is None:
        return True
    if str1 is None or str2 is None:
        return False
    try:
        return strip_string(str1) == strip_string(str2)
    except Exception:
        # verl quirk: e.g. two "\text{ " units, or a trailing "\sqrt", make
        # strip_string raise, and then the raw strings are compared.
        return str1 == str2


def strip_string(string: str) -> str:
    """The MATH answer normalization (hendrycks_math / lm-eval-harness) verl uses.

    The order of the steps matters and is verl's. Raises on some inputs (see
    ``is_equiv``)."""
    string = string.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    string = string.replace("tfrac", "frac").replace("dfrac", "frac")
    string = string.replace("\\left", "").replace("\\right", "")
    string = string.replace("^{\\circ}", "").replace("^\\circ", "")
    string = string.replace("\\$", "")
    string = _remove_right_units(string)
    # verl quirk: only an escaped "\%" goes; a bare "%" stays, so "50%" != "50".
    string = string.replace("\\\\%", "").replace("\\%", "")
    string = string.replace(" .", " 0.").replace("{.", "{0.")
    if not string:
        return string
    if string[0] == ".":
        string = "0" + string
    # "k = 5" -> " 5": drop a short left-hand side of a single "=".
    lhs, eq, rhs = string.partition("=")
    if eq and "=" not in rhs and len(lhs) <= 2:
        string = rhs
    string = _fix_sqrt(string)
    string = string.replace(" ", "")
    string = _fix_fracs(string)
    # verl quirk: only the exact string "0.5" becomes a fraction (not 0.25, not .5 after a sign).
    if string == "0.5":
        string = "\\frac{1}{2}"
    return _fix_a_slash_b(string)


def _remove_right_units(string: str) -> str:
    # "\text{ " (with the space) only ever introduces units in MATH.
    if "\\text{ " not in string:
        return string
    head, _, tail = string.partition("\\text{ ")
    if "\\text{ " in tail:
        raise ValueError("more than one '\\text{ ' unit")
    return head


def _fix_sqrt(string: str) -> str:
    """\\sqrt3 -> \\sqrt{3}.

    verl quirk: an empty piece (a trailing "\\sqrt", or "\\sqrt\\sqrt") raises
    IndexError, so ``is_equiv`` falls back to comparing the raw strings.
    """
    if "\\sqrt" not in string:
        return string
    head, *pieces = string.split("\\sqrt")
    out = [head]  # joined once at the end: no quadratic string building
    for piece in pieces:
        if piece[0] != "{":
            out.append("\\sqrt{" + piece[0] + "}" + piece[1:])
        else:
            out.append("\\sqrt" + piece)
    return "".join(out)


def _fix_fracs(string: str) -> str:
    """\\frac12 -> \\frac{1}{2}, \\frac1{72} -> \\frac{1}{72}; \\frac{..} stays.

    verl quirks, decided by the first short piece: an empty one (a trailing
    "\\frac") raises IndexError; a single character other than "{" returns the
    input unchanged.
    """
    head, *pieces = string.split("\\frac")
    out = [head]
    for piece in pieces:
        out.append("\\frac")
        if piece[0] == "{":
            out.append(piece)
            continue
        if len(piece) < 2:
            return string
        a, b, rest = piece[0], piece[1], piece[2:]
        if b != "{":
            out.append("{" + a + "}{" + b + "}" + rest)
        else:
            out.append("{" + a + "}" + b + rest)
    return "".join(out)


def _fix_a_slash_b(string: str) -> str:
    """Turn "3/4" into "\\frac{3}{4}" when both sides are plain integers, written canonically."""
    a, sep, b = string.partition("/")
    if not sep or "/" in b:
        return string
    try:
        # int() accepts "+3", " 3", "3_0" and more; the round trip rejects them all.
        num, den = int(a), int(b)
    except ValueError:
        return string
    if string != f"{num}/{den}":
        return string
    return "\\frac{" + str(num) + "}{" + str(den) + "}"


# ---------------------------------------------------------------------- math_dapo

# verl clips the response to its tail; "the longest answer in MATH-500 has 159 characters".
DAPO_TAIL_CHARS = 300
DAPO_BOX_TAIL_CHARS = 100
_INVALID = "[INVALID]"
_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# Minerva normalization (Lewkowycz et al. 2022), in verl's order.
_SUBSTITUTIONS = (
    # verl quirk: "an " and "a " go anywhere they occur, e.g. "banana " -> "banan".
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_REMOVED_EXPRESSIONS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units",
    "\\ldots", "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm",
    "gm", "pounds", "meters", "meals", "edges", "students", "childrentickets",
    "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
    "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!",
    "{,}", '"', "\\dots",
)  # fmt: skip
# Fixed-width patterns: linear, kept as verl wrote them.
_FRAC_SHORTHAND = re.compile(r"(frac)([^{])(.)")
_SQRT_SHORTHAND = re.compile(r"(sqrt)([^{])")


def normalize_final_answer(final_answer: str) -> str:
    """verl's math_dapo normalization of an ``Answer:`` line (and of the ground truth)."""
    final_answer = final_answer.rpartition("=")[2]
    for before, after in _SUBSTITUTIONS:
        final_answer = final_answer.replace(before, after)
    for expr in _REMOVED_EXPRESSIONS:
        final_answer = final_answer.replace(expr, "")
    # verl does these five with backtracking regexes (quadratic on long lines);
    # the helpers below compute the same substitutions in linear time.
    final_answer = _first_dollar_pair(final_answer)
    final_answer = _unwrap(final_answer, "\\text{", last_close=False)
    final_answer = _unwrap(final_answer, "\\textbf{", last_close=False)
    final_answer = _unwrap(final_answer, "\\overline{", last_close=False)
    final_answer = _unwrap(final_answer, "\\boxed{", last_close=True)
    final_answer = _FRAC_SHORTHAND.sub("frac{\\2}{\\3}", final_answer)  # \fracab -> \frac{a}{b}
    final_answer = _SQRT_SHORTHAND.sub("sqrt{\\2}", final_answer)  # \sqrta -> \sqrt{a}
    final_answer = final_answer.replace("$", "")
    if final_answer.replace(",", "").isdigit():
        final_answer = final_answer.replace(",", "")
    return final_answer.strip()


def _first_dollar_pair(text: str) -> str:
    """``re.sub(r"(.*?)(\\$)(.*?)(\\$)(.*)", "$\\3$", text)``: every line holding two
    "$" becomes ``$<text between its first two "$">$`` ("." stops at newlines)."""
    if text.count("$") < 2:
        return text
    lines = text.split("\n")
    for i, line in enumerate(lines):
        first = line.find("$")
        second = line.find("$", first + 1) if first >= 0 else -1
        if second >= 0:
            lines[i] = "$" + line[first + 1 : second] + "$"
    return "\n".join(lines)


def _unwrap(text: str, opener: str, *, last_close: bool) -> str:
    """``re.sub(re.escape(opener) + "(.*?)}", r"\\1", text)`` (or ``(.*)}`` with
    ``last_close``): drop the opener and the first (last) "}" after it on the same line."""
    out: list[str] = []
    pos = 0  # text[:pos] is settled
    line_end = -1  # end of the line holding `start`, reused while still ahead of it
    start = text.find(opener)
    while start >= 0:
        inner = start + len(opener)
        if line_end < inner:
            line_end = text.find("\n", inner)
            if line_end < 0:
                line_end = len(text)
        close = text.rfind("}", inner, line_end) if last_close else text.find("}", inner, line_end)
        if close < 0:
            # Any later opener on this line fails the same way: skip the line.
            start = text.find(opener, line_end)
            continue
        out.append(text[pos:start])
        out.append(text[inner:close])
        pos = close + 1
        start = text.find(opener, pos)
    out.append(text[pos:])
    return "".join(out)


def _boxed_content(text: str) -> str | None:
    """math_dapo's box reader: only ``\\boxed{`` counts (no ``\\fbox``, no ``\\boxed ``)."""
    idx = text.rfind("\\boxed{")
    if idx < 0:
        return None
    span = _braced_span(text, idx)
    return None if span is None else span[len("\\boxed{") : -1]


def _minerva_check(solution: str, ground_truth: str) -> tuple[bool, str]:
    if not isinstance(ground_truth, str):
        # verl crashes here with an AttributeError; say what is wrong instead.
        raise ScoringError(
            f"math_dapo needs a str ground_truth, got {type(ground_truth).__name__}", reason="bad_ground_truth"
        )
    found = _ANSWER.findall(solution)
    pred = normalize_final_answer(found[-1] if found else _INVALID)
    return pred == normalize_final_answer(ground_truth), pred


def _strict_box_check(
    solution: str, ground_truth: Any, pause_tokens_index: Sequence[int] | None
) -> tuple[bool, str | None]:
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != 4:
            raise ValueError("pause_tokens_index must hold 4 indices")
        # verl quirk: an index below 100 gives a negative start, i.e. a tail slice.
        solution = solution[pause_tokens_index[-1] - DAPO_BOX_TAIL_CHARS :]
    else:
        solution = solution[-DAPO_BOX_TAIL_CHARS:]
    pred = _boxed_content(solution)
    # verl quirk: the boxed answer is compared raw, without normalize_final_answer.
    return pred == ground_truth, pred


def math_dapo_score(
    solution_str: str,
    ground_truth: str,
    strict_box_verify: bool = False,
    pause_tokens_index: Sequence[int] | None = None,
) -> dict[str, Any]:
    """verl's math_dapo.compute_score: ``{"score": +1.0 | -1.0, "acc": bool, "pred": str}``.

    The last ``Answer: ...`` line of the response's last 300 characters is
    normalized and compared with the normalized ground truth. Only when there is
    no such line is the last ``\\boxed{...}`` of the final 100 characters used,
    compared raw. ``strict_box_verify`` uses only the box (``pred`` may be None).
    A ground truth that is not a str raises ScoringError ("bad_ground_truth")
    where verl raises AttributeError.
    """
    solution = solution_str[-DAPO_TAIL_CHARS:]
    if strict_box_verify:
        correct, pred = _strict_box_check(solution, ground_truth, pause_tokens_index)
    else:
        correct, pred = _minerva_check(solution, ground_truth)
        # verl quirk: a response that literally says "Answer: [INVALID]" counts as
        # having no Answer line.
        if pred == _INVALID:
            box_correct, box_pred = _strict_box_check(solution, ground_truth, pause_tokens_index)
            if box_pred is not None:
                correct, pred = box_correct, box_pred
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


# ----------------------------------------------------------------------- dispatch

_BY_SOURCE: dict[str, Callable[[str, Any], float | dict[str, Any]]] = {
    **dict.fromkeys(GSM8K_SOURCES, gsm8k_score),
    **dict.fromkeys(MATH_SOURCES, math_score),
    **dict.fromkeys(MATH_DAPO_SOURCES, math_dapo_score),
}


def is_known_source(data_source: object) -> bool:
    """True when ``compute_score`` has a rule for ``data_source``."""
    return isinstance(data_source, str) and (data_source in _BY_SOURCE or data_source.startswith(KNOWN_PREFIXES))


def rule_for(data_source: str) -> Callable[[str, Any], float | dict[str, Any]]:
    """The rule function verl uses for ``data_source``; UnknownDataSourceError if none."""
    if isinstance(data_source, str):
        rule = _BY_SOURCE.get(data_source)
        if rule is not None:
            return rule
        if data_source.startswith(KNOWN_PREFIXES):
            return math_dapo_score
    raise UnknownDataSourceError(
        f"no rule scorer for data_source {data_source!r}; known: {', '.join(KNOWN_SOURCES)}, "
        f"and any name starting with {' or '.join(map(repr, KNOWN_PREFIXES))}"
    )


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> float | dict[str, Any]:
    """verl's ``default_compute_score`` for the rule data sources.

    A float for gsm8k and the MATH sources, a dict with "score", "acc" and
    "pred" for math_dapo / aime*. ``extra_info`` and extra keyword arguments
    (verl's sandbox settings, reward kwargs) are accepted and ignored, as verl does.
    """
    return rule_for(data_source)(solution_str, ground_truth_text(ground_truth))


def ground_truth_text(ground_truth: Any) -> str:
    """The ground truth as the rules compare it: a string, as verl's data files store it.

    verl compares answers as strings, so an int ground truth (a dataset loaded
    with numeric columns) would never match and silently score 0. Here a number
    compares as its string form: ``72 -> "72"``, an integral float ``72.0 -> "72"``
    (a response says 72, not 72.0), any other float ``str(x)``. Anything else (None,
    bool, a list or dict) fails the sample with reason ``bad_ground_truth``.
    """
    if isinstance(ground_truth, str):
        return ground_truth
    if type(ground_truth) is int:
        return str(ground_truth)
    if type(ground_truth) is float and math.isfinite(ground_truth):
        return str(int(ground_truth)) if ground_truth.is_integer() else str(ground_truth)
    raise ScoringError(
        f"ground_truth must be a string or a number, got {type(ground_truth).__name__}", reason="bad_ground_truth"
    )
