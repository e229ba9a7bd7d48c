"""Run model-written programs against tests in a local sandbox.

One sample = one sandbox = one harness process. The harness
(``_sandbox_harness.py``, trusted code sent on stdin) reads the program and
every test case, forks a fresh child per case, applies the per-case limits in
the child, drops it to an unprivileged uid, runs the case, then kills and reaps
everything left in the sandbox before the next case. Forking from an
interpreter that is already up costs well under a millisecond, so a sample with
ten cases pays one interpreter start and one namespace setup, not ten. How the
sandbox is kept apart from the host (bwrap or unshare, uids, teardown) is
``sandbox_isolation``.

Limits, per case: RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NPROC, no core
files, a wall-clock timeout and a cap on stdout+stderr. After each case the
harness ``kill(-1, SIGKILL)``s the sandbox's PID namespace (which reaches
setsid'd grandchildren) and waits until nothing but itself is left.

Infrastructure faults (the backend cannot start, the host cannot fork) raise
``VerifierError`` — never a 0 score. The call/assert/check forms are judged
inside the sandboxed process, so a program that deliberately tampers with the
interpreter can fake them; the stdin form is judged by the harness.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import importlib.resources
import json
import logging
import marshal
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from typing import Any

from stream_reward.config import SandboxConfig
from stream_reward.errors import ScoringError, VerifierError
from stream_reward.scorers.sandbox_isolation import (
    MARKER,
    OUT_OF_RESOURCES,
    UIDS,
    choose_backend,
    kill_sandbox,
    root_spec,
    sandbox_env,
    wrap_command,
)
from stream_reward.scoring.scorer import Scored
from stream_reward.wire.trajectory import Trajectory

__all__ = ["SandboxScorer", "CASE_STATUSES", "extract_code", "parse_tests", "case_script"]

logger = logging.getLogger(__name__)

CASE_STATUSES = ("passed", "failed", "runtime_error", "timeout", "memory", "output_limit")


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
                {"stdin": _text(i, "input"), "stdout": _text(o, "output")} for i, o in zip(inputs, outputs)
            ]
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


def read_sample(traj: Trajectory) -> tuple[str, list[dict[str, Any]], str]:
    """``(form, cases, program)`` of a code sample; the tests are checked first."""
    form, cases = parse_tests(traj.ground_truth)
    program = extract_code(traj.response)
    if program is None:
        raise ScoringError("no fenced code block in the response", reason="no_code")
    return form, cases, program


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
            f"if not _sr_same(_sr_result, _sr_case['e']):\n"
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


# ---------------------------------------------------------------- the harness

_HARNESS = importlib.resources.files(__package__).joinpath("_sandbox_harness.py").read_text(encoding="utf-8")

# The harness travels on stdin ahead of the job, precompiled when the sandbox runs
# this very interpreter (compiling it would cost ~2.5 ms per sample).
_BOOT = "import marshal, sys\nh = marshal.load(sys.stdin.buffer)\nexec(compile(h, 'harness', 'exec') if type(h) is str else h)"


@functools.cache
def _compare_src() -> str:
    """The harness's ``_sr_*`` functions, for the stand-alone programs of case_script()."""
    functions = [
        node for node in ast.parse(_HARNESS).body if isinstance(node, ast.FunctionDef) and node.name.startswith("_sr_")
    ]
    return "\n" + "\n\n".join(ast.get_source_segment(_HARNESS, node) for node in functions) + "\n"


# ---------------------------------------------------------------- the scorer


class SandboxScorer:
    """Scores a response by running its last code block against the sample's tests
    (see ``tally`` for the score and its extra)."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self._root = os.geteuid() == 0
        self._sem: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        self._argvs: dict[str, list[str]] = {}
        self._job_base: dict[str, Any] | None = None
        same_python = os.path.realpath(self.config.python) == os.path.realpath(sys.executable)
        self._harness = marshal.dumps(compile(_HARNESS, "<sandbox-harness>", "exec") if same_python else _HARNESS, 4)
        self.backend = self.config.backend  # named in errors while the probe runs
        self.backend = choose_backend(self.config, root=self._root, probe=self._probe_run)
        if self.backend == "none":
            logger.warning(
                "SANDBOX DISABLED: unsafe_no_isolation=True, model-written code runs with this process's "
                "privileges, network and filesystem. Never do this with untrusted code."
            )

    def _probe_run(self, backend: str) -> str | None:
        """Runs a real program in ``backend``, the way ``run`` would."""
        cases = [{"stdin": "", "stdout": "ok"}]
        uid = UIDS.acquire(self.config.uid_base, self.config.uid_count) if self._root else None
        try:
            job = self._job("print('ok')", "stdin", cases, uid, backend, "/tmp")
            proc = subprocess.run(
                self._argv(backend),
                input=self._harness + marshal.dumps(job, 4),
                capture_output=True,
                env=sandbox_env(),
                timeout=60,
                start_new_session=True,
            )
            if self._parse(proc.stdout, proc.stderr, proc.returncode, 1)[0][0] != "passed":
                return "probe program did not pass"
        except (OSError, subprocess.TimeoutExpired, ScoringError) as exc:
            return f"probe failed: {exc}"
        finally:
            if uid is not None:
                UIDS.release(uid)
        return None

    def _argv(self, backend: str) -> list[str]:
        if backend not in self._argvs:
            harness = [self.config.python, "-I", "-S", "-c", _BOOT, MARKER]
            self._argvs[backend] = wrap_command(self.config, backend, harness, root=self._root)
        return self._argvs[backend]

    def _job(
        self, program: str, form: str, cases: list[dict[str, Any]], uid: int | None, backend: str, workdir: str
    ) -> dict[str, Any]:
        if self._job_base is None:
            self._job_base = self._build_job_base()
        job = {
            "program": program,
            "form": form,
            "cases": cases,
            "uid": uid,
            "isolation": backend,
            "pidns": backend != "none",
            "workdir": workdir,
        }
        return {**self._job_base, **job}

    def _build_job_base(self) -> dict[str, Any]:
        cfg = self.config
        site: list[str] = []
        if cfg.site_packages and os.path.realpath(cfg.python) == os.path.realpath(sys.executable):
            site = sorted({p for p in (sysconfig.get_path("purelib"), sysconfig.get_path("platlib")) if p})
        return {
            "sys_path": site,
            **root_spec(cfg),
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
        form, cases, program = read_sample(traj)
        return tally(await self.run(program, form, cases), all_or_nothing=self.config.all_or_nothing)

    async def run(self, program: str, form: str, cases: list[dict[str, Any]]) -> list[tuple[str, str]]:
        """Run ``program`` against ``cases`` (as from parse_tests) in one sandbox;
        return ``(status, detail)`` per case."""
        async with self._semaphore():
            uid = (
                UIDS.acquire(self.config.uid_base, self.config.uid_count)
                if self._root and self.backend != "none"
                else None
            )
            workdir = tempfile.mkdtemp(prefix="stream-reward-unsafe-") if self.backend == "none" else "/tmp"
            try:
                return await self._run(self._job(program, form, cases, uid, self.backend, workdir), len(cases), uid)
            finally:
                if uid is not None:
                    UIDS.release(uid)
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
                env=sandbox_env(),
                start_new_session=True,  # the backend leads its own group: one killpg ends it
            )
        except OSError as exc:
            if exc.errno in OUT_OF_RESOURCES:
                raise VerifierError(
                    f"host out of resources starting a sandbox: {exc}", reason="host_resources"
                ) from exc
            raise VerifierError(
                f"cannot start the {self.backend} sandbox: {exc}", reason="sandbox_unavailable"
            ) from exc
        deadline_s = 15.0 + n * (self.config.timeout_s + 1.0)
        try:
            out, err = await asyncio.wait_for(proc.communicate(payload), deadline_s)
        except asyncio.TimeoutError:
            raise VerifierError(f"sandbox did not finish within {deadline_s:.0f}s", reason="sandbox_timeout") from None
        finally:
            if proc.returncode is None:
                await kill_sandbox(proc, uid)
        return self._parse(out, err, proc.returncode, n)

    def _parse(self, out: bytes, err: bytes, returncode: int | None, n: int) -> list[tuple[str, str]]:
        try:
            msg = ast.literal_eval(out.decode("utf-8", "replace")) if out else None
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            msg = None
        if isinstance(msg, dict) and "infra" in msg:
            reason = "host_resources" if msg.get("errno") in OUT_OF_RESOURCES else "sandbox_unavailable"
            raise VerifierError(f"sandbox harness failed: {msg['infra']}", reason=reason)
        results = msg.get("results") if isinstance(msg, dict) else None
        if not isinstance(results, list) or len(results) != n:
            tail = err.decode("utf-8", "replace").strip()[-500:]
            raise VerifierError(
                f"{self.backend} sandbox failed (exit {returncode}): {tail or 'no output'}",
                reason="sandbox_unavailable",
            )
        return [(str(status), str(detail)) for status, detail in results]
