"""Score code on a remote SandboxFusion server (``POST {url}/run_code``).

Same responses and ground-truth forms as the local sandbox (``scorer.py``): the
same code block, a Python completion after the task's prompt, a compiled
language's program in SandboxFusion's runtime for it (stdin form only; C has
none there: ``failed``, reason ``toolchain_missing``). Each test case becomes
one request: the stdin form sends the program and the case's stdin, the
call/assert/check forms send a stand-alone program that runs the check and exits
with ``WRONG_ANSWER_EXIT`` on a wrong answer.

SandboxFusion replies ``status`` ∈ Success | Failed | SandboxError. ``Failed`` is
the program's fault (a wrong answer, a crash, a time limit) and scores the case
0; ``SandboxError``, connection errors, timeouts, 5xx and 429 are the sandbox's
fault: retried with jittered exponential backoff (honouring ``Retry-After``,
``stream_reward.retry``), then raised as ``VerifierError`` so the sample is
marked failed — never a 0. Other 4xx and unreadable replies are data faults
(``BadReplyError``), not retried.

The aiohttp session is created on first use inside the running loop and closed
by ``aclose()`` (or ``async with``); keep one scorer per event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp

from stream_reward.errors import BadReplyError, ConfigError, ScoringError, VerifierError
from stream_reward.scoring.retry import RetryPolicy, call_with_retry, status_error, transport_error
from stream_reward.scoring.sandbox.completion import whole_program
from stream_reward.scoring.sandbox.forms import parse_tests
from stream_reward.scoring.sandbox.judge import same_output
from stream_reward.scoring.sandbox.languages import choose_program, task_language
from stream_reward.scoring.sandbox.scorer import WRONG_ANSWER_EXIT, case_script, no_code, tally
from stream_reward.scoring.sandbox.task_prompt import task_code
from stream_reward.scoring.scorer import Scored
from stream_reward.wire.trajectory import Trajectory

__all__ = ["SandboxFusionConfig", "SandboxFusionScorer"]

log = logging.getLogger(__name__)

# Our language -> SandboxFusion's runtime for it (C has none: its programs are not C++).
_RUNTIMES = {"cpp": "cpp", "java": "java", "javascript": "nodejs", "go": "go", "rust": "rust"}


@dataclass(frozen=True, slots=True)
class SandboxFusionConfig:
    language: str = "python"
    compile_timeout_s: float = 10.0
    run_timeout_s: float = 10.0
    memory_limit_mb: int = 1024
    connect_timeout_s: float = 5.0
    request_timeout_s: float | None = None  # default: compile + run timeout + 10 s
    retries: int = 3  # attempts after the first, per test case
    backoff_base_s: float = 0.5
    backoff_max_s: float = 10.0
    concurrency: int = 32  # requests in flight per scorer
    all_or_nothing: bool = False

    def __post_init__(self) -> None:
        for key in ("compile_timeout_s", "run_timeout_s", "memory_limit_mb", "connect_timeout_s", "concurrency"):
            if not getattr(self, key) > 0:
                raise ConfigError(key, "must be > 0")
        if self.retries < 0:
            raise ConfigError("retries", "must be >= 0")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ConfigError("request_timeout_s", "must be > 0")


class SandboxFusionScorer:
    """``extra`` has the local sandbox's keys: ``cases``, ``passed``, ``total``, ``error``."""

    def __init__(self, url: str, config: SandboxFusionConfig | None = None) -> None:
        if not url.startswith(("http://", "https://")):
            raise ConfigError("url", f"{url!r} is not an http(s) URL")
        self.url = url.rstrip("/") + "/run_code"
        self.config = config or SandboxFusionConfig()
        self.retry = RetryPolicy(
            retries=self.config.retries,
            backoff_base_s=self.config.backoff_base_s,
            backoff_max_s=self.config.backoff_max_s,
        )
        # Created inside the running loop on first use, never here (the loop may not exist yet).
        self._session: aiohttp.ClientSession | None = None
        self._slots: asyncio.Semaphore | None = None

    async def __aenter__(self) -> SandboxFusionScorer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
            self._slots = None

    def _client(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        if self._session is None or self._session.closed or self._slots is None:
            cfg = self.config
            total = cfg.request_timeout_s or cfg.compile_timeout_s + cfg.run_timeout_s + 10.0
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=total, connect=cfg.connect_timeout_s),
                connector=aiohttp.TCPConnector(limit=cfg.concurrency),
            )
            self._slots = asyncio.BoundedSemaphore(cfg.concurrency)
        return self._session, self._slots

    async def score(self, traj: Trajectory) -> Scored:
        form, cases = parse_tests(traj.ground_truth)
        aon = self.config.all_or_nothing
        # The same program the local sandbox runs: the block chosen the same way, and a
        # Python completion after the task's prompt (the ground truth's, else the sample's).
        chosen = choose_program(traj.response, task_language(traj.ground_truth, traj.extra_info))
        if chosen is None:
            return no_code(cases, all_or_nothing=aon)
        language, program = chosen
        if language == "python":
            given = cases[0].get("prompt")
            program = whole_program(task_code(given if given is not None else traj.prompt), program)
            runtime = self.config.language
        elif language not in _RUNTIMES:
            raise ScoringError(f"SandboxFusion has no runtime for {language}", reason="toolchain_missing")
        elif form != "stdin":
            return tally([("failed", f"{language} runs only in the stdin form")] * len(cases), all_or_nothing=aon)
        else:
            runtime = _RUNTIMES[language]
        tasks = [asyncio.create_task(self._case(traj.uid, form, program, case, runtime)) for case in cases]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return tally(results, all_or_nothing=self.config.all_or_nothing)

    async def _case(self, uid: str, form: str, program: str, case: dict[str, Any], runtime: str) -> tuple[str, str]:
        code, stdin = case_script(form, program, case)
        cfg = self.config
        body = json.dumps(
            {
                "code": code,
                "language": runtime,
                "compile_timeout": cfg.compile_timeout_s,
                "run_timeout": cfg.run_timeout_s,
                "memory_limit_MB": cfg.memory_limit_mb,
                "stdin": stdin,
            }
        ).encode()

        def on_retry(exc: BaseException, n: int, delay: float) -> None:
            log.debug(
                "uid %r: SandboxFusion attempt %d failed (%s); retrying in %.2fs",
                uid,
                n,
                getattr(exc, "reason", exc),
                delay,
            )

        reply = await call_with_retry(lambda n: self._attempt(body), self.retry, on_retry=on_retry)
        return _judge(form, case, reply)

    async def _attempt(self, body: bytes) -> dict[str, Any]:
        session, slots = self._client()
        try:
            async with slots, session.post(self.url, data=body, headers={"Content-Type": "application/json"}) as resp:
                status, headers, raw = resp.status, resp.headers, await resp.read()
        except Exception as exc:
            fault = transport_error(exc, what="SandboxFusion")
            if fault is None:
                raise
            raise fault from exc
        if not 200 <= status < 300:
            raise status_error(status, headers, raw, what="SandboxFusion")
        try:
            reply = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            snippet = " ".join(raw[:200].decode(errors="replace").split())
            raise BadReplyError(
                f"SandboxFusion replied 200 with a body that is not JSON: {snippet!r}", reason="bad_json"
            ) from None
        if not isinstance(reply, dict) or reply.get("status") not in ("Success", "Failed", "SandboxError"):
            raise BadReplyError(f"SandboxFusion reply has no valid status: {str(reply)[:200]}", reason="bad_reply")
        if reply["status"] == "SandboxError":  # the sandbox broke, not the program: retry
            raise VerifierError(
                f"SandboxFusion SandboxError: {str(reply.get('message'))[:200]}", reason="sandbox_error"
            )
        return reply


def _judge(form: str, case: dict[str, Any], reply: dict[str, Any]) -> tuple[str, str]:
    run = reply.get("run_result") or {}
    compiled = reply.get("compile_result") or {}
    if not isinstance(run, dict) or not isinstance(compiled, dict):
        raise BadReplyError("SandboxFusion reply: run_result/compile_result are not objects")
    stdout, stderr = str(run.get("stdout") or ""), str(run.get("stderr") or "")
    detail = (stderr.strip().splitlines() or [""])[-1][:300]
    if reply["status"] == "Success":
        tol = case.get("abs_tol", 0.0), case.get("rel_tol", 0.0)
        if form == "stdin" and not same_output(stdout, case["stdout"], *tol):
            return "failed", "wrong answer"
        return "passed", ""
    if "TimeLimitExceeded" in (run.get("status"), compiled.get("status")):
        return "timeout", ""
    if run.get("return_code") == WRONG_ANSWER_EXIT and "wrong answer" in stderr:
        return "failed", "wrong answer"
    if "MemoryError" in stderr:
        return "memory", detail
    return "runtime_error", detail or str(reply.get("message") or "")[:300]
