"""Keeping a candidate apart from the host and from other samples, whichever backend
(bwrap, unshare) builds the wall: it runs as an unprivileged uid, cannot write outside
its own /tmp nor read root-only files, has no network, cannot reach the harness, and a
fork bomb starves neither its neighbours nor the next sample; every process it starts
dies with its run, a cancelled run included. Kernel state (keyrings, System V IPC) does
not survive a case or a sample, and the limits that must hold per sandbox (memory across
forks, memfd and /dev/shm, new namespaces, ptrace) hold. Without a working backend the
scorer refuses to run unless told ``unsafe_no_isolation``; a backend failing to start is
an infrastructure error. Run by a non-root worker (bwrap in a user namespace, no
cgroups), every hack still scores 0.0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
import sandbox_hacks as hacks
from sandbox_hacks import LIMIT_GT, LIMIT_HACKS, STATE_CHANNELS, hack_traj, state_planter, state_reader
from sandbox_support import FAST, config, run, sandboxed_processes, score, stdin_case, traj

from stream_reward.errors import ConfigError, VerifierError
from stream_reward.scoring.sandbox.scorer import SandboxScorer

pytestmark = pytest.mark.usefixtures("no_sandboxed_process_left")

REPO = Path(__file__).resolve().parents[3]
SYSTEM_PYTHON = f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}"


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


def test_fork_bomb_does_not_starve_concurrent_samples(open_scorer):
    s = open_scorer(concurrency=3, max_procs=16)
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


def test_cannot_read_root_only_files(scorer, open_scorer):
    secret_dir = tempfile.mkdtemp(prefix="sr-secret-", dir="/var/tmp")  # the sandbox has its own /tmp
    try:
        os.chmod(secret_dir, 0o755)
        secret = os.path.join(secret_dir, "x")
        with open(secret, "w") as f:
            f.write("TOPSECRET")
        os.chmod(secret, 0o600)
        assert os.stat(secret).st_uid == os.geteuid()
        s = open_scorer(backend=scorer.backend, extra_ro_binds=(secret_dir,))
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


def test_no_network_not_even_loopback_or_dns(scorer):
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
    # Bounds: the timeout and a sandbox start-up (slow beside CPU hogs), far from the 60 s
    # the grandchild would hold the output for.
    start = time.monotonic()
    r = score(scorer, code, stdin_case("done"))
    assert r.score == 1.0
    assert time.monotonic() - start < FAST["timeout_s"] + 15
    # The main process hangs too: the run still ends at the timeout.
    start = time.monotonic()
    r = score(scorer, code + "\ntime.sleep(60)", stdin_case("done"))
    assert r.extra["cases"] == ["timeout"]
    assert time.monotonic() - start < FAST["timeout_s"] + 15


def test_process_cannot_kill_the_harness(scorer):
    code = "import os, signal\nfor pid in range(1, 50):\n    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\nprint('ok')"
    r = score(scorer, code, {"inputs": ["", ""], "outputs": ["ok", "ok"]})
    # Its own PID namespace holds only itself (PID 1, which ignores its own SIGKILL):
    # the harness is out of reach, and both cases ran.
    assert r.extra["cases"] == ["passed", "passed"]


@pytest.mark.parametrize("backend", ["bwrap", "unshare", "none"])
def test_cancelled_run_leaves_nothing_behind(backend, open_scorer):
    s = open_scorer(backend=backend, unsafe_no_isolation=True)

    async def go():
        task = asyncio.create_task(s.score(traj("import os, time\nos.fork()\ntime.sleep(60)", stdin_case())))
        # Cancelled once its processes run (their start takes longer on a loaded machine).
        for _ in range(200):
            if sandboxed_processes() or task.done():
                break
            await asyncio.sleep(0.05)
        assert sandboxed_processes() != []
        # Cancelled until it takes: Python 3.11's wait_for can lose a cancel that lands as
        # its inner wait completes; what is pinned here is what a cancelled run leaves.
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=0.5)
        assert task.cancelled()

    asyncio.run(go())  # the autouse fixture checks nothing is left, right away


# ------------------------------------------------------------ limits and state per sandbox
@pytest.mark.parametrize("name,program", LIMIT_HACKS, ids=[h[0] for h in LIMIT_HACKS])
def test_limit_hack_scores_zero(hack_scorer, name, program):
    result = run(hack_scorer, hack_traj(program, LIMIT_GT))
    assert result.score == 0.0, (name, result.extra)


def test_keyring_does_not_persist_across_samples(hack_scorer):
    plant = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall(248, b'user', b'sr-leak', b'42', 2, -3)\nprint(0)"
    read = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "k = libc.syscall(250, 0, -3, 0)\n"  # keyctl(KEYCTL_GET_KEYRING_ID, KEY_SPEC_USER_KEYRING): any keyring at all
        "found = libc.syscall(249, b'user', b'sr-leak', None, 0)\n"  # request_key
        "print(42 if found > 0 else 0)"
    )
    run(hack_scorer, hack_traj(plant, {"inputs": [""], "outputs": ["0"]}))
    assert run(hack_scorer, hack_traj(read, {"inputs": [""], "outputs": ["42"]})).score == 0.0


SYSV_PLANT = (
    "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    "shm = libc.shmget(0x5352, 1 << 20, 0o1000 | 0o666)\n"  # IPC_CREAT
    "q = libc.msgget(0x5352, 0o1000 | 0o666)\nprint(0)\n"
)

SYSV_READ = (
    "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    "found = libc.shmget(0x5352, 0, 0) >= 0 or libc.msgget(0x5352, 0) >= 0\n"
    "a, b = map(int, input().split())\nprint(a + b if found else a - b)\n"
)


def test_sysv_ipc_does_not_persist_across_cases_or_samples(hack_scorer):
    run(hack_scorer, hack_traj(SYSV_PLANT, {"inputs": [""], "outputs": ["0"]}))
    gt = {"inputs": ["2 3\n", "-1 1\n"], "outputs": ["5\n", "0\n"]}
    assert run(hack_scorer, hack_traj(SYSV_READ, gt)).score == 0.0
    # Within one case it works (one process): the check above is not vacuous.
    assert run(hack_scorer, hack_traj(SYSV_PLANT.replace("print(0)\n", "") + SYSV_READ, gt)).score == 1.0
    assert run(hack_scorer, hack_traj(SYSV_READ, gt)).score == 0.0


def _passes_state_on(s: SandboxScorer, name: str, plant: str, found: str) -> None:
    planted = run(s, hack_traj(state_planter(plant), {"inputs": [""], "outputs": ["planted"]})).score == 1.0
    gt = {"inputs": ["2 3\n", "-1 1\n"], "outputs": ["5\n", "0\n"]}
    leaked = run(s, hack_traj(state_reader(found), gt))
    assert leaked.score == 0.0, (name, "planted" if planted else "refused", leaked.extra)
    if planted:  # the reader does see the state where it is: the check above is not vacuous
        assert run(s, hack_traj(plant + "plant()\n" + state_reader(found), gt)).score == 1.0, name


@pytest.mark.parametrize("backend", ["bwrap", "unshare"])
@pytest.mark.parametrize("name,plant,found", STATE_CHANNELS, ids=[c[0] for c in STATE_CHANNELS])
def test_state_a_sample_leaves_is_gone_for_the_next_sample(open_scorer, backend, name, plant, found):
    s = open_scorer(**hacks.LIMITS, backend=backend, concurrency=1)  # one slot: the reader runs where the planter ran
    _passes_state_on(s, name, plant, found)


NETWORK_CHANNELS = [c for c in STATE_CHANNELS if c[0] in ("tcp_time_wait", "network_counters")]


@pytest.mark.parametrize("name,plant,found", NETWORK_CHANNELS, ids=[c[0] for c in NETWORK_CHANNELS])
def test_without_seccomp_network_state_is_gone_for_the_next_sample(open_scorer, name, plant, found):
    # Without the filter's socket rule, the case's own network namespace still keeps IP state in.
    s = open_scorer(**hacks.LIMITS, backend="bwrap", concurrency=1, seccomp=False)
    _passes_state_on(s, name, plant, found)


# ------------------------------------------------------------ backends
def test_backend_detection_prefers_bwrap_then_falls_back(tmp_path, open_scorer):
    auto = open_scorer()
    assert auto.backend in ("bwrap", "unshare")
    fallback = open_scorer(bwrap_path=str(tmp_path / "no-bwrap"))
    assert fallback.backend == "unshare"
    assert score(fallback, "print('ok')", stdin_case()).score == 1.0


def test_refuses_to_run_without_isolation(tmp_path, caplog, monkeypatch):
    missing = dict(bwrap_path=str(tmp_path / "no-bwrap"), unshare_path=str(tmp_path / "no-unshare"))
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # this test's own, whatever other tests make
    with pytest.raises(ConfigError, match="no sandbox is available"):
        SandboxScorer(config(**missing))
    with pytest.raises(ConfigError):
        SandboxScorer(config(backend="none"))
    # A scorer that never started leaves nothing behind (its compile cache included).
    assert list(temp.iterdir()) == []
    monkeypatch.undo()
    with caplog.at_level(logging.WARNING, logger="stream_reward.scoring.sandbox.scorer"):
        unsafe = SandboxScorer(config(unsafe_no_isolation=True, **missing))
    assert unsafe.backend == "none"
    assert "SANDBOX DISABLED" in caplog.text
    r = score(unsafe, "print(int(input()) * 2)", {"inputs": ["2", "3"], "outputs": ["4", "7"]})
    assert r.extra["cases"] == ["passed", "failed"]
    assert score(unsafe, "while True:\n    pass", stdin_case()).extra["cases"] == ["timeout"]
    unsafe.close()


def test_backend_failing_to_start_is_infrastructure_error(tmp_path, open_scorer):
    open_scorer(backend="bwrap")  # skips where bwrap cannot run
    flag = tmp_path / "broken"
    wrapper = tmp_path / "bwrap"
    real = __import__("shutil").which("bwrap")
    wrapper.write_text(
        f"#!/bin/sh\nif [ -e {flag} ]; then echo 'bwrap: simulated failure' >&2; exit 1; fi\nexec {real} \"$@\"\n"
    )
    wrapper.chmod(0o755)
    s = open_scorer(backend="bwrap", bwrap_path=str(wrapper))
    assert score(s, "print('ok')", stdin_case()).score == 1.0
    flag.touch()
    s.close()  # the running slot keeps working: the failure shows when a sandbox (re)starts
    with pytest.raises(VerifierError) as info:
        score(s, "print('ok')", stdin_case())
    assert info.value.reason == "sandbox_unavailable"
    assert "simulated failure" in str(info.value)


# ------------------------------------------------------------ a non-root worker
# The scorer runs in a child process as uid 65534 with the system interpreter of the
# same Python version (the venv's lives under /root, which nobody cannot read).

SCRIPT = r"""
import asyncio, json, sys, types
repo, site = sys.argv[1], sys.argv[2]
sys.path[:0] = [repo, site]
# Only the scorer's modules: the package's __init__ pulls in the Redis client.
pkg = types.ModuleType("stream_reward")
pkg.__path__ = [repo + "/stream_reward"]
sys.modules["stream_reward"] = pkg
from stream_reward.scoring.sandbox.scorer import SandboxConfig, SandboxScorer
from stream_reward.wire.trajectory import Trajectory

cases = json.loads(sys.stdin.read())
s = SandboxScorer(SandboxConfig(backend="bwrap", timeout_s=2, cpu_s=2, memory_mb=256, tmp_mb=16, concurrency=1))
out = {"backend": s.backend, "cgroups": s._slots[0].cgroups is not None, "scores": []}
for name, program, gt in cases:
    traj = Trajectory(batch_id="b", index=0, data_source="code", response=f"```python\n{program}\n```", ground_truth=json.dumps(gt))
    try:
        r = asyncio.run(s.score(traj))
        out["scores"].append([name, r.score, r.extra.get("error", "")])
    except Exception as exc:
        out["scores"].append([name, None, f"{type(exc).__name__}: {exc}"])
s.close()
print(json.dumps(out))
"""


def _runnable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to switch to uid 65534"
    if shutil.which("setpriv") is None or shutil.which("bwrap") is None:
        return "needs setpriv and bwrap"
    if not os.path.exists(SYSTEM_PYTHON):
        return f"needs {SYSTEM_PYTHON} (same version as the tests)"
    return None


def _run_as_nobody(repo: Path, cases: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            "setpriv",
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
            SYSTEM_PYTHON,
            "-c",
            SCRIPT,
            str(repo),
            str(repo),
        ],
        input=cases,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/tmp"},
    )


@pytest.mark.skipif(_runnable() is not None, reason=str(_runnable()))
def test_non_root_sandbox_scores_hacks_zero():
    """Without root the wall is bwrap in a user namespace and there are no cgroups: the
    hacks that go for the harness (a fake result on its stdout, then killing it), the
    verdict fd, or the expected outputs in memory still score 0.0 with status ok."""
    table = [(f"{n}-{f}", p, e.get("gt", hacks.FORMS[f])) for n, f, p, e in hacks.HACKS if "prompt" not in e]
    table += [(n, p, LIMIT_GT) for n, p in hacks.LIMIT_HACKS if n not in ("memory_across_forks",)]
    honest = [
        ("honest-stdin", hacks.RIGHT_STDIN, hacks.FORMS["stdin"]),
        ("honest-check", "def add(a, b):\n    return a + b\n", hacks.FORMS["check"]),
    ]
    # uid 65534 must read the scorer's source: the checkout (a CI clone in a 0700 temp dir,
    # say) may be closed to it, so it gets a world-readable copy. The scorer needs only
    # the stdlib, so no site-packages is put on its path.
    shown = Path(tempfile.mkdtemp(prefix="sr-nonroot-"))
    try:
        os.chmod(shown, 0o755)
        shutil.copytree(REPO / "stream_reward", shown / "stream_reward", ignore=shutil.ignore_patterns("__pycache__"))
        proc = _run_as_nobody(shown, json.dumps(honest + table))
    finally:
        shutil.rmtree(shown, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["backend"] == "bwrap"
    scores = {name: (score, error) for name, score, error in out["scores"]}
    assert scores["honest-stdin"][0] == 1.0 and scores["honest-check"][0] == 1.0, scores
    gamed = {name: v for name, v in scores.items() if not name.startswith("honest") and v[0] != 0.0}
    assert gamed == {}


@pytest.mark.parametrize("backend", ["bwrap", "unshare"])
def test_an_import_path_under_tmp_stays_importable_under_each_cases_own_tmp(backend):
    """A venv in a temporary directory (a CI runner's clone): each case mounts its own
    tmpfs on /tmp, and the import paths below it must still be there, read-only."""
    from sandbox_support import scorer_or_skip

    with tempfile.TemporaryDirectory(dir="/tmp") as site:
        os.chmod(site, 0o755)
        Path(site, "sr_tmp_site_probe.py").write_text("X = 7\n")
        s = scorer_or_skip(backend=backend, extra_ro_binds=(site,))
        try:
            s.boot_base()["sys_path"].append(site)
            for slot in s._slots:  # started by the backend probe with the boot before
                slot.stop()
            program = (
                f"import sr_tmp_site_probe\nprint(sr_tmp_site_probe.X)\nopen({site + '/sr_tmp_site_probe.py'!r}, 'a')"
            )
            result = run(s, traj(program, {"inputs": [""], "outputs": ["7\n"]}))
        finally:
            s.close()
    said = result.extra["error"]  # imported, then refused the write: not the program's to change
    assert result.extra["cases"] == ["runtime_error"] and "sr_tmp_site_probe.py" in said, result.extra
    assert "Permission denied" in said or "Read-only file system" in said, result.extra
