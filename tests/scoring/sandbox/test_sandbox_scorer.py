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
from sandbox_table import WHOLE_PROGRAMS

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
    wall; an object that is no value (neither data nor an iterator) fails the case
    instead of comparing."""
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
    assert score(bwrap, "def count(n):\n    return (i for i in range(n))", gen).score == 1.0
    r = score(bwrap, "class Box:\n    pass\ndef count(n):\n    return Box()", gen)
    assert r.extra["cases"] == ["failed"] and "Box is not plain data" in r.extra["error"]
    r = score(bwrap, "def count(n):\n    raise KeyError(n)", gen)
    assert r.extra["cases"] == ["runtime_error"] and "KeyError" in r.extra["error"]


def test_an_exception_subclass_is_caught_as_its_builtin_base(bwrap):
    """``except ValueError`` in a test catches what it would in one process: a
    ``json.JSONDecodeError`` or the program's own ``ValueError`` subclass; a subclass of
    StopIteration still arrives as a RuntimeError."""
    raises = {
        "test": "def check(candidate):\n    try:\n        candidate('{bad')\n    except ValueError:\n        return\n    assert False\n",
        "entry_point": "parse",
    }
    assert score(bwrap, "import json\ndef parse(s):\n    return json.loads(s)", raises).score == 1.0
    own = "class BadInput(ValueError):\n    pass\ndef parse(s):\n    raise BadInput(s)"
    assert score(bwrap, own, raises).score == 1.0
    stop = "class Done(StopIteration):\n    pass\ndef parse(s):\n    raise Done(s)"
    r = score(bwrap, stop, raises)
    assert r.score == 0.0 and "RuntimeError: StopIteration" in r.extra["error"]


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
    if name.endswith("runs_on_import"):  # refused, not imported and run until the deadline
        assert "timeout" not in result.extra["cases"], result.extra


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
