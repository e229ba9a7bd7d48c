"""The trusted comparison of a candidate's answer with the expected one: exact types
(``True`` is not ``1``), tuples as lists, a float tolerance only where the expected
value is a float, and an expected output unwrapped from APPS-style ``[[answer]]`` only
when every sample is wrapped; stdout line by line, token by token, numbers as
decimals, a tolerance only when the task gives one and only for a decimal. An answer built to break the comparison (too big for a
float, nested past the wire's depth, a forged reply) fails its case: a score of 0 with
status ``ok``, never an error of ours."""

from __future__ import annotations

from sandbox_support import score

from stream_reward.scoring.sandbox.judge import same, same_output, wrapped_outputs


def test_same_is_exact_and_only_unwraps_wrapped_samples():
    assert same((0, 1), [0, 1]) and same(0.30000000000000004, 0.3)
    assert not same(True, 1) and not same(1, True) and not same("1", 1)
    assert not same(1, [1, 2, 3])  # min(xs) for a sort
    assert same(5, [5], wrapped=True) and not same(5, [5])
    assert wrapped_outputs([[1], [[2, 3]]]) and not wrapped_outputs([[1, 2], [3]])


def test_a_tolerance_only_where_the_expected_value_is_a_float():
    assert not same(1000000.5, 1000000) and not same(2.0000001, 2)
    assert same(1000000.0, 1000000) and same(3, 3.0) and same(1000000.5, 1000000.0000001)
    assert not same(True, 1.0) and not same(1.0, True) and not same(0, False)
    assert same([1, 2.0000000001], [1, 2.0]) and not same([1.0000001, 2.0], [1, 2.0])


def test_an_answer_past_the_float_range_is_wrong_not_an_error():
    assert not same(10**400, 0.5) and not same(-(10**400), 1e308)
    assert not same(float("inf"), 1e308) and not same(float("nan"), 0.0)


def test_call_form_int_answer_is_exact(bwrap):
    gt = {"fn_name": "f", "inputs": [[1000000], [1000000], [7]], "outputs": [1000000, 1000000, 7.0]}
    r = score(bwrap, "def f(x):\n    return x + 0.5 if x > 10 else x", gt)
    assert r.extra["cases"] == ["failed", "failed", "passed"]
    r = score(bwrap, "def f(x):\n    return float(x)", gt)
    assert r.extra["cases"] == ["passed", "passed", "passed"]
    r = score(bwrap, "def f(x):\n    return True", {"fn_name": "f", "inputs": [[1]], "outputs": [1]})
    assert r.extra["cases"] == ["failed"]


FORGE_REPLY = (
    "import os\n"
    "def forge(body):\n"
    "    os.write(4, len(body).to_bytes(4, 'little') + body)\n"  # fd 4: the reply pipe of the calls mode
)


def test_an_answer_that_breaks_the_comparison_fails_the_case(bwrap):
    """Too big for a float against a float, deeper than the wire allows (forged on the
    reply pipe), cyclic, or an int too long to read: each case fails, the sample is ok."""
    programs = [
        "def f(x):\n    return 10 ** 400",
        FORGE_REPLY + "def f(x):\n    forge(b'{\"t\":[\"ok\",' + b'[' * 900 + b']' * 900 + b']}')\n    return 0",
        "def f(x):\n    a = []\n    a.append(a)\n    return a",
        "import sys\nsys.set_int_max_str_digits(0)\ndef f(x):\n    return 10 ** 5000",
    ]
    for program in programs:
        r = score(bwrap, program, {"fn_name": "f", "inputs": [[1], [2]], "outputs": [0.5, [[1]]]})
        assert r.extra["cases"] == ["failed", "failed"], (program, r.extra)


def test_stdout_is_compared_line_by_line_token_by_token():
    assert same_output("1  2 \n3\r\n\n\n", "1 2\n  3") and same_output("", "\n\n")
    assert not same_output("1\n\n2", "1\n2") and not same_output("1 2", "1\n2") and not same_output("12", "1 2")
    assert not same_output("yes", "YES") and not same_output("1 2 3", "1 2")


def test_stdout_numbers_equal_as_decimals_and_a_tolerance_only_when_given():
    assert same_output("0.50 1e3 -0 +7 1000000.0", "0.5 1000 0 7 1000000")
    assert not same_output("1000000.5", "1000000") and not same_output("0.3333", "0.333333")
    assert same_output("0.3333", "0.333333", abs_tol=1e-3) and same_output("100.1", "100.0", rel_tol=1e-2)
    assert not same_output("5.5", "5", abs_tol=1) and not same_output("0.3333", "0.333333", rel_tol=1e-6)
    assert not same_output("1e99999999999999999999999", "1", abs_tol=1) and not same_output("NaN", "nan", abs_tol=1)
    assert not same_output("١", "1") and not same_output("1_0", "10")  # only ASCII decimals are numbers


def test_stdin_form_compares_by_the_stdout_convention(bwrap):
    echo = "import sys\nsys.stdout.write(sys.stdin.read())"
    got = ["0.50\n", "1000000.5\n", "1   2\n\n\n", "3.14159\n", "0.3333\n"]
    want = ["0.5", "1000000", "1 2", "3.14", "0.333333"]
    r = score(bwrap, echo, {"inputs": got, "outputs": want})
    assert r.extra["cases"] == ["passed", "failed", "passed", "failed", "failed"]
    r = score(bwrap, echo, {"inputs": got, "outputs": want, "abs_tol": 1e-2})
    assert r.extra["cases"] == ["passed", "failed", "passed", "passed", "passed"]
