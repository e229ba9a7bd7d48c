"""Run model-written programs against tests in a local sandbox, judged where the
program cannot reach.

Processes, per sandbox slot (``concurrency`` slots, started on first use and
kept): a *harness* inside bubblewrap (or unshare), a pre-imported interpreter
that clones one fresh process per test case (``_sandbox_harness.py``), and a
trusted *checker* on the host that runs HumanEval ``check`` functions and
assert statements (``_sandbox_checker.py``). The scorer, in the worker, drives
both and judges the stdin and call forms itself. The candidate's process never
holds a test, a comparison or an expected output; what it returns crosses as
plain data (``sandbox_wire``) and is compared on the trusted side
(``sandbox_judge``). Its exit code and stray output mean nothing but "it
exited".

Limits: per case a wall-clock ``timeout_s``, RLIMIT_CPU / AS / FSIZE, a capped
stdout+stderr and a fresh /tmp and /dev/shm; per slot a memory cgroup (every
process, tmpfs and memfd pages) and a pids cgroup (``sandbox_cgroups``); a
seccomp filter (``sandbox_seccomp``); per sample a wall budget
``sample_timeout_s``, and by default the first timed-out case ends the sample
(the rest count as timeouts). ``docs/sandbox.md`` is the threat model.

Infrastructure faults (the backend cannot start, the host cannot fork, the
harness dies) raise ``VerifierError`` — never a 0. A response without a code
block is a wrong answer: 0.0.
"""

from __future__ import annotations

import ast
import asyncio
import atexit
import functools
import importlib.resources
import json
import logging
import marshal
import os
import re
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
from .sandbox_cgroups import PREFIX as CGROUP_PREFIX
from .sandbox_cgroups import SlotCgroups, open_slot
from .sandbox_isolation import (
    MARKER,
    OUT_OF_RESOURCES,
    UIDS,
    choose_backend,
    kill_tree,
    root_spec,
    sandbox_env,
    wrap_command,
)
from .sandbox_judge import normalize_output, same, wrapped_outputs
from .sandbox_seccomp import filter_bytes
from .sandbox_wire import WireError, loads

__all__ = ["SandboxConfig", "SandboxScorer", "CASE_STATUSES", "extract_code", "parse_tests", "case_script", "no_code"]

logger = logging.getLogger(__name__)

CASE_STATUSES = ("passed", "failed", "runtime_error", "timeout", "memory", "output_limit")


@dataclass(frozen=True, slots=True)
class SandboxConfig:
    """Limits are per test case unless named otherwise; ``concurrency`` is the
    number of sandbox slots (each a persistent sandbox running one sample at a
    time). ``memory_mb`` and ``max_procs`` bound a slot's cgroups (all processes
    of a case together) when ``cgroups`` allows, and each process's RLIMIT_AS.
    ``sample_timeout_s`` bounds a sample's cases together; ``stop_on_timeout``
    ends a sample at its first timed-out case. ``cgroups``: "auto" (use them
    when this host lets us), "required" (refuse to start without), "off".

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
    # The real interpreter, not a venv's symlink to it: a venv may live under /tmp,
    # which inside the sandbox is a fresh tmpfs. The harness needs no site-packages.
    python: str = os.path.realpath(sys.executable)
    site_packages: bool = True  # put the host's site-packages on sys.path (no .pth processing)
    extra_ro_binds: tuple[str, ...] = ()
    uid_base: int = 60000
    uid_count: int = 1000
    sample_timeout_s: float = 60.0
    stop_on_timeout: bool = True
    cgroups: str = "auto"  # auto | required | off
    seccomp: bool = True

    def __post_init__(self) -> None:
        for key in (
            "timeout_s",
            "cpu_s",
            "memory_mb",
            "max_output_bytes",
            "max_file_mb",
            "max_procs",
            "tmp_mb",
            "concurrency",
            "uid_count",
            "sample_timeout_s",
        ):
            if not getattr(self, key) > 0:
                raise ConfigError(key, "must be > 0")
        if self.backend not in ("auto", "bwrap", "unshare", "none"):
            raise ConfigError("backend", f"{self.backend!r} is not auto, bwrap, unshare or none")
        if self.cgroups not in ("auto", "required", "off"):
            raise ConfigError("cgroups", f"{self.cgroups!r} is not auto, required or off")
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
            return "stdin", [
                {"stdin": _text(i, "input"), "stdout": _text(o, "output")} for i, o in zip(inputs, outputs, strict=True)
            ]
        if not isinstance(fn_name, str) or not fn_name.isidentifier():
            raise _bad("'fn_name' must be an identifier")
        if not all(isinstance(args, list) for args in inputs):
            raise _bad("call-based 'inputs' must be lists of arguments")
        try:
            json.dumps([inputs, outputs])
        except (TypeError, ValueError) as exc:
            raise _bad(f"call-based cases are not JSON values ({exc})") from exc
        wrapped = wrapped_outputs(outputs)
        return "call", [
            {"fn_name": fn_name, "args": a, "expected": o, "wrapped": wrapped}
            for a, o in zip(inputs, outputs, strict=True)
        ]
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


def read_sample(traj: Trajectory) -> tuple[str, list[dict[str, Any]], str | None]:
    """``(form, cases, program)`` of a code sample; the tests are checked first.
    ``program`` is None when the response has no code block (see ``no_code``)."""
    form, cases = parse_tests(traj.ground_truth)
    return form, cases, extract_code(traj.response)


def no_code(cases: list[dict[str, Any]], *, all_or_nothing: bool) -> Scored:
    """A response without code is the policy's wrong answer, not our failure: 0.0."""
    return tally([("failed", "no code block in the response")] * len(cases), all_or_nothing=all_or_nothing)


def tally(results: list[tuple[str, str]], *, all_or_nothing: bool) -> Scored:
    """The sample's score from its cases' ``(status, detail)``: the fraction passed
    (1.0 or 0.0 with ``all_or_nothing``), with ``cases``, ``passed``, ``total`` and
    ``error`` (the first failing case's message, "" when all passed) as extra."""
    statuses = [status for status, _ in results]
    passed = statuses.count("passed")
    total = len(statuses)
    if all_or_nothing:
        score = 1.0 if passed == total else 0.0
    else:
        score = passed / total
    error = next((f"case {i}: {s}: {d}".rstrip(": ") for i, (s, d) in enumerate(results) if s != "passed"), "")
    return Scored(score, {"cases": statuses, "passed": passed, "total": total, "error": error})


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
            f"if not _sr_same(_sr_result, _sr_case['e'], {bool(case.get('wrapped'))!r}):\n"
            f"    print('wrong answer', file=_sr_sys.stderr); _sr_sys.exit({WRONG_ANSWER_EXIT})\n"
        )
    elif form == "assert":
        check = _assert_wrapper(case["assert"], "pass")
    elif form == "check":
        check = _assert_wrapper(case["test"], f"check({case['entry_point']})")
    else:
        raise ValueError(f"unknown form {form!r}")
    return f"{program}\n\n{_compare_src()}\n{check}", ""


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


# ---------------------------------------------------------------- sources sent to the sandbox

_HERE = importlib.resources.files(__package__)
_WIRE = _HERE.joinpath("sandbox_wire.py").read_text(encoding="utf-8")
_HARNESS = _WIRE + "\n" + _HERE.joinpath("_sandbox_harness.py").read_text(encoding="utf-8")
_CHECKER = _WIRE + "\n" + _HERE.joinpath("_sandbox_checker.py").read_text(encoding="utf-8")
_JUDGE = _HERE.joinpath("sandbox_judge.py").read_text(encoding="utf-8")

# The source travels as the first frame on stdin, precompiled when the sandbox
# runs this very interpreter.
_BOOT = (
    "import marshal, os\ndef _r(n):\n    b = b''\n    while len(b) < n:\n        c = os.read(0, n - len(b))\n"
    "        if not c:\n            raise SystemExit(1)\n        b += c\n    return b\n"
    "h = marshal.loads(_r(int.from_bytes(_r(4), 'little')))\n"
    "exec(compile(h, 'harness', 'exec') if type(h) is str else h)"
)

_FUNCTION_SRC = """
def _sr_function(g, name):
    fn = g.get(name)
    if fn is None and isinstance(g.get("Solution"), type):
        fn = getattr(g["Solution"](), name, None)
    if fn is None:
        raise NameError(f"the program defines no function {name!r}")
    return fn
"""


@functools.cache
def _compare_src() -> str:
    """The judge's ``_sr_*`` functions, for the stand-alone programs of case_script()."""
    functions = [
        node for node in ast.parse(_JUDGE).body if isinstance(node, ast.FunctionDef) and node.name.startswith("_sr_")
    ]
    return "\n" + "\n\n".join(ast.get_source_segment(_JUDGE, node) or "" for node in functions) + _FUNCTION_SRC


def _frame(data: bytes) -> bytes:
    return len(data).to_bytes(4, "little") + data


class _Channel:
    """Length-prefixed frames to and from a child process over two pipes.

    Reads wait on the running loop (``add_reader`` per wait, so one channel serves
    several event loops in turn); writes are blocking: the peer is always reading
    when we write to it.
    """

    def __init__(self, write_fd: int, read_fd: int) -> None:
        self.write_fd, self.read_fd = write_fd, read_fd
        os.set_blocking(read_fd, False)
        self._buf = bytearray()

    def send(self, data: bytes) -> None:
        view = memoryview(_frame(data))
        os.set_blocking(self.write_fd, True)
        while view:
            view = view[os.write(self.write_fd, view) :]

    def _pop(self) -> bytes | None:
        if len(self._buf) >= 4:
            n = int.from_bytes(self._buf[:4], "little")
            if len(self._buf) >= 4 + n:
                body = bytes(self._buf[4 : 4 + n])
                del self._buf[: 4 + n]
                return body
        return None

    def _fill(self) -> bool:
        try:
            chunk = os.read(self.read_fd, 1 << 20)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        self._buf += chunk
        return True

    async def recv(self) -> bytes:
        while True:
            body = self._pop()
            if body is not None:
                return body
            if not self._fill():
                raise EOFError("the process closed its pipe")
            if self._pop_ready():
                continue
            loop = asyncio.get_running_loop()
            ready = loop.create_future()
            loop.add_reader(self.read_fd, _wake, ready)
            try:
                await ready
            finally:
                loop.remove_reader(self.read_fd)

    def _pop_ready(self) -> bool:
        return len(self._buf) >= 4 and len(self._buf) >= 4 + int.from_bytes(self._buf[:4], "little")

    def recv_sync(self, timeout_s: float) -> bytes:
        import select

        end = time.monotonic() + timeout_s
        while True:
            body = self._pop()
            if body is not None:
                return body
            left = end - time.monotonic()
            if left <= 0 or not select.select([self.read_fd], [], [], left)[0]:
                raise TimeoutError("no reply")
            if not self._fill():
                raise EOFError("the process closed its pipe")


def _wake(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)


class _Broken(Exception):
    """The slot's harness or checker misbehaved; the slot is torn down."""


class _Slot:
    """One persistent sandbox (harness) and its trusted checker."""

    def __init__(self, scorer: SandboxScorer, index: int) -> None:
        self.scorer, self.index = scorer, index
        self.harness: subprocess.Popen[bytes] | None = None
        self.checker: subprocess.Popen[bytes] | None = None
        self.h: _Channel | None = None
        self.c: _Channel | None = None
        self.uid: int | None = None
        self.cgroups: SlotCgroups | None = None
        self.checker_pid: int | None = None  # the checker's child for the current sample
        self.errors: Any = None

    # -- lifecycle

    def start_harness(self) -> None:
        s, cfg = self.scorer, self.scorer.config
        if s.backend != "none" and s._root:
            self.uid = UIDS.acquire(cfg.uid_base, cfg.uid_count)
        if cfg.cgroups != "off" and s._root:
            self.cgroups = open_slot(
                f"{CGROUP_PREFIX}{os.getpid()}-{id(s):x}-{self.index}", cfg.memory_mb, cfg.max_procs
            )
            if self.cgroups is None and cfg.cgroups == "required":
                self.stop()
                raise ConfigError("cgroups", "cgroups were required but this host does not let us create them")
        fds = self.cgroups.fds() if self.cgroups else []
        self.errors = tempfile.TemporaryFile()  # the backend's own complaints, for the error message
        argv = wrap_command(cfg, s.backend, [cfg.python, "-I", "-S", "-c", _BOOT, MARKER], root=s._root)
        try:
            self.harness = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.errors,
                env=sandbox_env(),
                pass_fds=fds,
                start_new_session=True,  # the backend leads its own group: one killpg ends it
            )
        except OSError as exc:
            self.stop()
            reason = "host_resources" if exc.errno in OUT_OF_RESOURCES else "sandbox_unavailable"
            raise VerifierError(f"cannot start the {s.backend} sandbox: {exc}", reason=reason) from exc
        assert self.harness.stdin is not None and self.harness.stdout is not None
        self.h = _Channel(self.harness.stdin.fileno(), self.harness.stdout.fileno())
        boot = {
            **s._boot_base(),
            "uid": self.uid,
            "cgroup_fds": list(self.cgroups.procs_fds) if self.cgroups else [],
            "oom_fd": self.cgroups.oom_fd if self.cgroups else None,
            "per_case_ns": s.backend != "none",
            "drop_caps": s.backend == "bwrap" and not s._root,
        }
        try:
            self.h.send(s._harness_code)
            self.h.send(marshal.dumps(boot, 4))
        except OSError as exc:
            try:
                self.harness.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            why = self.stderr_tail() or exc
            self.stop()
            raise VerifierError(f"{s.backend} sandbox did not start: {why}", reason="sandbox_unavailable") from exc

    def stderr_tail(self) -> str:
        try:
            self.errors.seek(0)
            return self.errors.read()[-500:].decode("utf-8", "replace").strip()
        except (OSError, AttributeError, ValueError):
            return ""

    def ready(self, reply: bytes) -> None:
        msg = _json_obj(reply)
        if msg.get("ev") != "ready":
            raise _Broken(f"harness did not start: {reply[:200]!r}")

    def start_checker(self) -> None:
        self.checker = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _BOOT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=sandbox_env(),
            cwd="/",
            start_new_session=True,  # a terminal's Ctrl-C is for the worker; the checker dies with it anyway
        )
        assert self.checker.stdin is not None and self.checker.stdout is not None
        self.c = _Channel(self.checker.stdin.fileno(), self.checker.stdout.fileno())
        self.c.send(self.scorer._checker_code)

    def stop(self) -> None:
        for proc in (self.harness, self.checker):
            if proc is None:
                continue
            kill_tree(proc, self.uid if proc is self.harness else None)
            for pipe in (proc.stdin, proc.stdout):
                try:
                    if pipe is not None:
                        pipe.close()
                except OSError:
                    pass
        if self.checker_pid is not None:
            _kill_pid(self.checker_pid)
        self.harness = self.checker = None
        self.h = self.c = None
        self.checker_pid = None
        if self.uid is not None:
            UIDS.release(self.uid)
            self.uid = None
        if self.cgroups is not None:
            self.cgroups.close()
            self.cgroups = None
        if self.errors is not None:
            self.errors.close()
            self.errors = None


def _json_obj(raw: bytes) -> dict[str, Any]:
    try:
        msg = json.loads(raw)
    except ValueError as exc:
        raise _Broken(f"unreadable message from the harness: {exc}") from None
    if not isinstance(msg, dict):
        raise _Broken("unreadable message from the harness")
    return msg


def _kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


# ---------------------------------------------------------------- the scorer


class SandboxScorer:
    """Scores a response by running its last code block against the sample's tests
    (see ``tally`` for the score and its extra). ``close()`` / ``aclose()`` stop
    the slots; they also die with this process."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self._root = os.geteuid() == 0
        self._owner_pid = os.getpid()
        self._sem: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        self._boot: dict[str, Any] | None = None
        self._slots = [_Slot(self, i) for i in range(self.config.concurrency)]
        self._free = list(reversed(self._slots))
        same_python = os.path.realpath(self.config.python) == os.path.realpath(sys.executable)
        self._harness_code = marshal.dumps(
            compile(_HARNESS, "<sandbox-harness>", "exec") if same_python else _HARNESS, 4
        )
        self._checker_code = marshal.dumps(compile(_CHECKER, "<sandbox-checker>", "exec"), 4)
        self._seccomp = filter_bytes() if self.config.seccomp else None
        if self.config.seccomp and self._seccomp is None:
            logger.warning("no seccomp filter for this architecture: candidate syscalls are not filtered")
        self.backend = self.config.backend  # named in errors while the probe runs
        self.backend = choose_backend(self.config, root=self._root, probe=self._probe_run)
        if self.backend == "none":
            logger.warning(
                "SANDBOX DISABLED: unsafe_no_isolation=True, model-written code runs with this process's "
                "privileges, network and filesystem. Never do this with untrusted code."
            )
        atexit.register(self.close)

    def _boot_base(self) -> dict[str, Any]:
        if self._boot is None:
            cfg = self.config
            site: list[str] = []
            if cfg.site_packages and os.path.realpath(cfg.python) == os.path.realpath(sys.executable):
                site = sorted({p for p in (sysconfig.get_path("purelib"), sysconfig.get_path("platlib")) if p})
            self._boot = {
                "sys_path": site,
                "isolation": self.backend,
                "seccomp": self._seccomp if self.backend != "none" else None,
                **root_spec(cfg),
            }
        return self._boot

    def _limits(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "cpu_s": cfg.cpu_s,
            "memory_mb": cfg.memory_mb,
            "max_output_bytes": cfg.max_output_bytes,
            "max_file_mb": cfg.max_file_mb,
            "max_procs": cfg.max_procs,
        }

    def _probe_run(self, backend: str) -> str | None:
        """Starts a slot in ``backend`` and runs a real program in it, the way ``run`` would."""
        self.backend = backend
        self._boot = None
        slot = _Slot(self, -1)
        try:
            slot.start_harness()
            assert slot.h is not None
            slot.ready(slot.h.recv_sync(60))
            slot.h.send(marshal.dumps(self._case_msg("stdin", "print('ok')", b"", 10.0), 4))
            done = _json_obj(slot.h.recv_sync(60))
            if done.get("ev") != "done" or done.get("status") or done.get("exit") != 0 or done["stdout"] != "ok\n":
                return f"probe program did not pass: {str(done)[:300]}"
        except (OSError, EOFError, TimeoutError, _Broken, VerifierError) as exc:
            return f"probe failed: {slot.stderr_tail() or exc}"
        finally:
            slot.stop()
            self._boot = None
        return None

    def _case_msg(self, mode: str, program: str, stdin: bytes, timeout_s: float, **extra: Any) -> dict[str, Any]:
        return {
            "op": "case",
            "mode": mode,
            "program": program,
            "stdin": stdin,
            "timeout_s": timeout_s,
            "limits": self._limits(),
            **extra,
        }

    def close(self) -> None:
        if os.getpid() != self._owner_pid:
            return  # a forked copy of this scorer: the sandboxes are the parent's
        for slot in self._slots:
            slot.stop()

    async def aclose(self) -> None:
        self.close()

    # -- running

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._sem is None or self._sem[0] is not loop:
            self._sem = (loop, asyncio.BoundedSemaphore(self.config.concurrency))
        return self._sem[1]

    async def score(self, traj: Trajectory) -> Scored:
        form, cases, program = read_sample(traj)
        if program is None:
            return no_code(cases, all_or_nothing=self.config.all_or_nothing)
        results = await self.run(program, form, cases, prompt=traj.prompt)
        return tally(results, all_or_nothing=self.config.all_or_nothing)

    async def run(
        self, program: str, form: str, cases: list[dict[str, Any]], prompt: str | None = None
    ) -> list[tuple[str, str]]:
        """Run ``program`` against ``cases`` (as from parse_tests) in one sandbox slot;
        return ``(status, detail)`` per case."""
        async with self._semaphore():
            slot = self._free.pop()
            ok = False
            try:
                if slot.harness is None or slot.harness.poll() is not None:
                    slot.stop()
                    slot.start_harness()
                    assert slot.h is not None
                    try:
                        slot.ready(await asyncio.wait_for(slot.h.recv(), 60))
                    except (EOFError, _Broken, asyncio.TimeoutError) as exc:
                        raise VerifierError(
                            f"{self.backend} sandbox did not start: {slot.stderr_tail() or exc}",
                            reason="sandbox_unavailable",
                        ) from None
                results = await self._run_cases(slot, program, form, cases, prompt)
                ok = True
                return results
            except (_Broken, EOFError, OSError, asyncio.TimeoutError) as exc:
                if isinstance(exc, OSError) and exc.errno in OUT_OF_RESOURCES:
                    raise VerifierError(f"host out of resources: {exc}", reason="host_resources") from exc
                raise VerifierError(f"{self.backend} sandbox failed: {exc}", reason="sandbox_unavailable") from exc
            finally:
                if not ok:
                    slot.stop()  # unknown state (error, cancellation): start afresh next time
                self._free.append(slot)

    async def _run_cases(
        self, slot: _Slot, program: str, form: str, cases: list[dict[str, Any]], prompt: str | None
    ) -> list[tuple[str, str]]:
        cfg = self.config
        end = time.monotonic() + cfg.sample_timeout_s
        results: list[tuple[str, str]] = []
        sample_open = False
        for case in cases:
            left = end - time.monotonic()
            if left <= 0.05 or (cfg.stop_on_timeout and results and results[-1][0] == "timeout"):
                results.append(("timeout", "not run: the sample's time is up"))
                continue
            timeout_s = min(cfg.timeout_s, left)
            if form == "stdin":
                results.append(await self._stdin_case(slot, program, case, timeout_s))
            elif form == "call":
                results.append(await self._call_case(slot, program, case, timeout_s))
            else:
                if not sample_open:
                    await self._open_checker_sample(slot, prompt)
                    sample_open = True
                result = await self._checked_case(slot, program, form, case, timeout_s)
                if result is None:  # the checker was killed at the deadline: a fresh one next case
                    sample_open = False
                    result = ("timeout", "the tests ran past the time limit")
                results.append(result)
        if sample_open and slot.c is not None:
            slot.c.send(marshal.dumps(("finish",)))
            slot.checker_pid = None
        return results

    async def _done(self, slot: _Slot, timeout_s: float) -> dict[str, Any]:
        """The harness's next message, within the case's time plus a margin."""
        assert slot.h is not None
        msg = _json_obj(await asyncio.wait_for(slot.h.recv(), timeout_s + 10))
        if msg.get("ev") == "infra":
            reason = "host_resources" if msg.get("errno") in OUT_OF_RESOURCES else "sandbox_unavailable"
            raise VerifierError(f"sandbox harness failed: {msg.get('error')}", reason=reason)
        if msg.get("ev") not in ("done", "msg"):
            raise _Broken(f"unexpected message from the harness: {str(msg)[:200]}")
        return msg

    async def _stdin_case(self, slot: _Slot, program: str, case: dict[str, Any], timeout_s: float) -> tuple[str, str]:
        assert slot.h is not None
        slot.h.send(marshal.dumps(self._case_msg("stdin", program, case["stdin"].encode(), timeout_s), 4))
        done = await self._done(slot, timeout_s)
        verdict = _exit_verdict(done)
        if verdict is not None:
            return verdict
        ok = normalize_output(str(done.get("stdout", "")).encode("utf-8", "surrogateescape")) == normalize_output(
            case["stdout"].encode()
        )
        return ("passed", "") if ok else ("failed", "wrong answer")

    async def _call_case(self, slot: _Slot, program: str, case: dict[str, Any], timeout_s: float) -> tuple[str, str]:
        assert slot.h is not None
        msg = self._case_msg("calls", program, b"", timeout_s, calls=[(case["fn_name"], case["args"])])
        slot.h.send(marshal.dumps(msg, 4))
        done = await self._done(slot, timeout_s)
        replies = done.get("replies") or []
        if done.get("status") or len(replies) < 2:
            return _exit_verdict(done, exited_early=True) or ("failed", "the program exited before the tests ran")
        try:
            reply = loads(str(replies[1]).encode("utf-8", "surrogateescape"))
        except WireError as exc:
            return ("failed", f"unreadable answer: {exc}")
        if type(reply) is tuple and len(reply) == 2 and reply[0] == "ok":
            if same(reply[1], case["expected"], case.get("wrapped", False)):
                return ("passed", "")
            return ("failed", f"expected {case['expected']!r:.120}, got {reply[1]!r:.120}")
        if type(reply) is tuple and len(reply) == 3 and reply[0] == "raise":
            return ("runtime_error", f"{reply[1]}: {reply[2]}"[:300])
        if type(reply) is tuple and len(reply) == 2 and reply[0] == "bad":
            return ("failed", str(reply[1])[:300])
        return ("failed", "malformed answer")

    async def _open_checker_sample(self, slot: _Slot, prompt: str | None) -> None:
        if slot.checker is None or slot.checker.poll() is not None:
            slot.start_checker()
            assert slot.c is not None
            if marshal.loads(await asyncio.wait_for(slot.c.recv(), 60)) != ("ready",):
                raise _Broken("checker did not start")
        assert slot.c is not None
        checker_mb = 2 * self.config.memory_mb + 1024  # an interpreter's own address space, plus room
        slot.c.send(marshal.dumps(("sample", prompt or "", self._boot_base()["sys_path"], checker_mb)))
        started = marshal.loads(await asyncio.wait_for(slot.c.recv(), 30))
        if not (isinstance(started, tuple) and started[0] == "started"):
            raise _Broken(f"checker could not start a sample: {started!r}")
        slot.checker_pid = int(started[1])

    async def _checked_case(
        self, slot: _Slot, program: str, form: str, case: dict[str, Any], timeout_s: float
    ) -> tuple[str, str] | None:
        assert slot.h is not None and slot.c is not None
        deadline = time.monotonic() + timeout_s
        slot.h.send(marshal.dumps(self._case_msg("serve", program, b"", timeout_s), 4))
        first = await self._done(slot, timeout_s)
        if first["ev"] == "done":
            return _exit_verdict(first, exited_early=True) or ("failed", "the program exited before the tests ran")
        try:
            ready = loads(str(first["data"]).encode("utf-8", "surrogateescape"))
        except WireError:
            ready = None
        names = ready[1] if type(ready) is tuple and len(ready) == 2 and type(ready[1]) is dict else {}
        test = case["test"] if form == "check" else case["assert"]
        slot.c.send(marshal.dumps(("case", form, test, case.get("entry_point"), names)))
        done: dict[str, Any] | None = None
        while True:
            left = deadline - time.monotonic()
            try:
                msg = marshal.loads(await asyncio.wait_for(slot.c.recv(), max(left, 0) + 2))
            except asyncio.TimeoutError:
                # The tests themselves ran past the deadline: end the case and this checker sample.
                if slot.checker_pid is not None:
                    _kill_pid(slot.checker_pid)
                    slot.checker_pid = None
                    crashed = marshal.loads(await asyncio.wait_for(slot.c.recv(), 10))
                    if crashed[0] != "crashed":
                        raise _Broken("checker did not stop") from None
                if done is None:
                    slot.h.send(marshal.dumps({"op": "end"}))
                    await self._until_done(slot, timeout_s)
                return None
            if msg[0] == "call":
                if done is not None:
                    slot.c.send(marshal.dumps(("gone",)))
                    continue
                slot.h.send(marshal.dumps({"op": "call", "data": msg[1]}, 4))
                event = await self._done(slot, timeout_s)
                if event["ev"] == "done":
                    done = event
                    slot.c.send(marshal.dumps(("gone",)))
                else:
                    slot.c.send(marshal.dumps(("reply", str(event["data"]).encode("utf-8", "surrogateescape"))))
            elif msg[0] == "verdict":
                status, detail = str(msg[1]), str(msg[2])
                if done is None:
                    slot.h.send(marshal.dumps({"op": "end"}))
                    done = await self._until_done(slot, timeout_s)
                limit = done.get("status")
                if limit:  # a limit the candidate hit wins over whatever the tests concluded
                    return (str(limit), "")
                if status == "gone":
                    return _exit_verdict(done, exited_early=True) or ("failed", "the program exited during the tests")
                return (status, detail)
            elif msg[0] == "crashed":
                slot.checker_pid = None
                raise VerifierError(f"the trusted checker died (wait status {msg[1]})", reason="checker_crashed")
            else:
                raise _Broken(f"unexpected message from the checker: {msg!r:.200}")

    async def _until_done(self, slot: _Slot, timeout_s: float) -> dict[str, Any]:
        while True:
            event = await self._done(slot, timeout_s)
            if event["ev"] == "done":
                return event


def _exit_verdict(done: dict[str, Any], exited_early: bool = False) -> tuple[str, str] | None:
    """The case's status from how its process ended, or None if it ran to a normal end."""
    status = done.get("status")
    err = str(done.get("err", ""))
    detail = (err.strip().splitlines() or [""])[-1][:300]
    if status:
        return (str(status), "cpu time limit" if status == "timeout" and "signal" in done else "")
    if "signal" in done:
        return ("runtime_error", f"killed by signal {done['signal']}")
    code = done.get("exit")
    if "MemoryError" in err:
        return ("memory", detail)
    if code != 0:
        return ("runtime_error", detail or f"exit code {code}")
    if exited_early:
        return ("failed", "the program exited before the tests ran")
    return None
