"""The trusted checker (check and assert forms), with real programs in a real sandbox:
what the candidate raises or returns is data the test judges, so it can only fail a
case (0, status ``ok``): an exception that steers control flow in the checker does not
end or skip the test, and what a test prints of an answer goes nowhere near the
checker's frame pipe."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys

import pytest
from sandbox_hacks import POLY_TEST, PROMPT_POLY
from sandbox_support import FAST, run, score, traj

from stream_reward.errors import ScoringError, VerifierError
from stream_reward.wire.trajectory import Trajectory

ALL_OF_MAP = {
    "check": {"test": "def check(candidate):\n    assert all(map(candidate, [1, 2]))\n", "entry_point": "f"},
    "assert": {"assert_case": ["assert all(map(f, [1, 2]))", "for r in map(f, [3]):\n    assert r"]},
}


@pytest.mark.parametrize("form", list(ALL_OF_MAP))
@pytest.mark.parametrize(
    "exc", ["StopIteration", "StopAsyncIteration", "GeneratorExit", "KeyboardInterrupt", "SystemExit"]
)
def test_control_flow_exceptions_from_the_candidate_fail_the_case(bwrap, form, exc):
    gt = ALL_OF_MAP[form]
    r = score(bwrap, f"def f(x):\n    raise {exc}", gt)
    assert r.score == 0.0 and set(r.extra["cases"]) == {"runtime_error"}, r.extra
    assert score(bwrap, "def f(x):\n    return x", gt).score == 1.0


def test_what_a_test_prints_of_an_answer_does_not_reach_the_frame_pipe(bwrap):
    gt = {"assert_case": ["print(f(1))\nassert f(1) == 'x' * 20000", "print(f(2) * 50)\nassert len(f(2)) == 20000"]}
    assert score(bwrap, "def f(x):\n    return 'x' * 20000", gt).extra["cases"] == ["passed", "passed"]
    r = score(bwrap, "def f(x):\n    return 'y' * 20000", gt)
    assert r.extra["cases"] == ["failed", "passed"]


def test_an_assertion_message_that_cannot_be_printed_still_fails_the_case(bwrap):
    gt = {"assert_case": ["assert f(1) == 2, f(1) * f(1)"]}  # 8,000 digits: past str()'s limit
    r = score(bwrap, "def f(x):\n    return 10 ** 3999", gt)
    assert r.extra["cases"] == ["failed"] and r.score == 0.0


FLOOD_FRAMES = (
    "import os\n"
    "def f(x):\n"
    "    body = b'[\"ok\",2]'\n"
    "    for _ in range(300_000):\n"  # unasked replies on the reply pipe (fd 4), some 3.6 MB of frames
    "        os.write(4, len(body).to_bytes(4, 'little') + body)\n"
    "    return 0\n"
)


@pytest.mark.parametrize(
    "program",
    [FLOOD_FRAMES, "def f(x):\n    print('x' * (8 << 20))\n    return 2", "def f(x):\n    return 'x' * (8 << 20)"],
    ids=["reply_frames", "stdout", "answer"],
)
def test_a_flood_from_the_candidate_fails_the_case_quickly(bwrap, program):
    import time

    start = time.monotonic()
    r = score(bwrap, program, {"assert_case": ["assert f(1) == 2", "assert f(2) == 2"]})
    assert r.score == 0.0 and set(r.extra["cases"]) <= {"output_limit", "failed"}, r.extra
    assert time.monotonic() - start < 8


DESCENDING = "import builtins\ndef sorted(xs):\n    return builtins.sorted(xs, reverse=True)\n"
SHADOW_REST = "def sorted(xs):\n    return xs\ndef list(x):\n    return [1, 3, 2]\ndef reversed(x):\n    return x\n"


@pytest.mark.parametrize(
    "gt",
    [
        {"assert_case": ["assert sorted([1, 3, 2]) == [3, 2, 1]", "assert sorted([4, 5]) == [5, 4]"]},
        {"assert_case": ["assert sorted([1, 3, 2]) == list(reversed(range(1, 4)))"], "entry_point": "sorted"},
    ],
    ids=["inferred", "given"],
)
def test_a_task_function_named_like_a_builtin_is_the_responses_and_only_it(bwrap, gt):
    assert score(bwrap, DESCENDING, gt).score == 1.0
    assert score(bwrap, SHADOW_REST, gt).score == 0.0


STDLIB_TEST = {
    "test": (
        "import heapq, unittest, collections, fractions\n"
        "def _median(xs):\n    import statistics, decimal\n    return statistics.median(xs) + decimal.Decimal(0)\n"
        "def check(candidate):\n"
        "    assert candidate([3, 1, 2]) == heapq.nsmallest(3, [3, 1, 2])\n"
        "    assert candidate([5, 4]) == sorted(collections.Counter([5, 4]))\n"
        "    assert fractions.Fraction(_median(candidate([2, 1, 3]))) == 2\n"
        "    unittest.TestCase().assertEqual(candidate([2, 1]), [1, 2])\n"
    ),
    "entry_point": "f",
}


def _mount_points() -> set[str]:
    with open("/proc/self/mountinfo") as f:
        return {line.split()[4] for line in f}


def test_a_test_imports_the_standard_library_wherever_python_lives(open_scorer):
    # The checker runs tests as nobody when root, and this interpreter may live under
    # a directory nobody cannot enter (/root/.pyenv): the imports must still work,
    # without the host seeing any of the mounts that make it so.
    before = _mount_points()
    s = open_scorer(backend="bwrap", concurrency=1)
    r = score(s, "def f(xs):\n    return sorted(xs)", STDLIB_TEST)
    assert r.score == 1.0 and r.extra["cases"] == ["passed"], r.extra
    assert score(s, "def f(xs):\n    return xs", STDLIB_TEST).extra["cases"] == ["failed"]
    prefix = os.path.realpath(sys.base_prefix)
    assert not [m for m in _mount_points() - before if prefix == m or prefix.startswith(m.rstrip("/") + "/")]


def test_a_test_runs_without_privilege(bwrap):
    gt = {
        "test": "import os\ndef check(candidate):\n    assert os.geteuid() == candidate(0) and os.getegid() != 0\n",
        "entry_point": "f",
    }
    nobody = 65534 if os.geteuid() == 0 else os.geteuid()
    assert score(bwrap, f"def f(x):\n    return {nobody}", gt).score == 1.0


# The honest find_zero, and one that brings its own ``poly`` so that any answer passes.
FIND_ZERO = (
    "def find_zero(xs):\n    lo, hi = -100.0, 100.0\n    for _ in range(200):\n        mid = (lo + hi) / 2\n"
    "        if poly(xs, lo) * poly(xs, mid) <= 0:\n            hi = mid\n        else:\n            lo = mid\n"
    "    return lo\n"
)
OWN_POLY = "def poly(xs, x):\n    return 0.0\n\ndef find_zero(xs):\n    return 0.0\n"
CHATML = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nComplete this function:\n```python\n{prompt}```<|im_end|>\n<|im_start|>assistant\n"
)


def _poly_sample(program: str, *, prompt: str | None, gt_prompt: str | None = None) -> Trajectory:
    gt = {**POLY_TEST, "prompt": gt_prompt} if gt_prompt is not None else POLY_TEST
    return dataclasses.replace(traj(PROMPT_POLY + program, gt), prompt=prompt)


@pytest.mark.parametrize(
    "prompt,gt_prompt",
    [
        (PROMPT_POLY, None),
        (CHATML.format(prompt=PROMPT_POLY), None),
        ("Complete the following function.\n\n" + PROMPT_POLY, None),
        (None, PROMPT_POLY),
        ("Write find_zero. ```python\ndef poly(xs, x):\n    return 0.0\n```", PROMPT_POLY),
    ],
    ids=["jsonl_prompt", "chat_templated", "prose_then_code", "ground_truth_prompt", "ground_truth_wins"],
)
def test_a_helper_the_test_needs_is_the_prompts_never_the_responses(bwrap, prompt, gt_prompt):
    own = run(bwrap, _poly_sample(OWN_POLY, prompt=prompt, gt_prompt=gt_prompt))
    assert own.score == 0.0 and own.extra["cases"] == ["failed"], own.extra
    assert run(bwrap, _poly_sample(FIND_ZERO, prompt=prompt, gt_prompt=gt_prompt)).score == 1.0


@pytest.mark.parametrize("program", [OWN_POLY, FIND_ZERO], ids=["own_poly", "honest"])
def test_a_helper_nothing_trusted_defines_fails_the_sample_naming_it(bwrap, program):
    """Without the prompt, ``poly`` exists only in the response: not a pass, not a 0 either."""
    with pytest.raises(ScoringError) as info:
        run(bwrap, _poly_sample(program, prompt=None))
    assert info.value.reason == "unresolved_name"
    assert "`poly`" in str(info.value) and "prompt" in str(info.value)


STARTER = "from typing import List\n\nclass Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n        pass\n"
TWO_SUM = (
    "class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n        seen = {}\n"
    "        for i, x in enumerate(nums):\n            if target - x in seen:\n                return [seen[target - x], i]\n"
    "            seen[x] = i\n"
)
NOT_IMPLEMENTED = 'def add(a, b):\n    """a + b"""\n    raise NotImplementedError("write me")\n'


@pytest.mark.parametrize(
    "prompt,program,gt",
    [
        (STARTER, TWO_SUM, {"assert_case": ["assert Solution().twoSum([2, 7, 11], 9) == [0, 1]"]}),
        (
            STARTER,
            TWO_SUM,
            {
                "test": "def check(candidate):\n    assert Solution().twoSum([3, 2, 4], 6) == [1, 2]\n"
                "    assert candidate([3, 3], 6) == [0, 1]\n",
                "entry_point": "Solution().twoSum",
            },
        ),
        (NOT_IMPLEMENTED, "def add(a, b):\n    return a + b", {"assert_case": ["assert add(2, 3) == 5"]}),
    ],
    ids=["starter_class_assert", "starter_class_check", "raise_not_implemented"],
)
def test_a_prompt_stub_class_or_not_implemented_function_is_the_responses(bwrap, prompt, program, gt):
    right = run(bwrap, dataclasses.replace(traj(program, gt), prompt=prompt))
    assert right.score == 1.0, right.extra
    wrong = program.replace("[seen[target - x], i]", "[i, i]").replace("a + b", "a - b")
    assert run(bwrap, dataclasses.replace(traj(wrong, gt), prompt=prompt)).score == 0.0


@pytest.mark.parametrize("module_name", ["solution", "__main__"])
def test_only_what_a_program_took_from_a_module_names_that_module(module_name):
    """The checker imports the module a program's class or function says it comes from;
    what the program defines itself comes from the program's own module, which the
    checker must never try to import (a file of that name on its path is not the program)."""
    from stream_reward.scoring.sandbox._serve import global_names

    g = {"__name__": module_name}
    exec("from math import isclose\nfrom collections import OrderedDict\ndef f():\n    pass\nclass C:\n    pass", g)
    assert global_names(g) == {
        "isclose": "function:math:isclose",
        "OrderedDict": "class:collections:OrderedDict",
        "f": "function",
        "C": "class",
    }


@pytest.mark.parametrize(
    "gt",
    [
        {"test": "import os\ndef check(candidate):\n    os._exit(0)\n", "entry_point": "f"},
        {"assert_case": ["import os\nos._exit(0)\nassert f(1) == 1"]},
    ],
    ids=["check", "assert"],
)
def test_a_test_that_ends_the_checker_fails_the_sample_naming_the_checker(open_scorer, gt):
    """A dataset's test that ends its own process, even with status 0, is our data's
    fault: the sample is failed at once, not a case left to time out as a 0."""
    s = open_scorer(limits={**FAST, "timeout_s": 30.0, "cpu_s": 30.0})
    with pytest.raises(VerifierError) as err:
        asyncio.run(asyncio.wait_for(s.score(traj("def f(x):\n    return x", gt)), 20))
    assert err.value.reason == "checker_crashed"
