"""The sandbox's test forms: reading a sample's ground truth and code, scoring its
cases, and the stand-alone per-case programs for runners without the harness.

Forms: ``check`` (HumanEval ``test`` + ``entry_point``), ``stdin`` (``inputs`` /
``outputs``), ``call`` (the same with ``fn_name``) and ``assert``
(``assert_case``). Shared by the local sandbox (``sandbox.py``) and
SandboxFusion (``sandbox_fusion.py``).
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib.resources
import json
from typing import Any

from stream_reward.errors import ScoringError
from stream_reward.scoring.sandbox.judge import wrapped_outputs
from stream_reward.scoring.sandbox.languages import choose_program
from stream_reward.scoring.scorer import Scored

__all__ = [
    "CASE_STATUSES",
    "WRONG_ANSWER_EXIT",
    "parse_tests",
    "extract_code",
    "no_code",
    "tally",
    "case_script",
]

CASE_STATUSES = ("passed", "failed", "runtime_error", "timeout", "memory", "output_limit")


def _bad(message: str) -> ScoringError:
    return ScoringError(f"ground truth: {message}", reason="bad_tests")


def _text(value: Any, what: str) -> str:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    if not isinstance(value, str):
        raise _bad(f"{what} must be a string, got {type(value).__name__}")
    return value


def parse_tests(ground_truth: Any) -> tuple[str, list[dict[str, Any]]]:
    """Validate a ground-truth test spec; return ``(form, cases)``.

    form is ``check`` (``test`` + ``entry_point``: a function, or ``Class().method``), ``stdin`` (``inputs`` /
    ``outputs``, optional ``abs_tol`` / ``rel_tol`` for its decimals), ``call`` (the same with ``fn_name``) or ``assert``
    (``assert_case``: one case per entry with an ``assert``, the other entries
    prepended to the cases after them). A check or assert case carries the ground
    truth's own ``prompt`` when it has one (the task's code, preferred to the
    trajectory's prompt). Anything else raises
    ScoringError(reason="bad_tests").
    """
    gt = ground_truth
    if isinstance(gt, (bytes, bytearray)):
        gt = gt.decode("utf-8", "replace")
    if isinstance(gt, str):
        try:
            gt = json.loads(gt)
        except ValueError as exc:
            raise _bad(f"not JSON ({exc})") from exc
    if not isinstance(gt, dict):
        raise _bad(f"expected a JSON object, got {type(gt).__name__}")
    prompt = gt.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise _bad(f"'prompt' must be a string, got {type(prompt).__name__}")
    if "test" in gt or ("entry_point" in gt and "assert_case" not in gt):
        test, entry = gt.get("test"), gt.get("entry_point")
        if not isinstance(test, str) or not _entry_point(entry):
            raise _bad("'test' must be code and 'entry_point' an identifier or 'Solution().method'")
        return "check", [_with_prompt({"test": test, "entry_point": entry}, prompt)]
    if "assert_case" in gt:
        asserts = gt["assert_case"]
        if not isinstance(asserts, list) or not asserts or not all(isinstance(a, str) and a.strip() for a in asserts):
            raise _bad("'assert_case' must be a non-empty list of statements")
        entry = gt.get("entry_point")
        if entry is not None and (not isinstance(entry, str) or not entry.isidentifier()):
            raise _bad("'entry_point' must be an identifier")
        return "assert", [_with_prompt(case, prompt) for case in _assert_cases(asserts, entry)]
    if "inputs" in gt or "outputs" in gt:
        inputs, outputs = gt.get("inputs"), gt.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list) or not inputs or len(inputs) != len(outputs):
            raise _bad("'inputs' and 'outputs' must be non-empty lists of the same length")
        fn_name = gt.get("fn_name")
        if fn_name is None:
            tol = _tolerance(gt)
            return "stdin", [
                {"stdin": _text(i, "input"), "stdout": _text(o, "output"), **tol}
                for i, o in zip(inputs, outputs, strict=True)
            ]
        if not isinstance(fn_name, str) or not fn_name.isidentifier():
            raise _bad("'fn_name' must be an identifier")
        if not all(isinstance(args, list) for args in inputs):
            raise _bad("call-based 'inputs' must be lists of arguments")
        try:
            json.dumps([inputs, outputs])
        except (TypeError, ValueError) as exc:
            raise _bad(f"call-based cases are not JSON values ({exc})") from exc
        wrapped = wrapped_outputs(outputs)
        return "call", [
            {"fn_name": fn_name, "args": a, "expected": o, "wrapped": wrapped}
            for a, o in zip(inputs, outputs, strict=True)
        ]
    raise _bad(f"unknown test format (keys: {sorted(map(str, gt))[:8]})")


def _entry_point(entry: Any) -> bool:
    """A function's name, or a method of a fresh instance (LeetCode's ``Solution().twoSum``)."""
    if not isinstance(entry, str):
        return False
    cls, sep, method = entry.partition("().")
    return entry.isidentifier() or (bool(sep) and cls.isidentifier() and method.isidentifier())


def _with_prompt(case: dict[str, Any], prompt: str | None) -> dict[str, Any]:
    return case if prompt is None else {**case, "prompt": prompt}


def _tolerance(gt: dict[str, Any]) -> dict[str, float]:
    """The task's own float tolerance for its stdout (``abs_tol``, ``rel_tol``); none by default."""
    tol = {}
    for key in ("abs_tol", "rel_tol"):
        value = gt.get(key)
        if value is None:
            continue
        if type(value) not in (int, float) or not 0 <= value < float("inf"):
            raise _bad(f"'{key}' must be a finite number >= 0")
        tol[key] = float(value)
    return tol


def _assert_cases(entries: list[str], entry_point: str | None) -> list[dict[str, Any]]:
    """Only an entry with an ``assert`` statement is a case. The others (imports, MBPP's
    setup code, helper definitions) run in front of every later case: counted on their
    own they would pass for any response, a free partial credit.

    A case carries the task's ``entry_point`` when it gives one, or when the asserts
    call only builtins and one of them every time: the test then calls the response's
    function by that name, every other builtin stays one, and no other function of the
    response's may judge what it returns."""
    cases: list[dict[str, Any]] = []
    setup: list[str] = []
    called: list[set[str]] = []
    for entry in entries:
        try:
            tree = ast.parse(entry)
        except SyntaxError as exc:
            # Our tests, not the response: a case failing for every response would be a 0 we caused.
            raise _bad(f"an 'assert_case' entry does not parse ({exc.msg}, line {exc.lineno})") from None
        if _asserts(tree):
            cases.append({"assert": "\n".join([*setup, entry])})
            called.append(
                {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
            )
        else:
            setup.append(entry)
    if not cases:
        raise _bad("'assert_case' has no assert statement")
    if entry_point is None and all(hasattr(builtins, name) for names in called for name in names):
        common = set.intersection(*called)
        entry_point = common.pop() if len(common) == 1 else None
    if entry_point is not None:
        for case in cases:
            case["entry_point"] = entry_point
    return cases


def _asserts(tree: ast.AST) -> bool:
    """An ``assert`` that runs when the entry does: not one inside a definition."""
    todo = list(ast.iter_child_nodes(tree))
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Assert):
            return True
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))
    return False


def extract_code(response: str) -> str | None:
    """The last fenced Python block (```` ``` ```` or ``~~~``), else the last fenced
    block of any kind (``languages.choose_program`` for a task of no language)."""
    chosen = choose_program(response, None)
    return None if chosen is None else chosen[1]


def no_code(cases: list[dict[str, Any]], *, all_or_nothing: bool) -> Scored:
    """A response without code is the policy's wrong answer, not our failure: 0.0."""
    return tally([("failed", "no code block in the response")] * len(cases), all_or_nothing=all_or_nothing)


def tally(results: list[tuple[str, str]], *, all_or_nothing: bool) -> Scored:
    """The sample's score from its cases' ``(status, detail)``: the fraction passed
    (1.0 or 0.0 with ``all_or_nothing``), with ``cases``, ``passed``, ``total`` and
    ``error`` (the first failing case's message, "" when all passed) as extra."""
    statuses = [status for status, _ in results]
    passed = statuses.count("passed")
    total = len(statuses)
    if all_or_nothing:
        score = 1.0 if passed == total else 0.0
    else:
        score = passed / total
    error = next((f"case {i}: {s}: {d}".rstrip(": ") for i, (s, d) in enumerate(results) if s != "passed"), "")
    return Scored(score, {"cases": statuses, "passed": passed, "total": total, "error": error})


WRONG_ANSWER_EXIT = 3  # exit code of case_script() programs whose answer is wrong


def case_script(form: str, program: str, case: dict[str, Any]) -> tuple[str, str]:
    """One stand-alone program + stdin for one case, for runners without the harness
    (remote sandboxes, the benchmark baseline). A wrong answer exits with
    WRONG_ANSWER_EXIT after printing ``wrong answer`` to stderr."""
    if form == "stdin":
        return program, case["stdin"]
    if form == "call":
        # JSON values as Python source, so the script needs no json import.
        check = (
            f"import sys as _sr_sys\n"
            f"_sr_case = {{'a': {_literal(case['args'])}, 'e': {_literal(case['expected'])}}}\n"
            f"_sr_result = _sr_function(globals(), {case['fn_name']!r})(*_sr_case['a'])\n"
            f"if not _sr_same(_sr_result, _sr_case['e'], {bool(case.get('wrapped'))!r}):\n"
            f"    print('wrong answer', file=_sr_sys.stderr); _sr_sys.exit({WRONG_ANSWER_EXIT})\n"
        )
    elif form == "assert":
        check = _assert_wrapper(case["assert"], "pass")
    elif form == "check":
        check = _assert_wrapper(case["test"], f"check({case['entry_point']})")
    else:
        raise ValueError(f"unknown form {form!r}")
    return f"{program}\n\n{_compare_src()}\n{check}", ""


def _literal(value: Any) -> str:
    if isinstance(value, float) and value != value or value in (float("inf"), float("-inf")):
        return f"float({str(value)!r})"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(_literal, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _assert_wrapper(code: str, then: str) -> str:
    return (
        f"import sys as _sr_sys\ntry:\n    exec(compile({code!r}, 'test.py', 'exec'), globals())\n    {then}\n"
        f"except AssertionError:\n    print('wrong answer', file=_sr_sys.stderr); _sr_sys.exit({WRONG_ANSWER_EXIT})\n"
    )


_JUDGE = importlib.resources.files(__package__).joinpath("judge.py").read_text(encoding="utf-8")

_FUNCTION_SRC = """
def _sr_function(g, name):
    fn = g.get(name)
    if fn is None and isinstance(g.get("Solution"), type):
        fn = getattr(g["Solution"](), name, None)
    if fn is None:
        raise NameError(f"the program defines no function {name!r}")
    return fn
"""


@functools.cache
def _compare_src() -> str:
    """The judge's ``_sr_*`` functions, for the stand-alone programs of case_script()."""
    functions = [
        node for node in ast.parse(_JUDGE).body if isinstance(node, ast.FunctionDef) and node.name.startswith("_sr_")
    ]
    return "\n" + "\n\n".join(ast.get_source_segment(_JUDGE, node) or "" for node in functions) + _FUNCTION_SRC
