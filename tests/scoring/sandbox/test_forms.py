"""The sandbox's test forms, no sandbox needed: the code block a response is scored on,
the four ground-truth forms (``stdin``, ``call``, ``assert``, ``check``) and every
malformed one (a ``bad_tests`` scoring error, never a score), and the stand-alone
per-case programs remote runners use, which judge as the harness does."""

from __future__ import annotations

import pytest

from stream_reward.errors import ScoringError
from stream_reward.scoring.sandbox.forms import case_script, extract_code, parse_tests


def test_extract_code_prefers_last_python_block():
    text = "```python\na = 1\n```\ntext\n```py\nb = 2\n```\n```text\nnot code\n```"
    assert extract_code(text) == "b = 2\n"
    assert extract_code("```\nx = 1\n```\n```bash\nls\n```") == "ls\n"
    assert extract_code("no code here") is None
    assert extract_code("```python\n   \n```") is None


def test_parse_tests_forms():
    assert parse_tests('{"inputs": ["1"], "outputs": ["2"]}') == ("stdin", [{"stdin": "1", "stdout": "2"}])
    assert parse_tests({"inputs": [["a", "b"]], "outputs": [["c"]]})[1] == [{"stdin": "a\nb", "stdout": "c"}]
    assert parse_tests({"fn_name": "f", "inputs": [[1, 2]], "outputs": [3]})[0] == "call"
    assert parse_tests({"fn_name": None, "inputs": ["1"], "outputs": ["1"]})[0] == "stdin"
    assert parse_tests({"assert_case": ["assert f(1) == 1"]}) == ("assert", [{"assert": "assert f(1) == 1"}])
    assert parse_tests({"test": "def check(c): pass", "entry_point": "f"})[0] == "check"


def test_a_stdin_task_may_give_its_float_tolerance():
    form, cases = parse_tests({"inputs": ["1"], "outputs": ["0.5"], "abs_tol": 1e-6, "rel_tol": 0})
    assert (form, cases) == ("stdin", [{"stdin": "1", "stdout": "0.5", "abs_tol": 1e-6, "rel_tol": 0.0}])
    for bad in (-1, "0.1", True, float("inf"), float("nan")):
        with pytest.raises(ScoringError):
            parse_tests({"inputs": ["1"], "outputs": ["0.5"], "abs_tol": bad})


def test_a_setup_line_of_an_assert_test_is_not_a_case():
    """Only entries with an ``assert`` count; the others run before every later case."""
    gt = {"assert_case": ["import math", "assert f(1) == 1", "x = 2\ndef g():\n    assert False", "assert f(x) == 2"]}
    assert parse_tests(gt) == (
        "assert",
        [
            {"assert": "import math\nassert f(1) == 1"},
            {"assert": "import math\nx = 2\ndef g():\n    assert False\nassert f(x) == 2"},
        ],
    )
    for x in ("s = Solution()\nassert s.f() == 1", "for i in range(3):\n    assert f(i) == i"):
        assert parse_tests({"assert_case": ["import os", x]})[1] == [{"assert": f"import os\n{x}"}]


@pytest.mark.parametrize(
    "gt",
    [
        {"assert_case": ["import math", "x = f(1)"]},
        {"assert_case": ["assert sum([1]) == 1"], "entry_point": "not an identifier"},
        {"assert_case": ["assert f(1) ==", "assert f(1) == 1"]},
        "not json",
        "[1, 2]",
        None,
        {"something": "else"},
        {"inputs": ["1"], "outputs": ["1", "2"]},
        {"inputs": [], "outputs": []},
        {"inputs": [1], "outputs": ["1"]},
        {"fn_name": "f", "inputs": ["not a list"], "outputs": [1]},
        {"fn_name": "not an identifier", "inputs": [[1]], "outputs": [1]},
        {"assert_case": []},
        {"test": "def check(c): pass"},
    ],
)
def test_malformed_ground_truth_is_bad_tests(gt):
    with pytest.raises(ScoringError) as info:
        parse_tests(gt)
    assert info.value.reason == "bad_tests"


def test_case_script_matches_the_harness():
    """The stand-alone per-case programs (remote sandboxes, the benchmark) judge alike."""
    import subprocess
    import sys

    checks = [
        ("call", "def f(a):\n    return a * 2", {"fn_name": "f", "args": [2], "expected": 4}, 0),
        ("call", "def f(a):\n    return a", {"fn_name": "f", "args": [2], "expected": 4}, 3),
        ("call", "def f(a):\n    return min(a)", {"fn_name": "f", "args": [[2, 1]], "expected": [1, 2]}, 3),
        ("call", "def f(a):\n    return a", {"fn_name": "f", "args": [5], "expected": [5], "wrapped": True}, 0),
        ("assert", "def f(a):\n    return a", {"assert": "assert f(1) == 2"}, 3),
        ("check", "def f(a):\n    return a", {"test": "def check(c):\n    assert c(1) == 1", "entry_point": "f"}, 0),
        ("stdin", "print(input())", {"stdin": "hi", "stdout": "hi"}, 0),
    ]
    for form, program, case, code in checks:
        script, stdin = case_script(form, program, case)
        proc = subprocess.run([sys.executable, "-I", "-c", script], input=stdin, capture_output=True, text=True)
        assert proc.returncode == code, (form, proc.stderr)
