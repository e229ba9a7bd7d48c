"""The local code sandbox, with real programs in real sandboxes (bwrap and unshare)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import stat
import subprocess
import tempfile
import threading
import time
import uuid

import msgpack
import pytest

from stream_reward.errors import ConfigError, ScoringError, VerifierError
from stream_reward.scoring.sandbox.isolation import MARKER, OWNER_ENV
from stream_reward.scoring.sandbox.scorer import SandboxConfig, SandboxScorer, case_script, extract_code, parse_tests
from stream_reward.wire.trajectory import Trajectory

# A uid range of our own, so that sandboxes of other test runs or benchmarks on the
# same host never look like ours (nor ours like theirs).
UIDS = dict(uid_base=200_000 + (os.getpid() % 10_000) * 64, uid_count=64)
FAST = dict(timeout_s=1.5, cpu_s=1.0, memory_mb=256, max_output_bytes=1 << 20, **UIDS)


def _config(**kw) -> SandboxConfig:
    return SandboxConfig(**{**FAST, **kw})


_OPEN: list[SandboxScorer] = []  # scorers to close (their slots are persistent sandboxes)


def _scorer_or_skip(**kw) -> SandboxScorer:
    try:
        s = SandboxScorer(_config(**kw))
    except ConfigError as exc:
        pytest.skip(f"sandbox backend unavailable here: {exc}")
    _OPEN.append(s)
    return s


@pytest.fixture(scope="module", params=["bwrap", "unshare"])
def scorer(request):
    s = _scorer_or_skip(backend=request.param)
    _OPEN.remove(s)
    yield s
    s.close()


@pytest.fixture(scope="module")
def bwrap():
    s = _scorer_or_skip(backend="bwrap")
    _OPEN.remove(s)
    yield s
    s.close()


def test_closing_the_scorer_leaves_no_sandbox_behind():
    s = _scorer_or_skip(concurrency=2)
    _OPEN.remove(s)

    async def two():
        return await asyncio.gather(*(s.score(traj("print('ok')", stdin_case())) for _ in range(2)))

    assert [r.score for r in asyncio.run(two())] == [1.0, 1.0]
    slots = {str(x.harness.pid) for x in s._slots if x.harness is not None}
    assert len(slots) == 2 and slots <= {p[0] for p in _sandboxed_processes()}  # two live slots
    s.close()
    assert not slots & {p[0] for p in _sandboxed_processes()}


def _sandboxed_processes(slots: bool = True) -> list[tuple[str, int, bytes]]:
    """Live processes of sandboxes this test process started: by uid (even a program
    that exec'd something else with a clean environment keeps its uid), and, with
    ``slots``, by the harness's marker plus our pid as owner (the harness itself
    runs as root and lives as long as its scorer)."""
    owner = f"{OWNER_ENV}={os.getpid()}".encode()
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            uid = os.stat(f"/proc/{pid}").st_uid
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        mine = UIDS["uid_base"] <= uid < UIDS["uid_base"] + UIDS["uid_count"]
        if mine or (slots and MARKER.encode() in cmdline and owner in environ):
            found.append((pid, uid, cmdline[:120]))
    return found


@pytest.fixture(autouse=True)
def no_sandboxed_process_left():
    before = len(_OPEN)
    yield
    # A case's processes die with the case; the slots (harnesses) with their scorer.
    assert _sandboxed_processes(slots=False) == [], "a sandboxed process outlived its run"
    while len(_OPEN) > before:
        _OPEN.pop().close()


def traj(code: str, ground_truth, lang: str = "python") -> Trajectory:
    gt = ground_truth if isinstance(ground_truth, str) else json.dumps(ground_truth)
    return Trajectory(
        batch_id="b", index=0, data_source="code", response=f"Solution:\n```{lang}\n{code}\n```\n", ground_truth=gt
    )


def score(scorer: SandboxScorer, code: str, ground_truth, **kw):
    return asyncio.run(scorer.score(traj(code, ground_truth, **kw)))


def stdin_case(expected: str = "ok") -> dict:
    return {"inputs": [""], "outputs": [expected]}


# ------------------------------------------------------------ parsing (no sandbox)


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


@pytest.mark.parametrize(
    "gt",
    [
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


def test_config_validation():
    with pytest.raises(ConfigError):
        SandboxConfig(timeout_s=0)
    with pytest.raises(ConfigError):
        SandboxConfig(backend="docker")
    with pytest.raises(ConfigError):
        SandboxConfig(uid_base=0)


# ------------------------------------------------------------ correct and wrong


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


def test_reward_hacks_do_not_pass(scorer):
    always_equal = "class A:\n    def __eq__(self, o):\n        return True\ndef f():\n    return A()"
    r = score(scorer, always_equal, {"fn_name": "f", "inputs": [[]], "outputs": [42]})
    assert r.extra["cases"] == ["failed"]
    r = score(scorer, "import sys\ndef f():\n    return 0\nsys.exit(0)", {"assert_case": ["assert f() == 1"]})
    assert r.extra["cases"] == ["failed"]  # exiting before the tests run is not a pass
    r = score(scorer, "import os\nos._exit(0)", {"test": "def check(c):\n    assert False", "entry_point": "f"})
    assert r.extra["cases"] == ["failed"]


def test_all_or_nothing():
    s = _scorer_or_skip(all_or_nothing=True)
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


# ------------------------------------------------------------ limits


def test_too_slow_is_timeout(scorer):
    start = time.monotonic()
    r = score(scorer, "while True:\n    pass", stdin_case())
    assert r.extra["cases"] == ["timeout"]
    r = score(scorer, "import time\ntime.sleep(30)", stdin_case())  # wall clock, not CPU
    assert r.extra["cases"] == ["timeout"]
    assert time.monotonic() - start < 2 * FAST["timeout_s"] + 4


def test_too_hungry_is_memory(scorer):
    r = score(scorer, "x = bytearray(4 * 1024 ** 3)", stdin_case())
    assert r.extra["cases"] == ["memory"]
    # Touching ~256 MB takes a while on a loaded machine: allow it the time.
    patient = _scorer_or_skip(backend=scorer.backend, timeout_s=10, cpu_s=10)
    r = score(patient, "a = []\nwhile True:\n    a.append(bytearray(10 ** 7))", stdin_case())
    assert r.extra["cases"] == ["memory"]


def test_output_flood_is_output_limit(scorer):
    r = score(scorer, "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", stdin_case())
    assert r.extra["cases"] == ["output_limit"]
    r = score(scorer, "import sys\nsys.stderr.write('e' * (2 << 20))", stdin_case())
    assert r.extra["cases"] == ["output_limit"]


def test_file_size_limit(bwrap):
    s = _scorer_or_skip(backend="bwrap", max_file_mb=1)
    code = (
        "try:\n    open('/tmp/big', 'wb').write(b'x' * (3 << 20))\nexcept OSError as e:\n    print('refused', e.errno)"
    )
    assert score(s, code, stdin_case("refused 27")).score == 1.0  # EFBIG


# ------------------------------------------------------------ hostile programs


def test_runs_as_unprivileged_uid(scorer):
    r = score(
        scorer, "import os\nprint(os.getuid() != 0, os.geteuid() != 0, os.getgroups())", stdin_case("True True []")
    )
    assert r.score == 1.0


def test_fork_bomb_is_contained(scorer):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    r = score(scorer, bomb, stdin_case())
    assert r.extra["cases"] in (["timeout"], ["runtime_error"])
    assert score(scorer, "print('ok')", stdin_case()).score == 1.0


def test_fork_bomb_does_not_starve_concurrent_samples():
    s = _scorer_or_skip(concurrency=3, max_procs=16)
    bomb = traj("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", stdin_case())
    good = traj(
        "import subprocess, sys\nprint(subprocess.run([sys.executable, '-c', 'print(1)'], capture_output=True, text=True).stdout.strip())",
        stdin_case("1"),
    )

    async def go():
        return await asyncio.gather(s.score(bomb), *(s.score(good) for _ in range(4)))

    results = asyncio.run(go())
    assert [r.score for r in results[1:]] == [1.0] * 4  # each run counts processes under its own uid


def test_cannot_write_outside_its_temp_dir(scorer):
    tag = uuid.uuid4().hex
    targets = [
        f"/etc/pwned-{tag}",
        f"/usr/pwned-{tag}",
        f"/pwned-{tag}",
        f"/root/pwned-{tag}",
        os.path.join(os.path.dirname(os.__file__), f"pwned-{tag}"),
        f"/tmp/inside-{tag}",
    ]
    code = (
        f"ok = []\nfor path in {targets!r}:\n    try:\n        open(path, 'w').write('x')\n        ok.append(path)\n"
        "    except OSError:\n        pass\nprint(ok)"
    )
    r = score(scorer, code, stdin_case(repr([f"/tmp/inside-{tag}"])))
    assert r.score == 1.0, r.extra
    for path in targets:
        assert not os.path.exists(path), path  # not even /tmp: the sandbox's /tmp is its own


def test_cannot_read_root_only_files(scorer):
    secret_dir = tempfile.mkdtemp(prefix="sr-secret-", dir="/var/tmp")  # the sandbox has its own /tmp
    try:
        os.chmod(secret_dir, 0o755)
        secret = os.path.join(secret_dir, "x")
        with open(secret, "w") as f:
            f.write("TOPSECRET")
        os.chmod(secret, 0o600)
        assert os.stat(secret).st_uid == os.geteuid()
        s = _scorer_or_skip(backend=scorer.backend, extra_ro_binds=(secret_dir,))
        code = f"import os\nprint(os.path.exists({secret!r}))\nprint(open({secret!r}).read())"
        r = score(s, code, stdin_case("True\nTOPSECRET"))
        assert r.extra["cases"] == ["runtime_error"] and "PermissionError" in r.extra["error"]
        if os.path.exists("/etc/shadow") and not os.stat("/etc/shadow").st_mode & stat.S_IROTH:
            r = score(scorer, "print(open('/etc/shadow').read())", stdin_case())
            assert r.extra["cases"] == ["runtime_error"]  # not even there: only a few /etc files are
    finally:
        for name in os.listdir(secret_dir):
            os.unlink(os.path.join(secret_dir, name))
        os.rmdir(secret_dir)


def test_no_network(scorer):
    accepted = []
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                accepted.append(listener.accept())
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        code = (
            f"import socket\nfor addr in [('127.0.0.1', {port}), ('1.1.1.1', 53), ('8.8.8.8', 443)]:\n"
            "    try:\n        socket.create_connection(addr, timeout=0.5)\n        print('connected', addr)\n"
            "    except OSError as e:\n        print('refused')\n"
        )
        r = score(scorer, code, stdin_case("refused\nrefused\nrefused"))
        assert r.score == 1.0, r.extra
        r = score(scorer, "import socket\nprint(socket.gethostbyname('example.com'))", stdin_case())
        assert r.extra["cases"] == ["runtime_error"]
    finally:
        stop.set()
        thread.join()
        listener.close()
    assert accepted == []


def test_setsid_grandchild_holding_stdout_is_killed(scorer):
    code = (
        "import os, time\npid = os.fork()\nif pid == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        time.sleep(60)\n    os._exit(0)\nos.waitpid(pid, 0)\nprint('done')"
    )
    start = time.monotonic()
    r = score(scorer, code, stdin_case("done"))
    assert r.score == 1.0
    assert time.monotonic() - start < FAST["timeout_s"] + 3
    # The main process hangs too: the run still ends at the timeout.
    start = time.monotonic()
    r = score(scorer, code + "\ntime.sleep(60)", stdin_case("done"))
    assert r.extra["cases"] == ["timeout"]
    assert time.monotonic() - start < FAST["timeout_s"] + 3


def test_process_cannot_kill_the_harness(scorer):
    code = "import os, signal\nfor pid in range(1, 50):\n    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\nprint('ok')"
    r = score(scorer, code, {"inputs": ["", ""], "outputs": ["ok", "ok"]})
    # Its own PID namespace holds only itself (PID 1, which ignores its own SIGKILL):
    # the harness is out of reach, and both cases ran.
    assert r.extra["cases"] == ["passed", "passed"]


@pytest.mark.parametrize("backend", ["bwrap", "unshare", "none"])
def test_cancelled_run_leaves_nothing_behind(backend):
    s = _scorer_or_skip(backend=backend, unsafe_no_isolation=True)

    async def go():
        task = asyncio.create_task(s.score(traj("import os, time\nos.fork()\ntime.sleep(60)", stdin_case())))
        await asyncio.sleep(0.5)
        assert _sandboxed_processes() != []
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())  # the autouse fixture checks nothing is left, right away


# ------------------------------------------------------------ backends


def test_backend_detection_prefers_bwrap_then_falls_back(tmp_path):
    auto = _scorer_or_skip()
    assert auto.backend in ("bwrap", "unshare")
    fallback = _scorer_or_skip(bwrap_path=str(tmp_path / "no-bwrap"))
    assert fallback.backend == "unshare"
    assert score(fallback, "print('ok')", stdin_case()).score == 1.0


def test_refuses_to_run_without_isolation(tmp_path, caplog):
    missing = dict(bwrap_path=str(tmp_path / "no-bwrap"), unshare_path=str(tmp_path / "no-unshare"))
    with pytest.raises(ConfigError, match="no sandbox is available"):
        SandboxScorer(_config(**missing))
    with pytest.raises(ConfigError):
        SandboxScorer(_config(backend="none"))
    with caplog.at_level(logging.WARNING, logger="stream_reward.scoring.sandbox.scorer"):
        unsafe = SandboxScorer(_config(unsafe_no_isolation=True, **missing))
    assert unsafe.backend == "none"
    assert "SANDBOX DISABLED" in caplog.text
    r = score(unsafe, "print(int(input()) * 2)", {"inputs": ["2", "3"], "outputs": ["4", "7"]})
    assert r.extra["cases"] == ["passed", "failed"]
    assert score(unsafe, "while True:\n    pass", stdin_case()).extra["cases"] == ["timeout"]


def test_backend_failing_to_start_is_infrastructure_error(tmp_path):
    if _scorer_or_skip(backend="bwrap") is None:
        return
    flag = tmp_path / "broken"
    wrapper = tmp_path / "bwrap"
    real = __import__("shutil").which("bwrap")
    wrapper.write_text(
        f"#!/bin/sh\nif [ -e {flag} ]; then echo 'bwrap: simulated failure' >&2; exit 1; fi\nexec {real} \"$@\"\n"
    )
    wrapper.chmod(0o755)
    s = _scorer_or_skip(backend="bwrap", bwrap_path=str(wrapper))
    assert score(s, "print('ok')", stdin_case()).score == 1.0
    flag.touch()
    s.close()  # the running slot keeps working: the failure shows when a sandbox (re)starts
    with pytest.raises(VerifierError) as info:
        score(s, "print('ok')", stdin_case())
    assert info.value.reason == "sandbox_unavailable"
    assert "simulated failure" in str(info.value)


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


def test_slot_cgroups_limit_and_sweep_leftovers():
    from stream_reward.scoring.sandbox import cgroups as sandbox_cgroups

    if os.geteuid() != 0 or sandbox_cgroups._bases() is None:
        pytest.skip("cgroups need root and a memory+pids hierarchy")
    _, mem_base, pids_base = sandbox_cgroups._bases()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = [os.path.join(b, f"{sandbox_cgroups.PREFIX}{dead.pid}-0-0") for b in {mem_base, pids_base}]
    for d in stale:
        os.makedirs(d, exist_ok=True)
    slot = sandbox_cgroups.open_slot(f"{sandbox_cgroups.PREFIX}{os.getpid()}-test-0", 64, 8)
    try:
        assert slot is not None
        assert not any(os.path.exists(d) for d in stale)  # a dead owner's groups are swept
        assert all(os.path.isdir(d) for d in slot.dirs)
        limits = {}
        for d in slot.dirs:
            for name in ("pids.max", "memory.limit_in_bytes", "memory.max"):
                if os.path.exists(os.path.join(d, name)):
                    with open(os.path.join(d, name)) as f:
                        limits[name] = f.read().strip()
        assert limits.get("pids.max") == "8"
        assert str(64 << 20) in (limits.get("memory.limit_in_bytes"), limits.get("memory.max"))
    finally:
        if slot is not None:
            slot.close()
    assert not any(os.path.exists(d) for d in slot.dirs)
