"""Run model-written programs against tests in a local sandbox, judged where the
program cannot reach.

Processes, per sandbox slot (``concurrency`` slots, started on first use and
kept): a *harness* inside bubblewrap (or unshare), a pre-imported interpreter
that clones one fresh process per test case (``_harness.py``), and a
trusted *checker* on the host that runs HumanEval ``check`` functions and
assert statements (``_checker.py``). The scorer, in the worker, drives
both and judges the stdin and call forms itself. The candidate's process never
holds a test, a comparison or an expected output; what it returns crosses as
plain data (``wire``) and is compared on the trusted side
(``judge``). Its exit code and stray output mean nothing but "it
exited".

Limits: per case a wall-clock ``timeout_s``, RLIMIT_CPU / AS / FSIZE, stdout and
stderr capped each, a fresh /tmp and /dev/shm; per slot a memory cgroup (every
process, tmpfs and memfd pages) and a pids cgroup (``sandbox_cgroups``); a
seccomp filter (``sandbox_seccomp``); per sample a wall budget
``sample_timeout_s``, and by default the first timed-out case ends the sample
(the rest count as timeouts). ``docs/sandbox.md`` is the threat model.

Infrastructure faults (the backend cannot start, the host cannot fork, the
harness dies) raise ``VerifierError`` — never a 0. A response without a code
block is a wrong answer: 0.0.

Modules: this one (the scorer, driving a sample's cases), ``forms`` (ground-truth
forms, tally), ``completion`` (the prompt's code in front of a response), ``languages`` (which code block, which language), ``polyglot`` and
``compiled`` (the other languages), ``slot`` (a slot's processes and pipes),
``isolation`` (backends, uids, teardown), ``cgroups``, ``seccomp``, ``wire``, ``judge``.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import marshal
import os
import sys
import sysconfig
import time
from collections.abc import AsyncIterator
from typing import Any

from stream_reward.config import SandboxConfig
from stream_reward.errors import ScoringError, VerifierError
from stream_reward.scoring.sandbox.compiled import CompileCache
from stream_reward.scoring.sandbox.completion import whole_program
from stream_reward.scoring.sandbox.forms import (
    CASE_STATUSES,
    WRONG_ANSWER_EXIT,
    case_script,
    extract_code,
    no_code,
    parse_tests,
    tally,
)
from stream_reward.scoring.sandbox.isolation import OUT_OF_RESOURCES, choose_backend, root_spec
from stream_reward.scoring.sandbox.judge import same, same_output
from stream_reward.scoring.sandbox.languages import Toolchain, choose_program, task_language
from stream_reward.scoring.sandbox.polyglot import find_toolchains, score_other, toolchain_of
from stream_reward.scoring.sandbox.seccomp import filter_bytes
from stream_reward.scoring.sandbox.slot import CHECKER_SOURCE, HARNESS_SOURCE, Slot, SlotBroken, json_message, kill_pid
from stream_reward.scoring.sandbox.task_prompt import task_code
from stream_reward.scoring.sandbox.wire import WireError, loads
from stream_reward.scoring.scorer import Scored
from stream_reward.wire.trajectory import Trajectory

# The test-form helpers are re-exported: SandboxFusion and the benchmark use them from here.
__all__ = [
    "SandboxScorer",
    "CASE_STATUSES",
    "WRONG_ANSWER_EXIT",
    "extract_code",
    "parse_tests",
    "no_code",
    "tally",
    "case_script",
]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- the scorer


class SandboxScorer:
    """Scores a response by running its last code block against the sample's tests
    (see ``tally`` for the score and its extra). ``close()`` / ``aclose()`` stop
    the slots; they also die with this process."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self.root = os.geteuid() == 0
        self.config, self._toolchains = find_toolchains(self.config)
        self.compile_cache = CompileCache(self.config.compile_cache_dir, self.config.compile_cache_mb)
        self._owner_pid = os.getpid()
        self._sem: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        self._boot: dict[str, Any] | None = None
        self._slots = [Slot(self, i) for i in range(self.config.concurrency)]
        self._free = list(reversed(self._slots))
        same_python = os.path.realpath(self.config.python) == os.path.realpath(sys.executable)
        self.harness_code = marshal.dumps(
            compile(HARNESS_SOURCE, "<sandbox-harness>", "exec") if same_python else HARNESS_SOURCE, 4
        )
        self.checker_code = marshal.dumps(compile(CHECKER_SOURCE, "<sandbox-checker>", "exec"), 4)
        self._seccomp = filter_bytes() if self.config.seccomp else None
        if self.config.seccomp and self._seccomp is None:
            logger.warning("no seccomp filter for this architecture: candidate syscalls are not filtered")
        self.backend = self.config.backend  # named in errors while the probe runs
        try:
            self.backend = choose_backend(self.config, root=self.root, probe=self._probe_run)
        except BaseException:
            self.compile_cache.close()  # a scorer that never started leaves no directory behind
            raise
        if self.backend == "none":
            logger.warning(
                "SANDBOX DISABLED: unsafe_no_isolation=True, model-written code runs with this process's "
                "privileges, network and filesystem. Never do this with untrusted code."
            )
        atexit.register(self.close)

    def boot_base(self) -> dict[str, Any]:
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
        slot = Slot(self, -1)
        try:
            slot.start_harness()
            assert slot.h is not None
            slot.ready(slot.h.recv_sync(60))
            slot.h.send(marshal.dumps(self._case_msg("stdin", "print('ok')", b"", 10.0), 4))
            done = json_message(slot.h.recv_sync(60))
            if done.get("ev") != "done" or done.get("status") or done.get("exit") != 0 or done["stdout"] != "ok\n":
                return f"probe program did not pass: {str(done)[:300]}"
        except (OSError, EOFError, TimeoutError, SlotBroken, VerifierError) as exc:
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
        self.compile_cache.close()

    async def aclose(self) -> None:
        self.close()

    # -- running

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._sem is None or self._sem[0] is not loop:
            self._sem = (loop, asyncio.BoundedSemaphore(self.config.concurrency))
        return self._sem[1]

    async def score(self, traj: Trajectory) -> Scored:
        form, cases = parse_tests(traj.ground_truth)
        chosen = choose_program(traj.response, task_language(traj.ground_truth, traj.extra_info))
        if chosen is None:
            return no_code(cases, all_or_nothing=self.config.all_or_nothing)
        language, program = chosen
        if language != "python":
            return await score_other(self, language, program, form, cases)
        # The ground truth's own prompt first: a dataset states it there for every path.
        given = cases[0].get("prompt")
        prompt = task_code(given if given is not None else traj.prompt)
        results = await self.run(whole_program(prompt, program), form, cases, prompt=prompt)
        missing = next((detail for status, detail in results if status == "unresolved"), None)
        if missing is not None:
            where = "the task's prompt" if prompt else "the task's prompt (the sample carries none)"
            raise ScoringError(
                f"the test needs `{missing}`, which neither the test nor {where} defines", reason="unresolved_name"
            )
        return tally(results, all_or_nothing=self.config.all_or_nothing)

    def toolchain(self, language: str) -> Toolchain:
        """``language``'s toolchain; VerifierError(reason="toolchain_missing") naming
        the missing program when this host lacks it."""
        return toolchain_of(self._toolchains, language)

    async def run(
        self, program: str, form: str, cases: list[dict[str, Any]], prompt: str | None = None
    ) -> list[tuple[str, str]]:
        """Run ``program`` against ``cases`` (as from parse_tests) in one sandbox slot;
        return ``(status, detail)`` per case."""
        async with self._slot() as slot:
            return await self._run_cases(slot, program, form, cases, prompt)

    async def run_program(
        self,
        program: str,
        stdin: bytes,
        *,
        timeout_s: float,
        memory_mb: int | None = None,
        files: list[tuple[str, bytes]] | None = None,
        fetch: list[str] | None = None,
    ) -> dict[str, Any]:
        """Run ``program`` once as a plain program with ``stdin`` (SandboxFusion's
        ``/run_code``): the harness's report — ``status`` (None, "timeout", "memory",
        "output_limit"), ``exit`` or ``signal``, ``stdout``, ``err`` (its last 4 KiB) —
        plus ``elapsed_s`` and ``files``. Wall and CPU time are ``timeout_s``; RLIMIT_AS
        is ``memory_mb``, at most the config's (the slot's cgroup holds that).

        ``files`` (relative paths, checked by the caller) are written in the program's
        fresh working directory first; ``fetch`` names the regular files read back there
        when it ends by returning, ``exit()`` or an exception (``files`` maps those found
        to their bytes; the program's own data, it may forge it)."""
        cfg = self.config
        msg = self._case_msg("stdin", program, stdin, timeout_s, files=files or [], fetch=fetch or [])
        memory_mb = cfg.memory_mb if memory_mb is None else min(memory_mb, cfg.memory_mb)
        msg["limits"] = {**msg["limits"], "cpu_s": timeout_s, "memory_mb": memory_mb}
        async with self._slot() as slot:
            assert slot.h is not None
            start = time.monotonic()
            slot.h.send(marshal.dumps(msg, 4))
            done = await self._done(slot, timeout_s)
            elapsed = time.monotonic() - start
        return {**done, "elapsed_s": elapsed, "files": _fetched(done, fetch or [])}

    @contextlib.asynccontextmanager
    async def _slot(self) -> AsyncIterator[Slot]:
        """A started slot of our own for the block; a slot left in an unknown state
        (an error, a cancellation) is stopped and starts afresh next time."""
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
                    except (EOFError, SlotBroken, asyncio.TimeoutError) as exc:
                        raise VerifierError(
                            f"{self.backend} sandbox did not start: {slot.stderr_tail() or exc}",
                            reason="sandbox_unavailable",
                        ) from None
                yield slot
                ok = True
            except (SlotBroken, EOFError, OSError, asyncio.TimeoutError) as exc:
                if isinstance(exc, OSError) and exc.errno in OUT_OF_RESOURCES:
                    raise VerifierError(f"host out of resources: {exc}", reason="host_resources") from exc
                raise VerifierError(f"{self.backend} sandbox failed: {exc}", reason="sandbox_unavailable") from exc
            finally:
                if not ok:
                    slot.stop()
                self._free.append(slot)

    async def _run_cases(
        self,
        slot: Slot,
        program: str,
        form: str,
        cases: list[dict[str, Any]],
        prompt: str | None,
        job: dict[str, Any] | None = None,
    ) -> list[tuple[str, str]]:
        """``job``: a program of another language (``compiled.run_job``), stdin form."""
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
                results.append(await self._stdin_case(slot, program, case, timeout_s, job))
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

    async def _done(self, slot: Slot, timeout_s: float) -> dict[str, Any]:
        """The harness's next message, within the case's time plus a margin."""
        assert slot.h is not None
        msg = json_message(await asyncio.wait_for(slot.h.recv(), timeout_s + 10))
        if msg.get("ev") == "infra":
            reason = "host_resources" if msg.get("errno") in OUT_OF_RESOURCES else "sandbox_unavailable"
            raise VerifierError(f"sandbox harness failed: {msg.get('error')}", reason=reason)
        if msg.get("ev") not in ("done", "msg"):
            raise SlotBroken(f"unexpected message from the harness: {str(msg)[:200]}")
        return msg

    async def _stdin_case(
        self, slot: Slot, program: str, case: dict[str, Any], timeout_s: float, job: dict[str, Any] | None = None
    ) -> tuple[str, str]:
        assert slot.h is not None
        msg = self._case_msg("stdin", program, case["stdin"].encode(), timeout_s)
        key = None
        if job is not None:
            key = job.get("key")
            if key is not None and slot.staged == key:  # the harness keeps this program's files
                job = {k: v for k, v in job.items() if k not in ("files", "key")} | {"staged": key}
            elif key is not None:
                job = {k: v for k, v in job.items() if k != "key"} | {"stage": key}
            msg.update(mode="exec", program="", exec=job)
            limits = {**msg["limits"], "address_space": job.get("address_space", True)}
            limits["memory_mb"] = max(limits["memory_mb"], job.get("address_space_mb", 0))  # RLIMIT_AS only
            msg["limits"] = limits
        slot.h.send(marshal.dumps(msg, 4))
        done = await self._done(slot, timeout_s)
        slot.staged = key if key is not None else slot.staged
        verdict = _exit_verdict(done)
        if verdict is not None:
            return verdict
        ok = same_output(
            str(done.get("stdout", "")), case["stdout"], case.get("abs_tol", 0.0), case.get("rel_tol", 0.0)
        )
        return ("passed", "") if ok else ("failed", "wrong answer")

    async def _call_case(self, slot: Slot, program: str, case: dict[str, Any], timeout_s: float) -> tuple[str, str]:
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

    async def _open_checker_sample(self, slot: Slot, prompt: str | None) -> None:
        if slot.checker is None or slot.checker.poll() is not None:
            slot.start_checker()
            assert slot.c is not None
            if marshal.loads(await asyncio.wait_for(slot.c.recv(), 60)) != ("ready",):
                raise SlotBroken("checker did not start")
        assert slot.c is not None
        checker_mb = 2 * self.config.memory_mb + 1024  # an interpreter's own address space, plus room
        slot.c.send(marshal.dumps(("sample", prompt or "", self.boot_base()["sys_path"], checker_mb)))
        started = marshal.loads(await asyncio.wait_for(slot.c.recv(), 30))
        if not (isinstance(started, tuple) and started[0] == "started"):
            raise SlotBroken(f"checker could not start a sample: {started!r}")
        slot.checker_pid = int(started[1])

    async def _checked_case(
        self, slot: Slot, program: str, form: str, case: dict[str, Any], timeout_s: float
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
                    kill_pid(slot.checker_pid)
                    slot.checker_pid = None
                    crashed = marshal.loads(await asyncio.wait_for(slot.c.recv(), 10))
                    if crashed[0] != "crashed":
                        raise SlotBroken("checker did not stop") from None
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
                raise SlotBroken(f"unexpected message from the checker: {msg!r:.200}")

    async def _until_done(self, slot: Slot, timeout_s: float) -> dict[str, Any]:
        while True:
            event = await self._done(slot, timeout_s)
            if event["ev"] == "done":
                return event


def _fetched(done: dict[str, Any], names: list[str]) -> dict[str, bytes]:
    """The files a run read back: its last well-formed ``("files", {name: bytes})``
    reply, keeping only names that were asked for."""
    for raw in reversed(done.get("replies") or []):
        try:
            value = loads(str(raw).encode("utf-8", "surrogateescape"))
        except WireError:
            continue
        if type(value) is tuple and len(value) == 2 and value[0] == "files" and type(value[1]) is dict:
            return {k: v for k, v in value[1].items() if k in names and type(v) is bytes}
    return {}


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
