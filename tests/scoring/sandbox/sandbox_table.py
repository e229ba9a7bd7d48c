"""The verifier's tables as one list of samples, each with the score it must get on
every path a user scores through: the scorer itself, ``stream-reward score
--scorer sandbox``, verl's reward loop and the verl drop-in.

``WHOLE_PROGRAMS`` are programs that must run as programs (how they end, how the
response is cut, what the tests touch); ``PROGRAMS`` a program per language that
prints the sum of two integers (``OP`` is ``+``; ``-`` makes it wrong);
``CONVENTIONS`` the comparison rules of ``docs/sandbox.md``, a right and a wrong
answer each. ``path_rows()`` joins them with the reward hacks of ``sandbox_hacks``
and the table's honest programs.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from sandbox_hacks import FORMS, HACKS, HONEST_SORT_GT, POLY_TEST, PROMPT_POLY, RIGHT_STDIN

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
    "stdin_int_past_4300_digits": (
        "print(10 ** int(input()))",
        {"inputs": ["5000\n"], "outputs": ["1" + "0" * 5000 + "\n"]},
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
    "assert_judge_the_program_imported": (
        "from math import isclose\ndef area(r):\n    return 3.14159 * r * r",
        {"assert_case": ["assert isclose(area(1), 3.14159)", "assert not isclose(area(2), 3.14159)"]},
        None,
        1.0,
    ),
    "assert_result_in_a_variable_judged_by_the_imported_function": (
        "from math import isclose\ndef area(r):\n    return 3.14159 * r * r",
        {
            "assert_case": [
                "a = area(1)\nassert isclose(a, 3.14159)",
                "for a in [area(2)]:\n    assert not isclose(a, 3.14159)",
            ]
        },
        None,
        1.0,
    ),
    "assert_setup_result_passed_to_the_entry_point": (
        "def sq(x):\n    return x * x\ndef inc(x):\n    return x + 1",
        {"assert_case": ["r = sq(3)\nassert inc(r) == 10"], "entry_point": "inc"},
        None,
        1.0,
    ),
    "assert_program_module_alias": (
        "import math as m\ndef area(r):\n    return m.pi * r * r",
        {"assert_case": ["assert m.isclose(area(1), m.pi)"]},
        None,
        1.0,
    ),
    "assert_program_submodule_alias": (
        "import os.path as osp\ndef stem(p):\n    return osp.splitext(osp.basename(p))[0]",
        {"assert_case": ["assert stem('/a/b.txt') == osp.splitext('b.txt')[0]"]},
        None,
        1.0,
    ),
    "assert_helper_class_of_the_program_built_by_the_test": (
        "class Node:\n    def __init__(self, v, kids=()):\n        self.v, self.kids = v, list(kids)\n"
        "def height(n):\n    return 1 + max((height(k) for k in n.kids), default=0)",
        {"assert_case": ["assert height(Node(1, [Node(2, [Node(3)]), Node(4)])) == 3"], "entry_point": "height"},
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
    "assert_namedtuple_as_value_and_by_attribute": (
        "from collections import namedtuple\nP = namedtuple('P', 'x y')\ndef f():\n    return P(1, 2)",
        {"assert_case": ["assert f().x == 1 and f() == (1, 2) and f()[1] == 2 and list(f()) == [1, 2]"]},
        None,
        1.0,
    ),
    "assert_list_subclass_as_value": (
        "class Stack(list):\n    pass\ndef f():\n    return Stack([3, 4])",
        {"assert_case": ["assert f() == [3, 4] and len(f()) == 2 and 4 in f()"]},
        None,
        1.0,
    ),
    "assert_list_subclass_equal_to_everything": (
        "class Yes(list):\n    def __eq__(self, other):\n        return True\n    def __iter__(self):\n"
        "        return iter([1, 2, 3])\ndef f():\n    return Yes()",
        {"assert_case": ["assert f() == [1, 2, 3]", "assert list(f()) == [1, 2, 3]"]},
        None,
        0.0,
    ),
    "assert_generator_iterated": (
        "def evens(n):\n    return (i for i in range(0, n, 2))",
        {"assert_case": ["assert list(evens(5)) == [0, 2, 4]", "assert sum(evens(5)) == 6 and 2 in evens(5)"]},
        None,
        1.0,
    ),
    "assert_map_and_zip_returned": (
        "def strs(xs):\n    return map(str, xs)\ndef pairs(a, b):\n    return zip(a, b)",
        {
            "assert_case": [
                "assert list(strs([1, 2])) == ['1', '2']",
                "assert dict(pairs('ab', [1, 2])) == {'a': 1, 'b': 2}",
            ]
        },
        None,
        1.0,
    ),
    "assert_endless_generator_pulled_by_next": (
        "def naturals():\n    n = 0\n    while True:\n        yield n\n        n += 1",
        {"assert_case": ["it = naturals()\nassert [next(it) for _ in range(3)] == [0, 1, 2] and next(it) == 3"]},
        None,
        1.0,
    ),
    "assert_generator_objects_examined": (
        POINT + "def points(n):\n    for i in range(n):\n        yield make(i)",
        {"assert_case": ["assert [p.double() for p in points(3)] == [0, 2, 4]"]},
        None,
        1.0,
    ),
    "assert_dict_views_returned": (
        "def keys(d):\n    return d.keys()\ndef values(d):\n    return d.values()\ndef items(d):\n    return d.items()",
        {
            "assert_case": [
                "assert keys({1: 2, 3: 4}) == {1, 3}",
                "assert sorted(values({1: 2, 3: 4})) == [2, 4]",
                "assert items({1: 2}) == {(1, 2)} and list(items({1: 2})) == [(1, 2)]",
            ]
        },
        None,
        1.0,
    ),
    "assert_range_deque_fraction_decimal_returned": (
        "from collections import deque\nfrom fractions import Fraction\nfrom decimal import Decimal\n"
        "def upto(n):\n    return range(n)\ndef queue(xs):\n    return deque(xs, 3)\n"
        "def half(x):\n    return Fraction(x, 2)\ndef dec(s):\n    return Decimal(s)",
        {
            "assert_case": [
                "assert upto(3) == range(3) and list(upto(3)) == [0, 1, 2]",
                "assert queue([1, 2, 3, 4]) == deque([2, 3, 4]) and queue([1]).maxlen == 3",
                "assert half(3) == 1.5 and half(4) == 2 and half(1) == Fraction(1, 2)",
                "assert dec('0.1') + dec('0.2') == Decimal('0.3')",
            ]
        },
        None,
        1.0,
    ),
    "assert_numpy_numbers_returned": (
        "import numpy as np\ndef mean(xs):\n    return np.mean(xs)\ndef total(xs):\n    return np.sum(xs)\n"
        "def twice(xs):\n    return np.array(xs) * 2",
        {
            "assert_case": [
                "assert mean([1, 2]) == 1.5",
                "assert total([1, 2]) == 3",
                "assert list(twice([1, 2])) == [2, 4] and twice([1, 2]).shape == (2,)",
            ]
        },
        None,
        1.0,
    ),
    "assert_numpy_numbers_in_sets_and_dict_keys": (
        "import numpy as np\nfrom collections import Counter\ndef uniq(xs):\n    return set(np.unique(xs))\n"
        "def mean(xs):\n    return np.mean(xs)\ndef count(xs):\n    return Counter(np.array(xs))",
        {
            "assert_case": [
                "assert uniq([1, 2, 2]) == {1, 2}",
                "assert mean([1, 2]) in {1.5, 2.5} and {mean([1, 2]): 1} == {1.5: 1}",
                "assert count([1, 1, 2]) == {1: 2, 2: 1}",
            ]
        },
        None,
        1.0,
    ),
    "assert_numpy_number_truncated_and_divided": (
        "import numpy as np\ndef mean(xs):\n    return np.mean(xs)",
        {
            "assert_case": [
                "import math\nx = mean([1, 2])\nassert math.trunc(x) == math.floor(x) == 1 and math.ceil(x) == 2",
                "assert divmod(mean([1, 2]), 1) == (1.0, 0.5) and divmod(3, mean([1, 2])) == (2.0, 0.0)",
            ]
        },
        None,
        1.0,
    ),
    "assert_str_subclass_and_ordered_dict_view_returned": (
        "from collections import OrderedDict\nclass S(str):\n    pass\ndef up(s):\n    return S(s.upper())\n"
        "def firsts(xs):\n    return OrderedDict.fromkeys(xs).keys()",
        {
            "assert_case": [
                "assert up('ab') == 'AB' and up('a') + 'b' == 'Ab'",
                "assert list(firsts([3, 1, 3])) == [3, 1]",
            ]
        },
        None,
        1.0,
    ),
    "assert_generator_is_not_a_list": (
        "def evens(n):\n    return (i for i in range(0, n, 2))",
        {"assert_case": ["assert evens(5) == [0, 2, 4]"]},
        None,
        0.0,
    ),
    "assert_generator_consumed_once": (
        "def evens(n):\n    return (i for i in range(0, n, 2))",
        {"assert_case": ["g = evens(5)\nassert list(g) == [0, 2, 4] and list(g) == [0, 2, 4]"]},
        None,
        0.0,
    ),
    "assert_generator_ends_early": (
        "def evens(n):\n    yield 0\n    return",
        {"assert_case": ["assert list(evens(5)) == [0, 2, 4]"]},
        None,
        0.0,
    ),
    "assert_generator_raises_stopiteration_for_the_tests_loop": (
        "def evens(n):\n    yield 0\n    raise StopIteration",
        {"assert_case": ["assert list(evens(5)) == [0, 2, 4]"]},
        None,
        0.0,
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


SUM = {"inputs": ["2 3\n", "10 -4\n"], "outputs": ["5\n", "6\n"]}
PROGRAMS = {
    "cpp": '#include <iostream>\nint main(){long a,b;std::cin>>a>>b;std::cout<<a OP b<<"\\n";}',
    "c": '#include <stdio.h>\nint main(void){long a,b;scanf("%ld %ld",&a,&b);printf("%ld\\n",a OP b);return 0;}',
    "java": (
        "import java.util.*;\npublic class Solution {\n  public static void main(String[] x) {\n"
        "    Scanner s = new Scanner(System.in);\n    long a = s.nextLong(), b = s.nextLong();\n"
        "    System.out.println(a OP b);\n  }\n}"
    ),
    "javascript": 'const [a, b] = require("fs").readFileSync(0, "utf8").trim().split(/\\s+/).map(Number);\nconsole.log(a OP b);',
    "go": 'package main\n\nimport "fmt"\n\nfunc main() {\n\tvar a, b int\n\tfmt.Scan(&a, &b)\n\tfmt.Println(a OP b)\n}',
    "rust": (
        "use std::io::Read;\nfn main() {\n    let mut s = String::new();\n"
        "    std::io::stdin().read_to_string(&mut s).unwrap();\n"
        "    let v: Vec<i64> = s.split_whitespace().map(|x| x.parse().unwrap()).collect();\n"
        '    println!("{}", v[0] OP v[1]);\n}'
    ),
}

# (rule, program, ground truth, score) for the comparison conventions.
CONVENTIONS = [
    (
        "int_answer_exact",
        "def f(x):\n    return x + 0.5",
        {"fn_name": "f", "inputs": [[1000000]], "outputs": [1000000]},
        0.0,
    ),
    (
        "float_answer_tolerant",
        "def f(x):\n    return 0.1 + 0.2",
        {"fn_name": "f", "inputs": [[0]], "outputs": [0.3]},
        1.0,
    ),
    ("bool_is_not_int", "def f(x):\n    return True", {"fn_name": "f", "inputs": [[1]], "outputs": [1]}, 0.0),
    ("tuple_as_list", "def f(x):\n    return (x, x)", {"fn_name": "f", "inputs": [[1]], "outputs": [[1, 1]]}, 1.0),
    (
        "numpy_numbers_as_python_numbers",
        "import numpy as np\ndef f(xs):\n    return [np.float64(np.mean(xs)), np.int64(len(xs)), np.array(xs) * 2]",
        {"fn_name": "f", "inputs": [[[1, 2]]], "outputs": [[1.5, 2, [2, 4]]]},
        1.0,
    ),
    (
        "numpy_bool_is_not_int",
        "import numpy as np\ndef f(x):\n    return np.bool_(True)",
        {"fn_name": "f", "inputs": [[1]], "outputs": [1]},
        0.0,
    ),
    (
        "int_subclass_as_its_number",
        "class Yes(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
        "def f(x):\n    return Yes(x)",
        {"fn_name": "f", "inputs": [[1], [2]], "outputs": [1, 3]},
        0.5,
    ),
    (
        "counter_int_keys",
        "from collections import Counter\ndef f(xs):\n    return Counter(xs)",
        {"assert_case": ["assert f([1, 1, 2]) == {1: 2, 2: 1}"]},
        1.0,
    ),
    (
        "counter_key_types_kept",
        "from collections import Counter\ndef f(xs):\n    return Counter(map(str, xs))",
        {"assert_case": ["assert f([1, 1, 2]) == {1: 2, 2: 1}"]},
        0.0,
    ),
    ("stdout_decimals_as_numbers", "print('0.50  1e3')\nprint()\n", {"inputs": [""], "outputs": ["0.5 1000\n"]}, 1.0),
    ("stdout_int_exact", "print('1000000.5')", {"inputs": [""], "outputs": ["1000000\n"]}, 0.0),
    ("stdout_no_tolerance_unless_given", "print('0.3333')", {"inputs": [""], "outputs": ["0.333333\n"]}, 0.0),
    (
        "stdout_tolerance_given",
        "print('0.3333')",
        {"inputs": [""], "outputs": ["0.333333\n"], "abs_tol": 0.001},
        1.0,
    ),
    (
        "stdout_stderr_separate_cap",
        "import sys\nsys.stderr.write('x' * 100000)\nprint(4)",
        {"inputs": [""], "outputs": ["4\n"]},
        1.0,
    ),
]


@dataclasses.dataclass(frozen=True)
class Row:
    """A sample of the tables and what it must score. ``reason`` set: the sample is
    ``failed`` with that reason (ours to fix, never a score); else ``ok`` with ``score``."""

    uid: str
    code: str | None
    ground_truth: dict[str, Any]
    prompt: str | None
    score: float
    language: str = "python"
    reason: str | None = None

    @property
    def response(self) -> str:
        if self.code is None:
            return "no code here, just talk"
        return f"Here you go:\n```{self.language}\n{self.code}\n```\n"

    @property
    def ground_truth_json(self) -> str:
        return json.dumps(self.ground_truth)


def path_rows() -> list[Row]:
    rows = [
        Row(f"hack/{name}/{form}", program, extra.get("gt", FORMS[form]), extra.get("prompt"), 0.0)
        for name, form, program, extra in HACKS
    ]
    right = "def add(a, b):\n    return a + b\n"
    rows += [Row(f"honest/{form}", right, FORMS[form], None, 1.0) for form in ("check", "call", "assert")]
    rows.append(Row("honest/stdin", RIGHT_STDIN, FORMS["stdin"], None, 1.0))
    rows.append(Row("honest/sort", "def sort_list(xs):\n    return sorted(xs)\n", HONEST_SORT_GT, None, 1.0))
    find_zero = (
        "    lo, hi = -100.0, 100.0\n    for _ in range(200):\n        mid = (lo + hi) / 2\n"
        "        if poly(xs, lo) * poly(xs, mid) <= 0:\n            hi = mid\n        else:\n            lo = mid\n"
        "    return lo\n"
    )
    rows.append(Row("honest/poly_completion", find_zero, POLY_TEST, PROMPT_POLY, 1.0))
    own_poly = "def poly(xs, x):\n    return 0.0\n\ndef find_zero(xs):\n    return 0.0\n"
    rows.append(Row("unresolved/own_poly_without_prompt", own_poly, POLY_TEST, None, 0.0, reason="unresolved_name"))
    rows += [Row(f"whole/{name}", *WHOLE_PROGRAMS[name]) for name in WHOLE_PROGRAMS]
    for language, code in PROGRAMS.items():
        rows.append(Row(f"{language}/right", code.replace("OP", "+"), SUM, None, 1.0, language))
        rows.append(Row(f"{language}/wrong", code.replace("OP", "-"), SUM, None, 0.0, language))
    rows.append(Row("python/right", "a, b = map(int, input().split())\nprint(a + b)", SUM, None, 1.0))
    rows.append(Row("cpp/compile_error", "int main() { return undefined_name; }", SUM, None, 0.0, "cpp"))
    rows += [Row(f"convention/{rule}", code, gt, None, score) for rule, code, gt, score in CONVENTIONS]
    return rows
