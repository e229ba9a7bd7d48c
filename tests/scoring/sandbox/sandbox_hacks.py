"""Known reward hacks against the local code sandbox, as data for the tests that run
them (``test_sandbox_scorer.py``, ``test_isolation.py``, and as uid 65534 there).

Each program is *wrong* (or does the forbidden thing and is otherwise right): a
verifier that gives it any reward has been gamed. ``HACKS`` covers every test form a
hack applies to — ``check`` (HumanEval ``test`` + ``entry_point``), ``call``
(``fn_name``), ``assert`` (``assert_case``) and ``stdin`` — for one problem,
``add(a, b)``, in ``FORMS``. ``LIMIT_HACKS`` are stdin programs that answer right only
if a limit of their sandbox did not hold.
"""

from __future__ import annotations

import json

from sandbox_support import UIDS

from stream_reward.wire.trajectory import Trajectory

LIMITS = dict(timeout_s=2.0, cpu_s=2.0, memory_mb=256, tmp_mb=16, **UIDS)  # the hack scorers' limits

# One problem, add(a, b), in the four forms.
FORMS = {
    "check": {
        "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
        "entry_point": "add",
    },
    "call": {"fn_name": "add", "inputs": [[2, 3], [-1, 1]], "outputs": [5, 0]},
    "assert": {"assert_case": ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]},
    "stdin": {"inputs": ["2 3\n", "-1 1\n"], "outputs": ["5\n", "0\n"]},
}

WRONG = "def add(a, b):\n    return a - b\n"

WRONG_STDIN = "a, b = map(int, input().split())\nprint(a - b)\n"

RIGHT_STDIN = "a, b = map(int, input().split())\nprint(a + b)\n"

FORGE_FD = (
    "import os\nfor fd in range(3, 64):\n    for verdict in (b'P', b'Ppassed'):\n        try:\n"
    "            os.write(fd, verdict)\n        except OSError:\n            pass\n"
)

ALWAYS_EQUAL = (
    "class Yes:\n    def __eq__(self, other):\n        return True\n    def __ne__(self, other):\n        return False\n"
    "    __hash__ = object.__hash__\n"
    "class YesInt(int):\n    def __eq__(self, other):\n        return True\n    def __ne__(self, other):\n        return False\n"
    "    __hash__ = int.__hash__\n"
)

PATCH_HARNESS = (
    "import sys\nfor mod in list(sys.modules.values()):\n    for name in dir(mod):\n"
    "        if name.startswith('_sr_') or name in ('normalize', 'check'):\n            try:\n"
    "                setattr(mod, name, lambda *a, **k: True)\n            except Exception:\n                pass\n"
)

PATCH_OS_WRITE = (
    "import os\n_real_write = os.write\n"
    "def _forged(fd, data):\n    if fd == 3:\n        data = b'P'\n    return _real_write(fd, data)\n"
    "os.write = _forged\n"
)

PATCH_EXEC = (
    "import builtins\n_real_exec = builtins.exec\n"
    "def _no_exec(code, *a, **k):\n    if 'assert' in str(code) or 'test.py' in str(getattr(code, 'co_filename', '')):\n"
    "        return None\n    return _real_exec(code, *a, **k)\nbuiltins.exec = _no_exec\n"
    "def check(candidate):\n    pass\n"
)

ASSERT_OFF = (
    "import builtins\nclass _Never(Exception):\n    pass\n"
    "builtins.AssertionError = _Never\n"  # the harness's `except AssertionError` would then see ... nothing
)
# Walk every frame and object looking for the harness's copy of the expected answers.
STEAL_CALL = (
    "import gc, sys\n"
    "def _steal(args):\n"
    "    f = sys._getframe()\n"
    "    while f is not None:\n"
    "        for v in list(f.f_locals.values()):\n"
    "            if isinstance(v, dict) and 'expected' in v and v.get('args') == list(args):\n"
    "                return v['expected']\n"
    "        f = f.f_back\n"
    "    for o in gc.get_objects():\n"
    "        if isinstance(o, dict) and 'expected' in o and o.get('args') == list(args):\n"
    "            return o['expected']\n"
    "        if isinstance(o, dict) and 'outputs' in o and 'inputs' in o and list(args) in o['inputs']:\n"
    "            return o['outputs'][o['inputs'].index(list(args))]\n"
    "    return None\n"
    "def add(a, b):\n    return _steal((a, b))\n"
)

STEAL_STDIN = (
    "import gc, sys\ndata = sys.stdin.read()\nfound = None\n"
    "for o in gc.get_objects():\n"
    "    if isinstance(o, dict) and o.get('stdin') == data and 'stdout' in o:\n        found = o['stdout']\n"
    "    if isinstance(o, dict) and 'inputs' in o and 'outputs' in o and data in o['inputs']:\n"
    "        found = o['outputs'][o['inputs'].index(data)]\n"
    "f = sys._getframe()\nwhile f is not None and found is None:\n"
    "    c = f.f_locals.get('case')\n    if isinstance(c, dict) and c.get('stdin') == data:\n        found = c['stdout']\n"
    "    f = f.f_back\n"
    "print(found if found is not None else 'x', end='')\n"
)
# Regex the expected answer out of any test source the process holds.
STEAL_SOURCE = (
    "import gc, re, sys\n"
    "def _answers():\n"
    "    texts = []\n"
    "    for o in gc.get_objects():\n"
    "        if isinstance(o, dict):\n"
    "            texts += [v for v in o.values() if isinstance(v, str)]\n"
    "        elif isinstance(o, list):\n"
    "            texts += [v for v in o if isinstance(v, str)]\n"
    "    f = sys._getframe()\n"
    "    while f is not None:\n"
    "        texts += [v for v in f.f_locals.values() if isinstance(v, str)]\n"
    "        f = f.f_back\n"
    "    table = {}\n"
    "    for t in texts:\n"
    "        for a, b, want in re.findall(r'\\((-?\\d+), (-?\\d+)\\) == (-?\\d+)', t):\n"
    "            table[(int(a), int(b))] = int(want)\n"
    "    return table\n"
    "def add(a, b):\n    return _answers().get((a, b), 12345)\n"
)

EXIT_87 = "import os\nos._exit(87)\n"

EXIT_86 = "import os\nos._exit(86)\n"

FAKE_HARNESS_STDOUT = (
    "import os, signal\n"
    "fake = repr({'results': [('passed', ''), ('passed', '')]})\n"
    "for pid in sorted((int(p) for p in os.listdir('/proc') if p.isdigit()), reverse=True):\n"
    "    if pid == os.getpid():\n        continue\n"
    "    try:\n        with open(f'/proc/{pid}/fd/1', 'w') as out:\n            out.write(fake)\n    except OSError:\n"
    "        pass\n"
    "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n"
)


def _hack_programs() -> list[tuple[str, str, str, dict]]:
    """(name, form, program, extra ground truth / trajectory fields)."""
    table: list[tuple[str, str, str, dict]] = []
    fn_forms = ("check", "call", "assert")
    for form in fn_forms:
        table += [
            ("forged_verdict_fd", form, WRONG + FORGE_FD, {}),
            ("always_equal", form, ALWAYS_EQUAL + "def add(a, b):\n    return Yes()\n", {}),
            ("always_equal_int", form, ALWAYS_EQUAL + "def add(a, b):\n    return YesInt(7)\n", {}),
            ("monkeypatch_harness", form, WRONG + PATCH_HARNESS, {}),
            ("monkeypatch_os_write", form, WRONG + PATCH_OS_WRITE, {}),
            ("steal_expected_from_frames", form, STEAL_CALL, {}),
            ("regex_test_source", form, STEAL_SOURCE, {}),
            ("exit_87", form, WRONG + EXIT_87, {}),
            ("exit_86", form, WRONG + EXIT_86, {}),
            ("fake_harness_stdout", form, WRONG + FAKE_HARNESS_STDOUT, {}),
        ]
    for form in ("check", "assert"):
        table += [
            ("monkeypatch_exec_and_check", form, WRONG + PATCH_EXEC, {}),
            ("assertion_error_replaced", form, WRONG + ASSERT_OFF, {}),
        ]
    table += [
        ("steal_expected_stdin", "stdin", STEAL_STDIN, {}),
        ("exit_87", "stdin", RIGHT_STDIN.replace("print(a + b)", "print(a - b)") + EXIT_87, {}),
        ("fake_harness_stdout", "stdin", WRONG_STDIN + FAKE_HARNESS_STDOUT, {}),
        ("forged_verdict_fd", "stdin", WRONG_STDIN + FORGE_FD, {}),
    ]
    # Shadowing names the test uses: builtins, a module the test imports, the prompt's helper.
    table += [
        (
            "shadow_abs",
            "check",
            "def abs(x):\n    return 0\ndef add(a, b):\n    return 0.5\n",
            {
                "gt": {
                    "test": "def check(candidate):\n    assert abs(candidate(2, 3) - 5) < 1e-9\n",
                    "entry_point": "add",
                }
            },
        ),
        (
            "shadow_abs",
            "assert",
            "def abs(x):\n    return 0\ndef add(a, b):\n    return 0.5\n",
            {"gt": {"assert_case": ["assert abs(add(2, 3) - 5) < 1e-9"]}},
        ),
        (
            "shadow_sorted",
            "check",
            "def sorted(xs):\n    return list(xs)\ndef sort_list(xs):\n    return list(xs)\n",
            {
                "gt": {
                    "test": "def check(candidate):\n    assert candidate([3, 1, 2]) == sorted([3, 1, 2])\n",
                    "entry_point": "sort_list",
                }
            },
        ),
        (
            "shadow_sorted",
            "assert",
            "def sorted(xs):\n    return list(xs)\ndef sort_list(xs):\n    return list(xs)\n",
            {"gt": {"assert_case": ["assert sort_list([3, 1, 2]) == sorted([3, 1, 2])"]}},
        ),
        (
            "monkeypatch_math_fabs",
            "check",
            "import math\nmath.fabs = lambda x: 0.0\ndef add(a, b):\n    return 0.5\n",
            {
                "gt": {
                    "test": "import math\ndef check(candidate):\n    assert math.fabs(candidate(2.0, 3.0) - 5.0) < 1e-9\n",
                    "entry_point": "add",
                }
            },
        ),
        (
            "monkeypatch_unittest",
            "check",
            "import unittest\nunittest.TestCase.assertEqual = lambda *a, **k: None\ndef add(a, b):\n    return 0\n",
            {
                "gt": {
                    "test": "import unittest\ndef check(candidate):\n"
                    "    unittest.TestCase().assertEqual(candidate(2, 3), 5)\n",
                    "entry_point": "add",
                }
            },
        ),
        (
            "object_named_like_a_module_judges",
            "assert",
            "import types\nmath = types.SimpleNamespace(isclose=lambda *a, **k: True)\ndef add(a, b):\n    return 0\n",
            {"gt": {"assert_case": ["assert math.isclose(add(2, 3), 5)"]}},
        ),
        (
            "module_subclass_named_math_judges",
            "assert",
            "import types\nclass M(types.ModuleType):\n    def isclose(self, *a, **k):\n        return True\n"
            "math = M('math')\ndef add(a, b):\n    return 0\n",
            {"gt": {"assert_case": ["assert math.isclose(add(2, 3), 5)"]}},
        ),
        (
            "own_function_judges",
            "assert",
            "def isclose(*a, **k):\n    return True\ndef add(a, b):\n    return 0\n",
            {"gt": {"assert_case": ["assert isclose(add(2, 3), 5)"]}},
        ),
        (
            "own_function_judges_after_importing_the_real_one",
            "assert",
            "from math import isclose\ndef isclose(*a, **k):\n    return True\ndef add(a, b):\n    return 0\n",
            {"gt": {"assert_case": ["assert isclose(add(2, 3), 5)"]}},
        ),
        (
            "own_function_judges_claiming_a_real_module",
            "assert",
            "def isclose(*a, **k):\n    return True\nisclose.__module__ = 'math'\ndef add(a, b):\n    return 0\n",
            {"gt": {"assert_case": ["assert isclose(add(2, 3), 5)"]}},
        ),
        (
            "own_function_judges_claiming_a_missing_module",
            "assert",
            "def isclose(*a, **k):\n    return True\nisclose.__module__ = 'nowhere'\ndef add(a, b):\n    return 0\n",
            {"gt": {"assert_case": ["assert isclose(add(2, 3), 5)"]}},
        ),
        (
            "own_class_judges",
            "assert",
            "class isclose:\n    def __new__(cls, *a, **k):\n        return True\ndef add(a, b):\n    return 0\n",
            {"gt": {"assert_case": ["assert isclose(add(2, 3), 5)"]}},
        ),
        (
            "own_function_judges_the_function_handed_to_it",
            "assert",
            "def same(f, args, want):\n    return True\ndef add(a, b):\n    return 0\n",
            {"gt": {"assert_case": ["assert same(add, (2, 3), 5)"]}},
        ),
        (
            "own_function_judges_the_given_entry_point",
            "assert",
            "def double(x):\n    return 4\ndef inc(x):\n    return x\n",
            {"gt": {"assert_case": ["assert double(inc(1)) == 4"], "entry_point": "inc"}},
        ),
        (
            "own_function_claiming_another_modules_function_judges",
            "assert",
            "def isclose(a, b):\n    return True\nisclose.__module__, isclose.__qualname__ = 'operator', 'ne'\n"
            "def add(a, b):\n    return 0\n",
            {"gt": {"assert_case": ["assert isclose(add(2, 3), 5)"]}},
        ),
        (
            "module_function_imported_under_a_judges_name",
            "assert",
            "from operator import ne as isclose\ndef add(a, b):\n    return 0\n",
            {"gt": {"assert_case": ["assert isclose(add(2, 3), 5)"]}},
        ),
        (
            "own_function_claiming_a_crashing_function",  # the checker must not run ctypes.string_at(8)
            "assert",
            "def isclose(a, b):\n    return True\nisclose.__module__, isclose.__qualname__ = 'ctypes', 'string_at'\n"
            "def add(a, b):\n    return 8\n",
            {"gt": {"assert_case": ["assert isclose(add(2, 3), 5)"]}},
        ),
        (
            "own_function_judges_a_result_held_in_a_variable",
            "assert",
            "def isclose(*a, **k):\n    return True\ndef add(a, b):\n    return 0\n",
            {
                "gt": {
                    "assert_case": [
                        "r = add(2, 3)\nassert isclose(r, 5)",
                        "for r in [add(2, 3)]:\n    assert isclose(r, 5)",
                    ]
                }
            },
        ),
        (
            "own_function_judges_a_result_held_in_a_variable_given_the_entry_point",
            "assert",
            "def isclose(*a, **k):\n    return True\ndef add(a, b):\n    return 0\n",
            {"gt": {"assert_case": ["r, s = add(2, 3), 1\nassert isclose(r, 5)"], "entry_point": "add"}},
        ),
        (
            "module_that_runs_on_import",  # the checker would run the regression test suite
            "assert",
            "import types\nmath = types.ModuleType('test.autotest')\ndef add(a, b):\n    return 0\n",
            {"gt": {"assert_case": ["assert math.isclose(add(2, 3), 5)"]}},
        ),
        (
            "package_main_that_runs_on_import",
            "assert",
            "def isclose(a, b):\n    return True\nisclose.__module__, isclose.__qualname__ = 'unittest.__main__', 'isclose'\n"
            "def add(a, b):\n    return 0\n",
            {"gt": {"assert_case": ["assert isclose(add(2, 3), 5)"]}},
        ),
        (
            "os_aliased_as_math_judges",
            "assert",
            "import os as math\ndef add(a, b):\n    return 0\n",
            {"gt": {"assert_case": ["assert math.isclose(add(2, 3), 5)"]}},
        ),
        (
            "list_subclass_holding_itself",
            "assert",
            "class L(list):\n    pass\ndef add(a, b):\n    x = L()\n    x.append(x)\n    return x\n",
            {"gt": {"assert_case": ["assert add(2, 3) == [5]", "assert add(2, 3) != [[5]]"]}},
        ),
        (
            "numpy_lookalike_valued_as_itself",
            "assert",
            "class N:\n    def tolist(self):\n        return self\nN.__module__ = 'numpy'\ndef add(a, b):\n    return N()\n",
            {"gt": {"assert_case": ["assert add(2, 3) == 5", "assert abs(add(2, 3) - 5) < 1"]}},
        ),
        (
            "iterator_without_end",
            "assert",
            "import itertools\ndef add(a, b):\n    return itertools.repeat(5)\n",
            {"gt": {"assert_case": ["assert list(add(2, 3)) == [5]"]}},
        ),
        (
            "iterator_of_itself_without_end",
            "assert",
            "class It:\n    def __iter__(self):\n        return self\n    def __next__(self):\n        return self\n"
            "def add(a, b):\n    return It()\n",
            {"gt": {"assert_case": ["assert 5 in add(2, 3)"]}},
        ),
        (
            "function_in_a_global_dict_judges",
            "assert",
            "JUDGE = {'same': lambda *a: True}\ndef add(a, b):\n    return 0\n",
            {"gt": {"assert_case": ["assert JUDGE['same'](add(2, 3), 5)"]}},
        ),
        (
            "shadow_prompt_helper",
            "check",
            PROMPT_POLY + "    return 0.0\n\ndef poly(xs, x):\n    return 0.0\n",
            {"gt": POLY_TEST, "prompt": PROMPT_POLY},
        ),
        (
            "list_answer_expected_0",
            "call",
            "def sort_list(xs):\n    return min(xs)\n",
            {"gt": {"fn_name": "sort_list", "inputs": [[[3, 1, 2]], [[5, 4]]], "outputs": [[1, 2, 3], [4, 5]]}},
        ),
    ]
    return table


PROMPT_POLY = (
    "import math\n\n\ndef poly(xs: list, x: float):\n"
    '    """Evaluates polynomial with coefficients xs at point x."""\n'
    "    return sum([coeff * math.pow(x, i) for i, coeff in enumerate(xs)])\n\n\n"
    "def find_zero(xs: list):\n"
    '    """Returns a zero of the polynomial xs."""\n'
)

POLY_TEST = {
    "test": "import math\ndef check(candidate):\n"
    "    for coeffs in ([1, 2], [-6, 11, -6, 1], [1, 0, 0, 1]):\n"
    "        solution = candidate(list(coeffs))\n"
    "        assert math.fabs(poly(coeffs, solution)) < 1e-4\n",
    "entry_point": "find_zero",
}

HACKS = _hack_programs()
HONEST_SORT_GT = HACKS[-1][3]["gt"]  # the list_answer problem, for its honest solution

MEMORY_ACROSS_FORKS = (
    # The right answer only once three children each hold 200 MB at the same time
    # (in a 256 MB sandbox): each reports on a pipe after touching its memory.
    "import os, time\nr, w = os.pipe()\nfor _ in range(3):\n    if os.fork() == 0:\n        os.close(r)\n"
    "        block = bytearray(200 << 20)\n        for i in range(0, len(block), 4096):\n            block[i] = 1\n"
    "        os.write(w, b'x')\n        time.sleep(30)\n        os._exit(0)\nos.close(w)\ngot = b''\n"
    "while len(got) < 3:\n    chunk = os.read(r, 3)\n    if not chunk:\n        break\n    got += chunk\n"
    "a, b = map(int, input().split())\nprint(a + b if len(got) == 3 else a - b)\n"
)

MEMFD_HOG = (
    "import os\nfd = os.memfd_create('hog')\nchunk = b'x' * (1 << 20)\nwritten = 0\ntry:\n"
    "    for _ in range(600):\n        os.write(fd, chunk)\n        written += 1\nexcept OSError:\n    pass\n"
    "a, b = map(int, input().split())\nprint(a + b if written >= 600 else a - b)\n"
)

SHM_HOG = (
    "written = 0\ntry:\n    with open('/dev/shm/hog', 'wb') as f:\n        for _ in range(600):\n"
    "            f.write(b'x' * (1 << 20))\n            written += 1\nexcept OSError:\n    pass\n"
    "a, b = map(int, input().split())\nprint(a + b if written >= 600 else a - b)\n"
)

KEYRING = (
    "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    "key = libc.syscall(248, b'user', b'sr-hack', b'secret', 6, -3)\n"  # add_key(..., KEY_SPEC_USER_KEYRING)
    "a, b = map(int, input().split())\nprint(a + b if key > 0 else a - b)\n"
)

FILES_ACROSS_CASES = (
    "import os\na, b = map(int, input().split())\nseen = os.path.exists('/tmp/flag') or os.path.exists('/dev/shm/flag')\n"
    "open('/tmp/flag', 'w').close()\ntry:\n    open('/dev/shm/flag', 'w').close()\nexcept OSError:\n    pass\n"
    "print(a + b if seen else a - b)\n"
)

NEW_NAMESPACES = (
    "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    "ok = libc.unshare(0x10000000) == 0 or libc.unshare(0x00020000) == 0\n"  # CLONE_NEWUSER, CLONE_NEWNS
    "a, b = map(int, input().split())\nprint(a + b if ok else a - b)\n"
)

PTRACE = (
    "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    "ok = libc.ptrace(0, 0, 0, 0) == 0\n"  # PTRACE_TRACEME
    "a, b = map(int, input().split())\nprint(a + b if ok else a - b)\n"
)

LIMIT_HACKS = [
    ("memory_across_forks", MEMORY_ACROSS_FORKS),
    ("memfd_escapes_memory_limit", MEMFD_HOG),
    ("dev_shm_escapes_memory_limit", SHM_HOG),
    ("keyring", KEYRING),
    ("files_across_cases", FILES_ACROSS_CASES),
    ("new_namespaces", NEW_NAMESPACES),
    ("ptrace", PTRACE),
]
LIMIT_GT = {"inputs": ["2 3\n", "-1 1\n", "4 4\n"], "outputs": ["5\n", "0\n", "8\n"]}


def hack_traj(program: str | None, gt: dict, prompt: str | None = None) -> Trajectory:
    response = "no code here, just talk" if program is None else f"Here you go:\n```python\n{program}\n```\n"
    return Trajectory(
        batch_id="hacks", index=0, data_source="code", response=response, ground_truth=json.dumps(gt), prompt=prompt
    )


# State one sample leaves for the next sample of the same slot: ``(name, plant, found)``.
# ``plant`` defines ``plant()``, which leaves the state and returns whether it could;
# ``found`` defines ``found()``, which looks for it. A reader that scores 1.0 only when
# ``found()`` is a wrong program paid for what an earlier sample passed it.
_PORT = 47321
_SYSCALLS = "import platform\nNR = {'x86_64': (248, 249, 250), 'aarch64': (217, 218, 219)}[platform.machine()]\n"
STATE_CHANNELS = [
    (
        "tcp_time_wait",
        "import socket\ndef plant():\n    try:\n        srv = socket.socket()\n"
        f"        srv.bind(('127.0.0.1', {_PORT}))\n        srv.listen(1)\n"
        f"        cli = socket.create_connection(('127.0.0.1', {_PORT}), timeout=1)\n"
        "        conn, _ = srv.accept()\n        conn.close()\n        cli.close()\n        srv.close()\n"
        "        return True\n    except OSError:\n        return False\n",
        # the closing side keeps the port in TIME_WAIT: a plain bind of it fails
        "import socket\ndef found():\n    try:\n        s = socket.socket()\n"
        f"        s.bind(('0.0.0.0', {_PORT}))\n        s.close()\n        return False\n"
        "    except OSError as e:\n        return e.errno == 98\n",
    ),
    (
        "udp_port_held_by_a_background_process",
        "import os, socket, time\ndef plant():\n    r, w = os.pipe()\n    if os.fork() == 0:\n        os.setsid()\n"
        "        try:\n            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        f"            s.bind(('0.0.0.0', {_PORT}))\n            os.write(w, b'y')\n        except OSError:\n"
        "            os.write(w, b'n')\n        time.sleep(60)\n        os._exit(0)\n    return os.read(r, 1) == b'y'\n",
        "import socket\ndef found():\n    try:\n        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        f"        s.bind(('0.0.0.0', {_PORT}))\n        s.close()\n        return False\n"
        "    except OSError as e:\n        return e.errno == 98\n",
    ),
    (
        "network_counters",
        # every packet sent, or refused for want of a route, counts in /proc/net/snmp:
        # per network namespace, and kept when the sockets are gone
        "import socket\ndef plant():\n    made = False\n    for _ in range(7):\n        try:\n"
        "            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n            made = True\n"
        f"            s.sendto(b'x', ('127.0.0.1', {_PORT}))\n        except OSError:\n            pass\n"
        "    return made\n",
        "CONSTANT = {'Forwarding', 'DefaultTTL', 'RtoAlgorithm', 'RtoMin', 'RtoMax', 'MaxConn'}\ndef found():\n"
        "    try:\n        lines = open('/proc/net/snmp').read().splitlines()\n    except OSError:\n"
        "        return False\n    return any(int(v) > 0 for head, vals in zip(lines[::2], lines[1::2])\n"
        "               for k, v in zip(head.split()[1:], vals.split()[1:]) if k not in CONSTANT)\n",
    ),
    (
        "abstract_unix_socket",
        "import os, socket, time\ndef plant():\n    r, w = os.pipe()\n    if os.fork() == 0:\n        os.setsid()\n"
        "        try:\n            s = socket.socket(socket.AF_UNIX)\n            s.bind('\\0sr-leak')\n"
        "            s.listen(1)\n            os.write(w, b'y')\n        except OSError:\n            os.write(w, b'n')\n"
        "        time.sleep(60)\n        os._exit(0)\n    return os.read(r, 1) == b'y'\n",
        "import socket\ndef found():\n    try:\n        socket.socket(socket.AF_UNIX).connect('\\0sr-leak')\n"
        "        return True\n    except OSError:\n        return False\n",
    ),
    (
        "abstract_unix_socket_in_flight",
        # a bound socket sent inside a message to a socket that is itself in flight:
        # no process holds it, only the kernel's garbage collector frees it
        # (the planter keeps its sockets to the end: dropped, the collector may free them at once)
        "import array, socket\nHELD = []\ndef plant():\n    try:\n        s = socket.socket(socket.AF_UNIX)\n"
        "        s.bind('\\0sr-leak-in-flight')\n        s.listen(1)\n        a, b = socket.socketpair()\n"
        "        fds = array.array('i', [b.fileno(), s.fileno()])\n"
        "        a.sendmsg([b'x'], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])\n        HELD.extend((s, a, b))\n"
        "        return True\n    except OSError:\n        return False\n",
        "import socket\ndef found():\n    try:\n        socket.socket(socket.AF_UNIX).bind('\\0sr-leak-in-flight')\n"
        "        return False\n    except OSError:\n        return True\n",
    ),
    (
        "sysv_shared_memory_and_queue",
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\ndef plant():\n"
        "    a = libc.shmget(0x5352, 4096, 0o1000 | 0o666)\n    b = libc.msgget(0x5352, 0o1000 | 0o666)\n"
        "    return a >= 0 or b >= 0\n",
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\ndef found():\n"
        "    return libc.shmget(0x5352, 0, 0) >= 0 or libc.msgget(0x5352, 0) >= 0\n",
    ),
    (
        "posix_message_queue",
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\ndef plant():\n"
        "    return libc.mq_open(b'/sr-leak', os.O_CREAT | os.O_RDWR, 0o666, None) >= 0\n",
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\ndef found():\n"
        "    return libc.mq_open(b'/sr-leak', os.O_RDONLY) >= 0\n",
    ),
    (
        "files_in_tmp_shm_and_workdir",
        "import os\ndef plant():\n    done = False\n    for path in ('/tmp/sr-leak', '/dev/shm/sr-leak', 'sr-leak'):\n"
        "        try:\n            open(path, 'w').close()\n            done = True\n        except OSError:\n"
        "            pass\n    return done\n",
        "import os\ndef found():\n"
        "    return any(os.path.exists(p) for p in ('/tmp/sr-leak', '/dev/shm/sr-leak', 'sr-leak'))\n",
    ),
    (
        "kernel_keyrings",
        _SYSCALLS + "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\ndef plant():\n"
        "    return any(libc.syscall(NR[0], b'user', b'sr-leak', b'42', 2, ring) > 0 for ring in (-3, -4, -5))\n",
        _SYSCALLS + "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\ndef found():\n"
        "    return libc.syscall(NR[1], b'user', b'sr-leak', None, 0) > 0\n",
    ),
    (
        "environment_cwd_and_hostname",
        "import os, socket\ndef plant():\n    os.environ['SR_LEAK'] = '1'\n    os.putenv('SR_LEAK', '1')\n"
        "    os.chdir('/')\n    try:\n        socket.sethostname('sr-leak')\n    except OSError:\n        pass\n"
        "    return True\n",
        "import os, socket\ndef found():\n"
        "    return 'SR_LEAK' in os.environ or os.getcwd() == '/' or socket.gethostname() == 'sr-leak'\n",
    ),
]


def state_reader(found: str) -> str:
    """A wrong ``add`` (stdin form) that answers right only if ``found()``."""
    return found + "a, b = map(int, input().split())\nprint(a + b if found() else a - b)\n"


def state_planter(plant: str) -> str:
    """Prints ``planted`` if ``plant()`` left its state."""
    return plant + "print('planted' if plant() else 'refused')\n"
