"""``POST /run_code``: SandboxFusion's endpoint, served by our local sandbox.

verl's ``sandbox_fusion`` reward path and many training repos call SandboxFusion;
pointed here, they run on the sandbox the ``sandbox`` scorer uses (``docs/sandbox.md``:
bwrap or unshare, a fresh PID/mount namespace per program, cgroups, seccomp) — one
``SandboxScorer`` and its slots, no second sandbox.

Answers (``run_code_wire``): ``Success`` when the program exited 0; ``Failed``
when it exited otherwise, was killed, or ran out of time
(``run_result.status = "TimeLimitExceeded"``); ``SandboxError`` when we could not
run it (the sandbox cannot start, the host is out of resources) — never
``Success`` or ``Failed`` for our fault. Limits: ``run_timeout`` (wall and CPU
time) and ``memory_limit_MB`` (RLIMIT_AS) are honoured up to the configured
maxima; ``-1`` (SandboxFusion's "no limit") means the maximum. stdout and stderr
are each capped at ``max_output_bytes`` (stderr reports its last 4 KiB); at most
``concurrency`` programs run at once and later requests wait their turn.
``files`` are written in the program's fresh working directory (its private
/tmp) before it starts, and ``fetch_files`` read back from there when it ends by
returning, ``exit()`` or an exception — not after ``os._exit``, a kill or the
deadline, where SandboxFusion would still find them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import web

from stream_reward.config import SandboxConfig
from stream_reward.errors import BadInputError, ConfigError, StreamRewardError, VerifierError
from stream_reward.gateway.run_code_wire import parse_request, reply_from_report, sandbox_error
from stream_reward.scoring.sandbox.scorer import SandboxScorer

__all__ = ["RunCodeConfig", "add_run_code_routes"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RunCodeConfig:
    """``concurrency`` programs run at once (one sandbox slot each). A request's
    ``run_timeout`` and ``memory_limit_MB`` are clamped to ``max_run_timeout_s`` and
    ``max_memory_mb``; ``default_run_timeout_s`` (SandboxFusion's 10 s) applies when
    it sends none. ``sandbox`` chooses the backend, uids and cgroups; its own limits
    are replaced by these."""

    concurrency: int = os.cpu_count() or 1
    default_run_timeout_s: float = 10.0
    max_run_timeout_s: float = 60.0
    max_memory_mb: int = 1024
    max_output_bytes: int = 4 * 1024 * 1024
    max_body_bytes: int = 16 * 1024 * 1024
    max_files_bytes: int = 8 * 1024 * 1024  # a request's files, decoded; they live in the program's /tmp
    # Bodies held at once by requests running or waiting for a slot; past it a request is
    # refused with a 504 (SandboxFusion clients retry it) instead of queued without bound.
    max_queued_bytes: int = 256 * 1024 * 1024
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)

    def __post_init__(self) -> None:
        for key in (
            "concurrency",
            "default_run_timeout_s",
            "max_run_timeout_s",
            "max_memory_mb",
            "max_output_bytes",
            "max_body_bytes",
            "max_files_bytes",
            "max_queued_bytes",
        ):
            if not getattr(self, key) > 0:
                raise ConfigError(f"run_code.{key}", "must be > 0")
        if self.max_queued_bytes < self.max_body_bytes:
            raise ConfigError("run_code.max_queued_bytes", "must be >= max_body_bytes, or a largest body never runs")

    def sandbox_config(self) -> SandboxConfig:
        return dataclasses.replace(
            self.sandbox,
            concurrency=self.concurrency,
            timeout_s=self.max_run_timeout_s,
            cpu_s=self.max_run_timeout_s,
            sample_timeout_s=self.max_run_timeout_s + 1,
            memory_mb=self.max_memory_mb,
            max_output_bytes=self.max_output_bytes,
        )


class _Runner:
    """The route's sandbox, built at startup. A sandbox that cannot be built (no
    backend on this host) is kept as its reason: every request then answers
    ``SandboxError`` with it, and the rest of the gateway still serves."""

    def __init__(self, config: RunCodeConfig) -> None:
        self.config = config
        self.scorer: SandboxScorer | None = None
        self.unavailable = ""
        self.held = 0  # body bytes of the requests being read, waiting or running

    async def start(self) -> None:
        try:
            # The backend probe runs a real program: keep it off the event loop.
            self.scorer = await asyncio.to_thread(SandboxScorer, self.config.sandbox_config())
        except ConfigError as exc:
            self.unavailable = f"the sandbox is unavailable on this host: {exc}"
            log.error("/run_code: %s", self.unavailable)

    def close(self) -> None:
        if self.scorer is not None:
            self.scorer.close()
            self.scorer = None


_RUNNER = web.AppKey("run_code_runner", _Runner)


def add_run_code_routes(app: web.Application, config: RunCodeConfig | None = None) -> None:
    """Registers ``POST /run_code`` on ``app``, and its sandbox's start and stop."""
    runner = _Runner(config or RunCodeConfig())
    app[_RUNNER] = runner

    async def sandbox_lifetime(app: web.Application) -> AsyncIterator[None]:
        await runner.start()
        yield
        runner.close()

    app.cleanup_ctx.append(sandbox_lifetime)
    app.router.add_post("/run_code", _run_code)


def _refuse(status: int, reason: str, detail: object = None) -> web.Response:
    body = {"error": reason, "detail": detail if detail is not None else reason}
    return web.json_response(body, status=status)


class _Busy(Exception):
    """The bodies held at once would pass ``max_queued_bytes``."""


async def _read_body(request: web.Request, runner: _Runner, held: list[int]) -> bytes | None:
    """The body, or None past ``max_body_bytes`` (chunked bodies too). Its bytes are
    counted in ``runner.held`` as they arrive (``held[0]``: this request's share, for the
    caller to give back); _Busy past ``max_queued_bytes``."""
    limit, budget = runner.config.max_body_bytes, runner.config.max_queued_bytes
    if request.content_length is not None and request.content_length > limit:
        return None

    def hold(n: int) -> None:
        if runner.held + n > budget:
            raise _Busy
        runner.held += n
        held[0] += n

    if request.content_length is not None:
        hold(request.content_length)
    data = bytearray()
    async for chunk in request.content.iter_any():
        data += chunk
        if len(data) > limit:
            return None
        if len(data) > held[0]:  # chunked, or longer than announced
            hold(len(data) - held[0])
    return bytes(data)


async def _run_code(request: web.Request) -> web.Response:
    runner = request.app[_RUNNER]
    held = [0]
    try:
        return await _serve(request, runner, held)
    except _Busy:
        budget = runner.config.max_queued_bytes
        reply = _refuse(504, f"busy: request bodies held at once would pass {budget} bytes (max_queued_bytes); retry")
        reply.headers["Retry-After"] = "1"
        return reply
    finally:
        runner.held -= held[0]


async def _serve(request: web.Request, runner: _Runner, held: list[int]) -> web.Response:
    cfg = runner.config
    raw = await _read_body(request, runner, held)
    if raw is None:
        return _refuse(413, f"request body over {cfg.max_body_bytes} bytes")
    try:
        body = json.loads(raw)
    except RecursionError:  # nested past the parser's recursion: the client's fault, not a 500
        return _refuse(400, "request body is not JSON: nested too deeply for the parser")
    except ValueError as exc:  # bad syntax, bad UTF-8, an integer past Python's 4300 digits
        return _refuse(400, f"request body is not JSON: {exc}")
    try:
        req = parse_request(body, default_run_timeout_s=cfg.default_run_timeout_s, max_files_bytes=cfg.max_files_bytes)
    except BadInputError as exc:
        return _refuse(422, str(exc), getattr(exc, "detail", None))
    if runner.scorer is None:
        return web.json_response(sandbox_error(runner.unavailable or "the sandbox is not started"))
    try:
        report = await runner.scorer.run_program(
            req.code,
            (req.stdin or "").encode("utf-8", "surrogatepass"),
            timeout_s=min(req.run_timeout_s, cfg.max_run_timeout_s),
            memory_mb=req.memory_limit_mb,
            files=req.files,
            fetch=req.fetch_files,
        )
    except VerifierError as exc:
        log.warning("/run_code: sandbox error (%s): %s", exc.reason, exc)
        return web.json_response(sandbox_error(f"{exc.reason}: {exc}"))
    except (StreamRewardError, OSError) as exc:
        # Anything else that stopped the run is ours too: SandboxFusion answers the same.
        log.exception("/run_code: the sandbox failed")
        return web.json_response(sandbox_error(f"{type(exc).__name__}: {exc}"))
    return web.json_response(reply_from_report(report))
