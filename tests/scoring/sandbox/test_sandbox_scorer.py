"""The local code sandbox scorer, with real programs in real sandboxes (bwrap and
unshare): a right program scores 1.0 in every test form, a wrong, crashing, slow,
hungry or flooding one scores its cases 0 with the case's status (``failed``,
``runtime_error``, ``timeout``, ``memory``, ``output_limit``), and no known reward hack
earns anything — every one scores 0.0 with status ``ok`` (a score, not a ``failed``
sample the trainer would mask). A response without code is a wrong answer; bad tests
are a scoring error. Tests reach the program only through plain-data proxies.
Closing the scorer leaves no sandbox behind.
"""

from __future__ import annotations

import asyncio
import json
import time

import msgpack
import pytest
from sandbox_hacks import FORMS, HACKS, HONEST_SORT_GT, LIMITS, POLY_TEST, PROMPT_POLY, RIGHT_STDIN, hack_traj
from sandbox_support import FAST, run, sandboxed_processes, score, scorer_or_skip, stdin_case, traj

from stream_reward.errors import ConfigError, ScoringError
from stream_reward.scoring.sandbox.scorer import SandboxConfig
from stream_reward.wire.trajectory import Trajectory

pytestmark = pytest.mark.usefixtures("no_sandboxed_process_left")


# ------------------------------------------------------------ config and lifecycle
def test_bad_sandbox_config_is_a_config_error():
    with pytest.raises(ConfigError):
        SandboxConfig(timeout_s=0)
    with pytest.raises(ConfigError):
        SandboxConfig(backend="docker")
    with pytest.raises(ConfigError):
        SandboxConfig(uid_base=0)


def test_closing_the_scorer_leaves_no_sandbox_behind():
    s = scorer_or_skip(concurrency=2)

    async def two():
        return await asyncio.gather(*(s.score(traj("print('ok')", stdin_case())) for _ in range(2)))

    assert [r.score for r in asyncio.run(two())] == [1.0, 1.0]
    slots = {str(x.harness.pid) for x in s._slots if x.harness is not None}
    assert len(slots) == 2 and slots <= {p[0] for p in sandboxed_processes()}  # two live slots
    s.close()
    assert not slots & {p[0] for p in sandboxed_processes()}


# ------------------------------------------------------------ right and wrong
def test_correct_solutions_pass_every_form(scorer):
    r = score(
        scorer,
        "import sys\nfor line in sys.stdin:\n    print(int(line) * 2)   ",
        {"inputs": ["1\n2\n", "5"], "outputs": ["2\n4\n\n\n", "10"]},
    )
    assert (r.score, r.extra["cases"]) == (1.0, ["passed", "passed"])
    r = score(
        scorer,
        "def add(a, b):\n    return a + b",
        {"fn_name": "add", "inputs": [[1, 2], [0.1, 0.2]], "outputs": [3, 0.3]},
    )
    assert r.extra["cases"] == ["passed", "passed"]
    r = score(
        scorer,
        "class Solution:\n    def twoSum(self, nums, t):\n        return (0, 1)",
        {"fn_name": "twoSum", "inputs": [[[1, 2], 3]], "outputs": [[[0, 1]]]},
    )
    assert r.score == 1.0  # tuples compare as lists; APPS-style [[answer]] accepted
    r = score(scorer, "def sq(x):\n    return x * x", {"assert_case": ["assert sq(2) == 4", "assert sq(-3) == 9"]})
    assert r.extra == {"cases": ["passed", "passed"], "passed": 2, "total": 2, "error": ""}
    r = score(
        scorer,
        "def inc(x):\n    return x + 1",
        {"test": "def check(candidate):\n    assert candidate(1) == 2\n", "entry_point": "inc"},
    )
    assert (r.score, r.extra["total"]) == (1.0, 1)
    msgpack.packb(r.extra)


def test_wrong_and_crashing_solutions(scorer):
    r = score(scorer, "print(int(input()) + 1)", {"inputs": ["1", "2", "x"], "outputs": ["2", "4", "1"]})
    assert r.extra["cases"] == ["passed", "failed", "runtime_error"]
    assert r.score == pytest.approx(1 / 3)
    assert "ValueError" in r.extra["error"] or "wrong answer" in r.extra["error"]
    r = score(
        scorer, "def add(a, b):\n    return a - b", {"fn_name": "add", "inputs": [[1, 0], [1, 2]], "outputs": [1, 3]}
    )
    assert r.extra["cases"] == ["passed", "failed"]
    r = score(scorer, "def sq(x):\n    raise KeyError(x)", {"assert_case": ["assert sq(2) == 4"]})
    assert r.extra["cases"] == ["runtime_error"] and "KeyError" in r.extra["error"]
    r = score(
        scorer, "def inc(x):\n    return x", {"test": "def check(c):\n    assert c(1) == 2", "entry_point": "inc"}
    )
    assert r.extra["cases"] == ["failed"]
    r = score(scorer, "def broken(:", stdin_case())
    assert r.extra["cases"] == ["runtime_error"] and "SyntaxError" in r.extra["error"]
    r = score(scorer, "import sys\nprint('ok')\nsys.exit(3)", stdin_case())
    assert r.extra["cases"] == ["runtime_error"]


def test_setup_lines_of_an_assert_test_earn_nothing(bwrap):
    gt = {"assert_case": ["import math", "assert f(4) == 2", "y = math.sqrt(9)", "assert f(9) == y"]}
    assert score(bwrap, "def f(x):\n    return 0", gt).extra["cases"] == ["failed", "failed"]
    assert score(bwrap, "import math\ndef f(x):\n    return math.isqrt(x)", gt).score == 1.0


def test_all_or_nothing_scores_only_when_every_case_passes(open_scorer):
    s = open_scorer(all_or_nothing=True)
    r = score(s, "print(int(input()) + 1)", {"inputs": ["1", "2"], "outputs": ["2", "4"]})
    assert r.score == 0.0 and r.extra["passed"] == 1
    assert score(s, "print(int(input()) + 1)", {"inputs": ["1", "2"], "outputs": ["2", "3"]}).score == 1.0


def test_no_code_is_a_wrong_answer_and_bad_tests_a_scoring_error(bwrap):
    r = asyncio.run(
        bwrap.score(
            Trajectory(
                batch_id="b",
                index=0,
                data_source="code",
                response="I would loop.",
                ground_truth=json.dumps(stdin_case()),
            )
        )
    )
    assert r.score == 0.0 and "no code" in r.extra["error"]  # the policy's fault: a score, not `failed`
    with pytest.raises(ScoringError) as info:
        score(bwrap, "print(1)", "{broken")
    assert info.value.reason == "bad_tests"


def test_stdin_is_fed_and_large_io_works(bwrap):
    data = "\n".join(str(i) for i in range(200_000))
    r = score(
        bwrap,
        "import sys\nprint(sum(map(int, sys.stdin.read().split())))",
        {"inputs": [data], "outputs": [str(sum(range(200_000)))]},
    )
    assert r.score == 1.0
    r = score(
        bwrap,
        "for i in range(100000):\n    print(i)",
        {"inputs": [""], "outputs": ["\n".join(map(str, range(100000)))]},
    )
    assert r.score == 1.0


def test_tests_reach_the_program_only_through_proxies(bwrap):
    """Classes, methods, keyword arguments and expected exceptions work across the
    wall; a value that is not plain data fails the case instead of comparing."""
    two_sum = (
        "class Solution:\n    def twoSum(self, nums, t, *, start=0):\n        seen = {}\n"
        "        for i, x in enumerate(nums):\n            if t - x in seen:\n                return [seen[t - x] + start, i + start]\n"
        "            seen[x] = i\n"
    )
    gt = {
        "assert_case": [
            "assert Solution().twoSum([2, 7, 11], 9) == [0, 1]",
            "s = Solution()\nassert s.twoSum([3, 2, 4], 6, start=1) == [2, 3]",
        ]
    }
    assert score(bwrap, two_sum, gt).extra["cases"] == ["passed", "passed"]
    raises = {
        "test": "def check(candidate):\n    try:\n        candidate(-1)\n    except ValueError:\n        return\n    assert False\n",
        "entry_point": "root",
    }
    assert score(bwrap, "def root(x):\n    raise ValueError(x)", raises).score == 1.0
    assert score(bwrap, "def root(x):\n    return 0", raises).score == 0.0
    gen = {"test": "def check(candidate):\n    assert list(candidate(3)) == [0, 1, 2]\n", "entry_point": "count"}
    r = score(bwrap, "def count(n):\n    return (i for i in range(n))", gen)
    assert r.extra["cases"] == ["failed"] and "generator is not plain data" in r.extra["error"]
    r = score(bwrap, "def count(n):\n    raise KeyError(n)", gen)
    assert r.extra["cases"] == ["runtime_error"] and "KeyError" in r.extra["error"]


# ------------------------------------------------------------ limits
def test_too_slow_is_timeout(scorer):
    start = time.monotonic()
    r = score(scorer, "while True:\n    pass", stdin_case())
    assert r.extra["cases"] == ["timeout"]
    r = score(scorer, "import time\ntime.sleep(30)", stdin_case())  # wall clock, not CPU
    assert r.extra["cases"] == ["timeout"]
    # Two timeouts and two sandbox start-ups (slow beside CPU hogs), far from the 30 s sleep.
    assert time.monotonic() - start < 2 * FAST["timeout_s"] + 12


def test_too_hungry_is_memory(scorer, open_scorer):
    r = score(scorer, "x = bytearray(4 * 1024 ** 3)", stdin_case())
    assert r.extra["cases"] == ["memory"]
    # Touching ~256 MB takes a while on a loaded machine: allow it the time.
    patient = open_scorer(backend=scorer.backend, timeout_s=10, cpu_s=10)
    r = score(patient, "a = []\nwhile True:\n    a.append(bytearray(10 ** 7))", stdin_case())
    assert r.extra["cases"] == ["memory"]


def test_output_flood_is_output_limit(scorer):
    r = score(scorer, "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", stdin_case())
    assert r.extra["cases"] == ["output_limit"]
    r = score(scorer, "import sys\nsys.stderr.write('e' * (2 << 20))", stdin_case())
    assert r.extra["cases"] == ["output_limit"]


def test_stderr_does_not_count_against_the_stdout_cap(bwrap):
    out = "x" * (700 << 10)  # stdout and stderr 700 KB each, the cap 1 MB
    r = score(bwrap, f"import sys\nsys.stderr.write('e' * {700 << 10})\nprint('x' * {700 << 10})", stdin_case(out))
    assert r.extra["cases"] == ["passed"]


def test_writing_past_the_file_size_limit_fails_with_efbig(bwrap, open_scorer):
    s = open_scorer(backend="bwrap", max_file_mb=1)
    code = (
        "try:\n    open('/tmp/big', 'wb').write(b'x' * (3 << 20))\nexcept OSError as e:\n    print('refused', e.errno)"
    )
    assert score(s, code, stdin_case("refused 27")).score == 1.0  # EFBIG


def test_sample_wall_budget_stops_at_first_timeout(hack_scorer):
    gt = {"inputs": [""] * 10, "outputs": ["x"] * 10}
    start = time.monotonic()
    result = run(hack_scorer, hack_traj("import time\ntime.sleep(1000)", gt))
    elapsed = time.monotonic() - start
    assert result.score == 0.0
    # One timeout and a sandbox start-up (slow beside CPU hogs), not 10 timeouts (20 s).
    assert elapsed < 3 * LIMITS["timeout_s"] + 6, elapsed


# ------------------------------------------------------------ reward hacks
def test_reward_hacks_do_not_pass(scorer):
    always_equal = "class A:\n    def __eq__(self, o):\n        return True\ndef f():\n    return A()"
    r = score(scorer, always_equal, {"fn_name": "f", "inputs": [[]], "outputs": [42]})
    assert r.extra["cases"] == ["failed"]
    r = score(scorer, "import sys\ndef f():\n    return 0\nsys.exit(0)", {"assert_case": ["assert f() == 1"]})
    assert r.extra["cases"] == ["failed"]  # exiting before the tests run is not a pass
    r = score(scorer, "import os\nos._exit(0)", {"test": "def check(c):\n    assert False", "entry_point": "f"})
    assert r.extra["cases"] == ["failed"]


@pytest.mark.parametrize("name,form,program,extra", HACKS, ids=[f"{h[0]}-{h[1]}" for h in HACKS])
def test_reward_hack_scores_zero(hack_scorer, name, form, program, extra):
    gt = extra.get("gt", FORMS[form])
    result = run(hack_scorer, hack_traj(program, gt, extra.get("prompt")))  # raising would mean status `failed`
    assert result.score == 0.0, (name, form, result.extra)


def test_the_honest_programs_of_the_table_pass(hack_scorer):
    """The table's problems are solvable: the same harness gives a right answer 1.0."""
    right = "def add(a, b):\n    return a + b\n"
    for form in ("check", "call", "assert"):
        assert run(hack_scorer, hack_traj(right, FORMS[form])).score == 1.0, form
    assert run(hack_scorer, hack_traj(RIGHT_STDIN, FORMS["stdin"])).score == 1.0
    solve = PROMPT_POLY + "    lo, hi = -100.0, 100.0\n    for _ in range(200):\n"
    solve += "        mid = (lo + hi) / 2\n        if poly(xs, lo) * poly(xs, mid) <= 0:\n            hi = mid\n"
    solve += "        else:\n            lo = mid\n    return lo\n"
    assert run(hack_scorer, hack_traj(solve, POLY_TEST, PROMPT_POLY)).score == 1.0
    r = run(hack_scorer, hack_traj("def sort_list(xs):\n    return sorted(xs)\n", HONEST_SORT_GT))
    assert r.score == 1.0


@pytest.mark.parametrize("form", list(FORMS))
def test_no_code_is_a_wrong_answer_not_a_failure(hack_scorer, form):
    result = run(hack_scorer, hack_traj(None, FORMS[form]))
    assert result.score == 0.0 and "no code" in result.extra["error"]


# ------------------------------------------------------------ whole programs
DOUBLE = {"inputs": ["2\n"], "outputs": ["4\n"]}
HELPER_PROMPT = 'def helper(x):\n    return x * 2\n\n\ndef f(x):\n    """Twice x, plus one."""\n'
HELPER_CHECK = {"test": "def check(candidate):\n    assert candidate(3) == 7\n", "entry_point": "f"}
TWO_SUM = (
    "class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n        for i, x in enumerate(nums):\n"
    "            if target - x in seen:\n                return [seen[target - x], i]\n            seen[x] = i\n"
)
POINT = (
    "class P:\n    def __init__(self, x):\n        self.x = x\n    def double(self):\n        return self.x * 2\n"
    "def make(x):\n    return P(x)\n"
)
PAIR = (
    "class Pair:\n    def __init__(self, a, b):\n        self.a, self.b = a, b\n"
    "def max_chain_length(arr, n):\n    arr = sorted(arr, key=lambda p: p.b)\n    count, end = 0, float('-inf')\n"
    "    for p in arr:\n        if p.a > end:\n            count, end = count + 1, p.b\n    return count\n"
)
FORGE_AT_EXIT = (
    "import atexit, os\ndef forge():\n    print('all passed')\n    for fd in range(3, 64):\n        try:\n"
    "            os.write(fd, b'P')\n        except OSError:\n            pass\natexit.register(forge)\n"
)
EACH = (  # a test's own iterator: a StopIteration from the candidate inside it would end its loop
    "class Each:\n    def __init__(self, xs):\n        self.xs = iter(xs)\n    def __iter__(self):\n        return self\n"
    "    def __next__(self):\n        return self.f(next(self.xs))\n"
)
POSITIVE = "def positive(x):\n    assert x > 0\n    return x\n"
# (program, ground truth, prompt, score): every row scores with status ok.
WHOLE_PROGRAMS = {
    "stdin_exit_after_print": ("print(int(input()) * 2)\nexit()", DOUBLE, None, 1.0),
    "stdin_quit_0": ("print(int(input()) * 2)\nquit(0)", DOUBLE, None, 1.0),
    "stdin_exit_in_main": ("def main():\n    print(int(input()) * 2)\n    exit()\nmain()\nprint(9)", DOUBLE, None, 1.0),
    "stdin_unjoined_thread": (
        "import threading\nn = int(input())\ndef later():\n    threading.main_thread().join()\n    print(n * 2)\n"
        "threading.Thread(target=later).start()",
        DOUBLE,
        None,
        1.0,
    ),
    "stdin_atexit_output": (
        "import atexit\nn = int(input())\natexit.register(lambda: print(n * 2))",
        DOUBLE,
        None,
        1.0,
    ),
    "check_prompt_helper": ("def f(x):\n    return helper(x) + 1", HELPER_CHECK, HELPER_PROMPT, 1.0),
    "check_completion_body": ("    return helper(x) + 1", HELPER_CHECK, HELPER_PROMPT, 1.0),
    "assert_program_constant": (
        "LIMIT = 10\ndef cap(x):\n    return min(x, LIMIT)",
        {"assert_case": ["assert cap(12) == LIMIT"]},
        None,
        1.0,
    ),
    "assert_program_import": (
        "import math\ndef area(r):\n    return math.pi * r * r",
        {"assert_case": ["assert math.isclose(area(1), math.pi)"]},
        None,
        1.0,
    ),
    "assert_program_class_as_argument": (
        PAIR,
        {"assert_case": ["assert max_chain_length([Pair(5, 24), Pair(15, 25), Pair(27, 40), Pair(50, 60)], 4) == 3"]},
        None,
        1.0,
    ),
    "call_starter_method": (
        TWO_SUM,
        {"fn_name": "twoSum", "inputs": [[[2, 7, 11], 9]], "outputs": [[0, 1]]},
        None,
        1.0,
    ),
    "check_starter_entry_point": (
        TWO_SUM,
        {
            "test": "def check(candidate):\n    assert candidate([3, 2, 4], 6) == [1, 2]\n",
            "entry_point": "Solution().twoSum",
        },
        None,
        1.0,
    ),
    "assert_starter_method": (
        TWO_SUM,
        {"assert_case": ["assert Solution().twoSum([3, 2, 4], 6) == [1, 2]"]},
        None,
        1.0,
    ),
    "assert_attribute_of_returned_object": (
        POINT,
        {"assert_case": ["r = make(3)\nassert r.x == 3\nassert r.double() == 6"]},
        None,
        1.0,
    ),
    "assert_lambda_argument": (
        "def apply(f, x):\n    return f(x)",
        {"assert_case": ["assert apply(lambda x: x + 1, 2) == 3"]},
        None,
        1.0,
    ),
    "assert_builtin_key_argument": (
        "def sort_by(xs, key):\n    return sorted(xs, key=key)",
        {"assert_case": ["assert sort_by(['bb', 'a'], len) == ['a', 'bb']"]},
        None,
        1.0,
    ),
    "assert_in_place_mutation": (
        "def sort_in_place(a):\n    a.sort()",
        {"assert_case": ["a = [3, 1, 2]\nsort_in_place(a)\nassert a == [1, 2, 3]"]},
        None,
        1.0,
    ),
    "assert_nested_callback": (
        "def apply(f, x):\n    return f(x)",
        {"assert_case": ["assert apply(lambda x: apply(abs, x), -2) == 2"]},
        None,
        1.0,
    ),
    "assert_callable_of_the_test_asserting": (
        "def apply(f, x):\n    return f(x)",
        {"assert_case": [POSITIVE + "assert apply(positive, 5) == 5"]},
        None,
        1.0,
    ),
    "stdin_exit_before_print": ("n = int(input())\nexit(0)\nprint(n * 2)", DOUBLE, None, 0.0),
    "stdin_atexit_forges_a_verdict": (FORGE_AT_EXIT + "print(0)", DOUBLE, None, 0.0),
    "assert_atexit_forges_a_verdict": (
        FORGE_AT_EXIT + "def add(a, b):\n    return a - b",
        {"assert_case": ["assert add(2, 3) == 5"]},
        None,
        0.0,
    ),
    "stdin_thread_runs_forever": (
        "import threading\nthreading.Thread(target=threading.Event().wait).start()\nprint(int(input()) * 2)",
        DOUBLE,
        None,
        0.0,
    ),
    "assert_returned_object_is_not_an_answer": (
        "class Yes:\n    pass\ndef add(a, b):\n    return Yes()",
        {"assert_case": ["assert add(2, 3) is not None", "assert add(2, 3)"]},
        None,
        0.0,
    ),
    "assert_mutating_the_input_of_a_reference": (
        "def sort_list(xs):\n    xs.clear()\n    return []",
        {"assert_case": ["xs = [3, 1, 2]\nassert sort_list(xs) == sorted(xs)"]},
        None,
        0.0,
    ),
    "assert_returned_object_compared": (
        "class No:\n    pass\ndef add(a, b):\n    return No()",
        {"assert_case": ["assert add(2, 3) != 4", "assert not add(2, 3) == 4"]},
        None,
        0.0,
    ),
    "assert_callable_of_the_test_failing_inside_the_program": (
        "def apply(f, x):\n    try:\n        f(-1)\n    except BaseException:\n        pass\n    return x",
        {"assert_case": [POSITIVE + "assert apply(positive, 5) == 5"]},
        None,
        0.0,
    ),
    "assert_callbacks_nested_without_end": (
        "held = []\ndef apply(f, x):\n    if not held:\n        held.append(f)\n    return held[0](x)",
        {"assert_case": ["assert apply(lambda x: apply(abs, x), -2) == 2"]},
        None,
        0.0,
    ),
    **{
        f"check_{exc}_in_the_tests_iterator": (
            f"def f(x):\n    raise {exc}",
            {
                "test": EACH
                + "def check(candidate):\n    Each.f = staticmethod(candidate)\n    for r in Each([1, 2]):\n"
                "        assert False\n",
                "entry_point": "f",
            },
            None,
            0.0,
        )
        for exc in ("StopIteration", "GeneratorExit", "KeyboardInterrupt", "SystemExit")
    },
    "assert_property_raising_StopIteration": (
        "class P:\n    @property\n    def x(self):\n        raise StopIteration\ndef make():\n    return P()",
        {"assert_case": ["for r in map(lambda i: make().x, [1]):\n    assert False"]},
        None,
        0.0,
    ),
}


@pytest.mark.parametrize("name", list(WHOLE_PROGRAMS))
def test_a_whole_program_runs_as_a_program(bwrap, name):
    """A right program passes however it ends (``exit()``, threads, ``atexit``), however
    its response is cut (a completion of the prompt, a method of ``Solution``) and
    whatever its tests touch (its globals, its objects' attributes, a callable, an
    argument it sorts in place); a wrong one scores 0 whatever it does on the way out."""
    program, gt, prompt, expected = WHOLE_PROGRAMS[name]
    result = run(bwrap, hack_traj(program, gt, prompt))  # raising would mean status `failed`
    assert result.score == expected, result.extra
    if name == "stdin_thread_runs_forever":
        assert result.extra["cases"] == ["timeout"]
    if name == "assert_callbacks_nested_without_end":
        assert "nested too deep" in result.extra["error"]  # stopped by the checker, not by a stack overflow
