"""Run model-written programs against tests in a local sandbox.

One sample = one sandbox = one harness process. The harness (trusted code, passed
with ``python -c``) reads the program and every test case on stdin, forks a fresh
child per case, applies the per-case limits in the child, drops it to an
unprivileged uid, runs the case, then kills and reaps everything left in the
sandbox before the next case. Forking from an interpreter that is already up
costs well under a millisecond, so a sample with ten cases pays one interpreter
start and one namespace setup, not ten.

Isolation backends, detected once per process at construction:

``bwrap``
    ``bwrap --unshare-pid --unshare-net --unshare-ipc --unshare-uts
    --unshare-cgroup-try --die-with-parent --new-session`` with a minimal root
    (read-only binds of /usr, a few /etc files, the Python prefixes; a fresh
    /proc; /dev with null, zero, full, random, urandom only; size-capped tmpfs
    on /tmp and /dev/shm, the only writable places; the root itself remounted
    read-only) and, when we are root, ``--cap-drop ALL`` plus only
    CAP_SETUID/CAP_SETGID/CAP_KILL for the harness. As root we deliberately do
    *not* create a user namespace: bwrap would map sandbox uid 65534 to host
    uid 0, and the sandboxed program could read root-only files. Without root,
    bwrap runs unprivileged with ``--unshare-user --uid 65534``; the harness
    then shares the program's uid, so a hostile program can kill it and turn
    its sample into an infrastructure failure instead of a 0 — run as root.
``unshare``
    util-linux ``unshare --pid --fork --kill-child --mount --net --ipc --uts``;
    the harness (root inside) builds the same minimal read-only root itself with
    mount(2) and chroot(2). Needs root.

Each case child runs under an exclusive uid leased from ``uid_base ..
uid_base + uid_count`` (flock'd lock files, so concurrent sandboxes, scorers and
worker processes never share one): RLIMIT_NPROC counts processes per uid, so a
fork bomb in one sandbox cannot starve the others. Limits: RLIMIT_CPU,
RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NPROC, no core files, a wall-clock timeout and a
cap on stdout+stderr. After each case the harness ``kill(-1, SIGKILL)``s the
sandbox's PID namespace (which reaches setsid'd grandchildren) and waits until
nothing but itself is left. The host kills the sandbox's process group on
timeout or cancellation; bwrap/unshare then take the namespace down with them.

Every sandboxed process carries ``MARKER`` in its command line and the scorer's
pid in ``$STREAM_REWARD_SANDBOX_OWNER``, so leaks are easy to look for.

Infrastructure faults (the backend cannot start, the host cannot fork) raise
``VerifierError`` — never a 0 score. The call/assert/check forms are judged
inside the sandboxed process, so a program that deliberately tampers with the
interpreter can fake them; the stdin form is judged by the harness.
"""

from __future__ import annotations

import ast
import asyncio
import errno
import fcntl
import json
import logging
import marshal
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, ScoringError, VerifierError
from ..scoring import Scored
from ..trajectory import Trajectory

__all__ = ["SandboxConfig", "SandboxScorer", "CASE_STATUSES", "MARKER", "OWNER_ENV", "extract_code", "parse_tests", "case_script"]

logger = logging.getLogger(__name__)

CASE_STATUSES = ("passed", "failed", "runtime_error", "timeout", "memory", "output_limit")
MARKER = "stream-reward-sandbox"  # in every sandboxed process's cmdline; tests look for it
OWNER_ENV = "STREAM_REWARD_SANDBOX_OWNER"  # the scorer's pid, in every sandboxed process's environment


def _env() -> dict[str, str]:
    # Nothing of the host's environment (API keys!) reaches the sandbox.
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp", "PYTHONHASHSEED": "0", OWNER_ENV: str(os.getpid())}
_OUT_OF_RESOURCES = {errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE}
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
_DEV_LINKS = (("/dev/fd", "/proc/self/fd"), ("/dev/stdin", "/proc/self/fd/0"), ("/dev/stdout", "/proc/self/fd/1"), ("/dev/stderr", "/proc/self/fd/2"))
# All the sandbox sees of /etc (each bind costs ~0.1 ms a sample; add more with
# SandboxConfig.extra_ro_binds).
_ETC = ("/etc/ld.so.cache", "/etc/localtime", "/etc/passwd", "/etc/group")


@dataclass(frozen=True, slots=True)
class SandboxConfig:
    """Limits are per test case; ``concurrency`` bounds sandboxes per scorer.

    ``tmp_mb`` sizes each of the sandbox's private /tmp and /dev/shm.
    ``extra_ro_binds`` are host paths shown read-only at the same place (not
    under /tmp, which is the sandbox's own). ``backend="none"`` or a host with no
    usable backend is refused unless ``unsafe_no_isolation``. Case processes run
    as uids leased from ``uid_base .. uid_base + uid_count - 1`` (when root).
    """

    timeout_s: float = 5.0
    cpu_s: float = 5.0
    memory_mb: int = 1024
    max_output_bytes: int = 4 * 1024 * 1024
    max_file_mb: int = 16
    max_procs: int = 32
    tmp_mb: int = 64
    concurrency: int = os.cpu_count() or 1
    all_or_nothing: bool = False
    unsafe_no_isolation: bool = False
    backend: str = "auto"  # auto | bwrap | unshare | none
    bwrap_path: str = "bwrap"
    unshare_path: str = "unshare"
    python: str = sys.executable
    site_packages: bool = True  # put the host's site-packages on sys.path (no .pth processing)
    extra_ro_binds: tuple[str, ...] = ()
    uid_base: int = 60000
    uid_count: int = 1000

    def __post_init__(self) -> None:
        for key in ("timeout_s", "cpu_s", "memory_mb", "max_output_bytes", "max_file_mb", "max_procs", "tmp_mb", "concurrency", "uid_count"):
            if not getattr(self, key) > 0:
                raise ConfigError(key, "must be > 0")
        if self.backend not in ("auto", "bwrap", "unshare", "none"):
            raise ConfigError("backend", f"{self.backend!r} is not auto, bwrap, unshare or none")
        if self.uid_base < 1000:
            raise ConfigError("uid_base", "must be >= 1000 (an unprivileged uid range)")


# ---------------------------------------------------------------- tests and code


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

    form is ``check`` (``test`` + ``entry_point``), ``stdin`` (``inputs`` /
    ``outputs``), ``call`` (the same with ``fn_name``) or ``assert``
    (``assert_case``). Anything else raises ScoringError(reason="bad_tests").
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
    if "test" in gt or "entry_point" in gt:
        test, entry = gt.get("test"), gt.get("entry_point")
        if not isinstance(test, str) or not isinstance(entry, str) or not entry.isidentifier():
            raise _bad("'test' must be code and 'entry_point' an identifier")
        return "check", [{"test": test, "entry_point": entry}]
    if "assert_case" in gt:
        asserts = gt["assert_case"]
        if not isinstance(asserts, list) or not asserts or not all(isinstance(a, str) and a.strip() for a in asserts):
            raise _bad("'assert_case' must be a non-empty list of statements")
        return "assert", [{"assert": a} for a in asserts]
    if "inputs" in gt or "outputs" in gt:
        inputs, outputs = gt.get("inputs"), gt.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list) or not inputs or len(inputs) != len(outputs):
            raise _bad("'inputs' and 'outputs' must be non-empty lists of the same length")
        fn_name = gt.get("fn_name")
        if fn_name is None:
            return "stdin", [{"stdin": _text(i, "input"), "stdout": _text(o, "output")} for i, o in zip(inputs, outputs)]
        if not isinstance(fn_name, str) or not fn_name.isidentifier():
            raise _bad("'fn_name' must be an identifier")
        if not all(isinstance(args, list) for args in inputs):
            raise _bad("call-based 'inputs' must be lists of arguments")
        try:
            json.dumps([inputs, outputs])
        except (TypeError, ValueError) as exc:
            raise _bad(f"call-based cases are not JSON values ({exc})") from exc
        return "call", [{"fn_name": fn_name, "args": a, "expected": o} for a, o in zip(inputs, outputs)]
    raise _bad(f"unknown test format (keys: {sorted(map(str, gt))[:8]})")


_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)```", re.S)


def extract_code(response: str) -> str | None:
    """The last fenced ```python block, else the last fenced block of any kind."""
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(response or "")]
    blocks = [(lang, body) for lang, body in blocks if body.strip()]
    for lang, body in reversed(blocks):
        if lang in ("python", "py", "python3"):
            return body
    return blocks[-1][1] if blocks else None


# Shared by the harness and by the stand-alone scripts of case_script(). Only exact
# plain types compare equal: an object whose __eq__ always returns True (a known
# reward hack) never matches.
_COMPARE_SRC = r'''
def _sr_plain(x):
    if type(x) is tuple or type(x) is list:
        return [_sr_plain(v) for v in x]
    if type(x) is dict:
        return {k: _sr_plain(v) for k, v in x.items()}
    return x

def _sr_eq(a, b):
    ta, tb = type(a), type(b)
    if ta is list and tb is list:
        return len(a) == len(b) and all(_sr_eq(x, y) for x, y in zip(a, b))
    if ta is dict and tb is dict:
        return len(a) == len(b) and all(k in a and _sr_eq(a[k], b[k]) for k in b)
    if ta not in (bool, int, float, str, type(None)) or tb not in (bool, int, float, str, type(None)):
        return False
    if ta in (int, float) and tb in (int, float) and float in (ta, tb):
        return a == b or abs(a - b) <= 1e-9 + 1e-6 * abs(b)
    return ta is tb and a == b

def _sr_same(result, expected):
    result = _sr_plain(result)
    if _sr_eq(result, expected):
        return True
    return type(expected) is list and len(expected) > 0 and _sr_eq(result, expected[0])

def _sr_function(g, name):
    fn = g.get(name)
    if fn is None and isinstance(g.get("Solution"), type):
        fn = getattr(g["Solution"](), name, None)
    if fn is None:
        raise NameError(f"the program defines no function {name!r}")
    return fn
'''

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
            f"if not _sr_same(_sr_result, _sr_case['e']):\n"
            f"    print('wrong answer', file=_sr_sys.stderr); _sr_sys.exit({WRONG_ANSWER_EXIT})\n"
        )
    elif form == "assert":
        check = _assert_wrapper(case["assert"], "pass")
    elif form == "check":
        check = _assert_wrapper(case["test"], f"check({case['entry_point']})")
    else:
        raise ValueError(f"unknown form {form!r}")
    return f"{program}\n\n{_COMPARE_SRC}\n{check}", ""


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


# ---------------------------------------------------------------- the harness

_HARNESS = _COMPARE_SRC + r'''
# Startup cost is per sample: stdlib modules only, and no json/re/traceback (the
# job arrives as marshal, results leave as a repr() the host literal_evals).
import _signal as signal  # the signal module would import enum: 4 ms per sample
import builtins, gc, marshal, math, os, resource, select, sys, time

EXIT_MEMORY, EXIT_SETUP = 86, 87
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PRELOAD = ("collections", "itertools", "functools", "heapq", "bisect")  # cheap, and common in solutions
_libc = None

def _sys(name, *args):
    import ctypes
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if getattr(_libc, name)(*args) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{name}{args[:2]}: {os.strerror(e)}")

def _b(s):
    return None if s is None else s.encode()

def _mount(src, dst, fstype, flags, data=None):
    import ctypes
    _sys("mount", _b(src), _b(dst), _b(fstype), ctypes.c_ulong(flags), _b(data))

def enter_new_root(job):
    # unshare backend: build a minimal read-only root like bwrap's, then chroot.
    if os.stat("/proc/self/ns/mnt").st_ino == job["host_mntns"]:
        raise SystemExit("refusing to mount: not in a private mount namespace")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    os.umask(0o022)
    sources = []
    for path in job["binds"]:
        if os.path.islink(path):
            sources.append((path, os.readlink(path), None))
        elif os.path.exists(path):
            sources.append((path, None, os.open(path, os.O_PATH)))
    devs = [(d, os.open(d, os.O_PATH)) for d in job["devices"]]
    new = "/tmp"  # any directory: the mount is private to this namespace
    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path, link, fd in sources:
        dst = new + path
        if link is not None:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.symlink(link, dst)
            continue
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(dst, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            open(dst, "w").close()
        _mount(f"/proc/self/fd/{fd}", dst, None, MS_BIND | MS_REC)
        _mount(None, dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
        os.close(fd)
    os.makedirs(new + "/dev", exist_ok=True)
    for dev, fd in devs:
        open(new + dev, "w").close()
        _mount(f"/proc/self/fd/{fd}", new + dev, None, MS_BIND)
        _mount(None, new + dev, None, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NOEXEC)
        os.close(fd)
    for name, target in job["dev_links"]:
        os.symlink(target, new + name)
    for d in ("/proc", "/tmp", "/dev/shm"):
        os.makedirs(new + d, exist_ok=True)
    _mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for d in ("/tmp", "/dev/shm"):
        _mount("tmpfs", new + d, "tmpfs", MS_NOSUID | MS_NODEV, f"size={job['tmp_mb']}m,mode=1777")
    _mount(None, new, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    os.chroot(new)
    os.chdir("/")

def emit(obj):
    sys.stdout.write(repr(obj))
    sys.stdout.flush()

def main():
    job = marshal.load(sys.stdin.buffer)  # follows the harness itself on stdin
    if job["isolation"] == "unshare":
        enter_new_root(job)
    os.chdir(job["workdir"])
    sys.path[:0] = job["sys_path"]
    if len(job["cases"]) > 1:
        for name in PRELOAD:
            __import__(name)
    gc.freeze()  # forked children then share these pages instead of copying them
    results = []
    for case in job["cases"]:
        try:
            results.append(run_case(job, case))
        except OSError as exc:  # pipe/fork/reap failed: the host is out of resources
            emit({"infra": f"{type(exc).__name__}: {exc}", "errno": exc.errno or 0})
            return
    emit({"results": results})

def run_case(job, case):
    stdin_fd = os.memfd_create("stdin")
    data = case.get("stdin", "").encode()
    view = memoryview(data)
    while view:
        view = view[os.write(stdin_fd, view):]
    os.lseek(stdin_fd, 0, 0)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    ver_r, ver_w = os.pipe()
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        child(job, case, stdin_fd, out_w, err_w, ver_w)
    for fd in (stdin_fd, out_w, err_w, ver_w):
        os.close(fd)
    try:
        return supervise(job, case, pid, out_r, err_r, ver_r)
    finally:
        for fd in (out_r, err_r, ver_r):
            os.close(fd)

def supervise(job, case, pid, out_r, err_r, ver_r):
    lim = job["limits"]
    cap = lim["max_output_bytes"]
    bufs = {out_r: bytearray(), err_r: bytearray(), ver_r: bytearray()}
    total = 0
    pidfd = os.pidfd_open(pid)
    poller = select.poll()
    for fd in (out_r, err_r, ver_r, pidfd):
        poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + lim["timeout_s"]
    status, exited = None, False
    try:
        while status is None and not exited:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                status = "timeout"
                break
            for fd, _ in poller.poll(max(1, int(remaining * 1000) + 1)):
                if fd == pidfd:
                    exited = True
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    poller.unregister(fd)
                    continue
                total += len(chunk)
                if total > cap:
                    status = "output_limit"
                    break
                bufs[fd] += chunk
    finally:
        os.close(pidfd)
    if not exited:
        os.kill(pid, signal.SIGKILL)
    _, wstatus, usage = os.wait4(pid, 0)
    kill_all(job, pid)
    for fd in bufs:  # every writer is dead now: what is left in the pipes is finite
        os.set_blocking(fd, False)
        while status is None:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            total += len(chunk)
            if total > cap:
                status = "output_limit"
            bufs[fd] += chunk
    err = bytes(bufs[err_r][-4096:]).decode("utf-8", "replace")
    if status is not None:
        return status, ""
    detail = (err.strip().splitlines() or [""])[-1][:300]
    if os.WIFSIGNALED(wstatus):
        sig = os.WTERMSIG(wstatus)
        cpu = usage.ru_utime + usage.ru_stime
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= math.ceil(lim["cpu_s"]) - 0.05):
            return "timeout", "cpu time limit"
        return "runtime_error", f"killed by signal {sig}"
    code = os.WEXITSTATUS(wstatus)
    if code == EXIT_SETUP:
        raise OSError(0, "the case process could not set its limits or drop privileges")
    if code == EXIT_MEMORY or "MemoryError" in err:
        return "memory", detail
    if code != 0:
        return "runtime_error", detail
    if job["form"] == "stdin":
        ok = normalize(bytes(bufs[out_r])) == normalize(case["stdout"].encode())
        return ("passed", "") if ok else ("failed", "wrong answer")
    verdict = bytes(bufs[ver_r])
    if verdict[:1] == b"P":
        return "passed", ""
    if verdict[:1] == b"F":
        return "failed", verdict[1:].decode("utf-8", "replace")[:300]
    return "failed", "the program exited before the tests ran"

def normalize(raw):
    lines = [line.rstrip() for line in raw.decode("utf-8", "replace").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines

def kill_all(job, pid):
    if not job["pidns"]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        return
    # kill(-1) reaches every process of this PID namespace we may signal (all case
    # processes, setsid'd or not) but never init or ourselves.
    me, deadline = str(os.getpid()), time.monotonic() + 5
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        if not [p for p in os.listdir("/proc") if p.isdigit() and p != "1" and p != me]:
            return
        if time.monotonic() > deadline:
            raise OSError(0, "sandboxed processes survived SIGKILL")
        time.sleep(0.0005)

def child(job, case, stdin_fd, out_w, err_w, ver_w):
    try:
        os.setsid()
        os.dup2(stdin_fd, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.dup2(ver_w, 3, inheritable=False)
        os.closerange(4, 1 << 16)
        lim = job["limits"]
        cpu = math.ceil(lim["cpu_s"])
        setlimit(resource.RLIMIT_CPU, cpu, cpu + 1)
        setlimit(resource.RLIMIT_AS, lim["memory_mb"] << 20)
        setlimit(resource.RLIMIT_FSIZE, lim["max_file_mb"] << 20)
        setlimit(resource.RLIMIT_CORE, 0)
        if job["pidns"]:
            setlimit(resource.RLIMIT_NPROC, lim["max_procs"])
        uid = job["uid"]
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            if os.geteuid() != uid or os.getuid() != uid:
                raise OSError("uid drop failed")
        if job["isolation"] == "unshare":
            _sys("prctl", 38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS (bwrap sets it itself)
        sys.stdin = open(0, "r", encoding="utf-8", errors="replace", closefd=False)
        sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        sys.argv = ["solution.py"]
    except BaseException:
        os._exit(EXIT_SETUP)
    code = 1
    try:
        code = execute(job, case)
        sys.stdout.flush()
        sys.stderr.flush()
    except MemoryError:
        code = EXIT_MEMORY
    except BaseException:
        pass
    os._exit(code)

def setlimit(kind, soft, hard=None):
    hard = soft if hard is None else hard
    _, cur_hard = resource.getrlimit(kind)
    if cur_hard != resource.RLIM_INFINITY:
        soft, hard = min(soft, cur_hard), min(hard, cur_hard)
    resource.setrlimit(kind, (soft, hard))

def exit_code(exc):
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1

def execute(job, case):
    form = job["form"]
    g = {"__name__": "__main__" if form == "stdin" else "solution", "__builtins__": builtins}
    try:
        try:
            exec(compile(job["program"], "solution.py", "exec"), g)
        except SystemExit as exc:
            code = exit_code(exc)
            if form == "stdin" or code:
                return code
        if form == "stdin":
            return 0
        try:
            if form == "call":
                result = _sr_function(g, case["fn_name"])(*case["args"])
                ok = _sr_same(result, case["expected"])
                message = "" if ok else f"expected {case['expected']!r:.120}, got {result!r:.120}"
            elif form == "assert":
                exec(compile(case["assert"], "test.py", "exec"), g)
                ok, message = True, ""
            else:
                exec(compile(case["test"], "test.py", "exec"), g)
                g["check"](g[case["entry_point"]])
                ok, message = True, ""
        except AssertionError as exc:
            ok, message = False, f"assertion failed {exc}".strip()
        os.write(3, (b"P" if ok else b"F") + message.encode("utf-8", "replace")[:300])
        return 0
    except SystemExit as exc:
        return exit_code(exc)
    except MemoryError:
        return EXIT_MEMORY
    except BaseException:
        import traceback
        traceback.print_exc()
        return 1

main()
os._exit(0)  # skip interpreter teardown: nothing is left to clean up
'''

# The harness travels on stdin ahead of the job, precompiled when the sandbox runs
# this very interpreter (compiling it would cost ~2.5 ms per sample).
_BOOT = "import marshal, sys\nh = marshal.load(sys.stdin.buffer)\nexec(compile(h, 'harness', 'exec') if type(h) is str else h)"


# ---------------------------------------------------------------- uids


class _UidPool:
    """Exclusive uids for sandbox runs, shared by every scorer and process on the host.

    A uid is ours while we hold an flock on its lock file; within this process the
    ``busy`` set is authoritative (flock is per open file, so re-locking our own fd
    would succeed).
    """

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}
        self._busy: set[int] = set()
        self._dir: str | None = None
        self._pid = os.getpid()

    def _lock_dir(self) -> str:
        if self._dir is None:
            path = os.path.join("/run" if os.access("/run", os.W_OK) else tempfile.gettempdir(), f"stream-reward-sandbox-uids-{os.geteuid()}")
            os.makedirs(path, mode=0o700, exist_ok=True)
            st = os.lstat(path)
            if st.st_uid != os.geteuid() or not os.path.isdir(path) or os.path.islink(path):
                raise VerifierError(f"uid lock directory {path} is not ours", reason="sandbox_unavailable")
            self._dir = path
        return self._dir

    def acquire(self, base: int, count: int) -> int:
        if self._pid != os.getpid():
            # A forked child shares our lock files' open descriptions, so flock would
            # not keep it from the parent's uids: it opens its own.
            for fd in self._fds.values():
                os.close(fd)
            self._fds, self._busy, self._pid = {}, set(), os.getpid()
        for uid in range(base, base + count):
            if uid in self._busy:
                continue
            fd = self._fds.get(uid)
            if fd is None:
                fd = os.open(os.path.join(self._lock_dir(), str(uid)), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                self._fds[uid] = fd
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            self._busy.add(uid)
            return uid
        raise VerifierError(f"all {count} sandbox uids from {base} are in use", reason="sandbox_unavailable")

    def release(self, uid: int) -> None:
        fcntl.flock(self._fds[uid], fcntl.LOCK_UN)
        self._busy.discard(uid)


_UIDS = _UidPool()
_PROBED: dict[tuple[Any, ...], str | None] = {}  # backend probe results, once per process


def _ancestors(path: str) -> list[str]:
    out = []
    while path not in ("", "/"):
        out.append(path)
        path = os.path.dirname(path)
    return out


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = []
        try:
            for task in os.listdir(f"/proc/{parent}/task"):
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    kids += [int(k) for k in f.read().split()]
        except (OSError, ValueError):
            pass
        found += kids
        todo += kids
    return found


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def _sigkill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def _uid_alive(uid: int) -> bool:
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    return True
            except OSError:
                pass
    return False


# ---------------------------------------------------------------- the scorer


class SandboxScorer:
    """Scores a response by running its last code block against the sample's tests.

    Score is the fraction of cases passed (1.0 or 0.0 with ``all_or_nothing``);
    ``extra`` holds ``cases`` (a status per case), ``passed``, ``total`` and
    ``error`` (the first failing case's message, "" when all passed).
    """

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self._root = os.geteuid() == 0
        self._sem: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        self._argvs: dict[str, list[str]] = {}
        self._job_base: dict[str, Any] | None = None
        same_python = os.path.realpath(self.config.python) == os.path.realpath(sys.executable)
        self._harness = marshal.dumps(compile(_HARNESS, "<sandbox-harness>", "exec") if same_python else _HARNESS, 4)
        self.backend = self._choose_backend()
        if self.backend == "none":
            logger.warning(
                "SANDBOX DISABLED: unsafe_no_isolation=True, model-written code runs with this process's "
                "privileges, network and filesystem. Never do this with untrusted code."
            )

    # -- backend selection

    def _choose_backend(self) -> str:
        cfg = self.config
        wanted = ["bwrap", "unshare"] if cfg.backend == "auto" else [cfg.backend]
        problems = []
        for backend in wanted:
            if backend == "none":
                break
            problem = self._probe(backend)
            if problem is None:
                return backend
            problems.append(f"{backend}: {problem}")
        if cfg.unsafe_no_isolation:
            return "none"
        raise ConfigError(
            "backend",
            "no sandbox is available to run untrusted code ("
            + ("; ".join(problems) or "backend 'none' requested")
            + "). Install bubblewrap or run as root for the unshare backend; "
            "unsafe_no_isolation=True runs code unsandboxed.",
        )

    def _probe(self, backend: str) -> str | None:
        cfg = self.config
        tool = cfg.bwrap_path if backend == "bwrap" else cfg.unshare_path
        if shutil.which(tool) is None:
            return f"{tool!r} not found"
        if backend == "unshare" and not self._root:
            return "needs root"
        key = (backend, tool, cfg.python, self._root)
        if key not in _PROBED:
            _PROBED[key] = self._probe_run(backend)
        return _PROBED[key]

    def _probe_run(self, backend: str) -> str | None:
        cases = [{"stdin": "", "stdout": "ok"}]
        uid = _UIDS.acquire(self.config.uid_base, self.config.uid_count) if self._root else None
        try:
            job = self._job("print('ok')", "stdin", cases, uid, backend, "/tmp")
            proc = subprocess.run(self._argv(backend), input=self._harness + marshal.dumps(job, 4), capture_output=True, env=_env(), timeout=60, start_new_session=True)
            if self._parse(proc.stdout, proc.stderr, proc.returncode, 1)[0][0] != "passed":
                return "probe program did not pass"
        except (OSError, subprocess.TimeoutExpired, ScoringError) as exc:
            return f"probe failed: {exc}"
        finally:
            if uid is not None:
                _UIDS.release(uid)
        return None

    # -- command lines

    def _binds(self) -> list[str]:
        paths = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", *_ETC]
        python_dirs = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(os.path.realpath(self.config.python)))}
        if os.path.dirname(self.config.python) not in ("/usr/bin", "/bin"):
            python_dirs.add(os.path.dirname(os.path.abspath(self.config.python)))
        for extra in sorted(p for p in python_dirs if p and p != "/"):
            if not any(extra == p or extra.startswith(p.rstrip("/") + "/") for p in paths):
                paths.append(extra)
        return paths + list(self.config.extra_ro_binds)

    def _argv(self, backend: str) -> list[str]:
        if backend not in self._argvs:
            self._argvs[backend] = self._build_argv(backend)
        return self._argvs[backend]

    def _build_argv(self, backend: str) -> list[str]:
        cfg = self.config
        python = [cfg.python, "-I", "-S", "-c", _BOOT, MARKER]
        if backend == "none":
            return python
        if backend == "unshare":
            return [cfg.unshare_path, "--pid", "--fork", "--kill-child", "--mount", "--propagation", "private", "--net", "--ipc", "--uts", "--", *python]
        argv = [cfg.bwrap_path, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent", "--new-session"]
        if self._root:
            argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_KILL"]
        else:
            argv += ["--unshare-user", "--uid", "65534", "--gid", "65534"]
        binds = self._binds()
        # bwrap creates missing parents of a bind target 0700 (as root), which would
        # hide e.g. /root/.pyenv/... from the sandbox uid: create them 0755 first.
        parents = {os.path.dirname(p.rstrip("/")) for p in binds}
        ancestors = {a for p in parents for a in _ancestors(p)}
        for path in sorted(ancestors, key=lambda a: a.count("/")):
            argv += ["--perms", "0755", "--dir", path]
        for path in binds:
            if os.path.islink(path):
                argv += ["--symlink", os.readlink(path), path]
            else:
                argv += ["--ro-bind-try", path, path]
        # A hand-made /dev: bwrap's --dev (devpts, mqueue, ...) costs ~1-2 ms more per sample.
        argv += ["--proc", "/proc", "--perms", "0755", "--dir", "/dev"]
        for dev in _DEVICES:
            argv += ["--dev-bind", dev, dev]
        for name, target in _DEV_LINKS:
            argv += ["--symlink", target, name]
        for tmp in ("/tmp", "/dev/shm"):
            argv += ["--size", str(cfg.tmp_mb << 20), "--perms", "1777", "--tmpfs", tmp]
        argv += ["--remount-ro", "/", "--chdir", "/tmp", "--hostname", "sandbox", "--", *python]
        return argv

    def _job(self, program: str, form: str, cases: list[dict[str, Any]], uid: int | None, backend: str, workdir: str) -> dict[str, Any]:
        if self._job_base is None:
            self._job_base = self._build_job_base()
        job = {"program": program, "form": form, "cases": cases, "uid": uid, "isolation": backend, "pidns": backend != "none", "workdir": workdir}
        return {**self._job_base, **job}

    def _build_job_base(self) -> dict[str, Any]:
        cfg = self.config
        site: list[str] = []
        if cfg.site_packages and os.path.realpath(cfg.python) == os.path.realpath(sys.executable):
            site = sorted({p for p in (sysconfig.get_path("purelib"), sysconfig.get_path("platlib")) if p})
        return {
            "sys_path": site,
            "binds": self._binds(),
            "devices": _DEVICES,
            "dev_links": _DEV_LINKS,
            "tmp_mb": cfg.tmp_mb,
            "host_mntns": os.stat("/proc/self/ns/mnt").st_ino,
            "limits": {
                "timeout_s": cfg.timeout_s,
                "cpu_s": cfg.cpu_s,
                "memory_mb": cfg.memory_mb,
                "max_output_bytes": cfg.max_output_bytes,
                "max_file_mb": cfg.max_file_mb,
                "max_procs": cfg.max_procs,
            },
        }

    # -- running

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._sem is None or self._sem[0] is not loop:
            self._sem = (loop, asyncio.BoundedSemaphore(self.config.concurrency))
        return self._sem[1]

    async def score(self, traj: Trajectory) -> Scored:
        form, cases = parse_tests(traj.ground_truth)
        program = extract_code(traj.response)
        if program is None:
            raise ScoringError("no fenced code block in the response", reason="no_code")
        results = await self.run(program, form, cases)
        statuses = [status for status, _ in results]
        passed = statuses.count("passed")
        total = len(statuses)
        if self.config.all_or_nothing:
            score = 1.0 if passed == total else 0.0
        else:
            score = passed / total
        error = next((f"case {i}: {s}: {d}".rstrip(": ") for i, (s, d) in enumerate(results) if s != "passed"), "")
        return Scored(score, {"cases": statuses, "passed": passed, "total": total, "error": error})

    async def run(self, program: str, form: str, cases: list[dict[str, Any]]) -> list[tuple[str, str]]:
        """Run ``program`` against ``cases`` (as from parse_tests) in one sandbox;
        return ``(status, detail)`` per case."""
        async with self._semaphore():
            uid = _UIDS.acquire(self.config.uid_base, self.config.uid_count) if self._root and self.backend != "none" else None
            workdir = tempfile.mkdtemp(prefix="stream-reward-unsafe-") if self.backend == "none" else "/tmp"
            try:
                return await self._run(self._job(program, form, cases, uid, self.backend, workdir), len(cases), uid)
            finally:
                if uid is not None:
                    _UIDS.release(uid)
                if self.backend == "none":
                    shutil.rmtree(workdir, ignore_errors=True)

    async def _run(self, job: dict[str, Any], n: int, uid: int | None) -> list[tuple[str, str]]:
        payload = self._harness + marshal.dumps(job, 4)
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._argv(self.backend),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=_env(),
                start_new_session=True,  # the backend leads its own group: one killpg ends it
            )
        except OSError as exc:
            if exc.errno in _OUT_OF_RESOURCES:
                raise VerifierError(f"host out of resources starting a sandbox: {exc}", reason="host_resources") from exc
            raise VerifierError(f"cannot start the {self.backend} sandbox: {exc}", reason="sandbox_unavailable") from exc
        deadline_s = 15.0 + n * (self.config.timeout_s + 1.0)
        try:
            out, err = await asyncio.wait_for(proc.communicate(payload), deadline_s)
        except asyncio.TimeoutError:
            raise VerifierError(f"sandbox did not finish within {deadline_s:.0f}s", reason="sandbox_timeout") from None
        finally:
            if proc.returncode is None:
                await self._kill(proc, uid)
        return self._parse(out, err, proc.returncode, n)

    @staticmethod
    async def _kill(proc: asyncio.subprocess.Process, uid: int | None) -> None:
        # The backend leads its process group; its child is the namespace's init,
        # whose death takes every sandboxed process with it. Without a namespace
        # (unsafe mode) the case processes have their own sessions: kill them by pid.
        victims = _descendants(proc.pid)
        for pid in victims:
            _sigkill(pid)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await proc.wait()
        # The namespace is torn down asynchronously; wait until it is gone, so that
        # its uid is empty before another run counts processes against it.
        end = time.monotonic() + 5
        while time.monotonic() < end and (not all(map(_dead, victims)) or (uid is not None and _uid_alive(uid))):
            await asyncio.sleep(0.005)

    def _parse(self, out: bytes, err: bytes, returncode: int | None, n: int) -> list[tuple[str, str]]:
        try:
            msg = ast.literal_eval(out.decode("utf-8", "replace")) if out else None
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            msg = None
        if isinstance(msg, dict) and "infra" in msg:
            reason = "host_resources" if msg.get("errno") in _OUT_OF_RESOURCES else "sandbox_unavailable"
            raise VerifierError(f"sandbox harness failed: {msg['infra']}", reason=reason)
        results = msg.get("results") if isinstance(msg, dict) else None
        if not isinstance(results, list) or len(results) != n:
            tail = err.decode("utf-8", "replace").strip()[-500:]
            raise VerifierError(f"{self.backend} sandbox failed (exit {returncode}): {tail or 'no output'}", reason="sandbox_unavailable")
        return [(str(status), str(detail)) for status, detail in results]
