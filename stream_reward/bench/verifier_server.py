"""A reference verifier server for tests and benchmarks (aiohttp.web, loopback by default).

It speaks every protocol the HTTP scorers speak:

* ``POST /`` (also ``/score``) — the generic verifier: ``{"uid", "data_source",
  "solution_str", "ground_truth", "extra_info", "prompt"}`` -> ``{"score", "acc", ...}``;
  the score is an exact match of solution_str and ground_truth (``--rule``:
  ``exact``, ``contains``, or ``rules`` for the built-in math rule scorers);
* ``POST /classify`` — vLLM's reward-model API, ``{"model", "input"}`` ->
  ``data[i].probs``; the "model" gives 0.9 when the input contains
  ``--rm-keyword`` and 0.1 otherwise;
* ``POST /v1/embeddings`` — SGLang's reward-model API, the same score as a
  one-element embedding;
* ``POST /v1/chat/completions`` — an OpenAI-compatible judge: it compares the
  ``<response>`` and ``<reference>`` sections of the last user message and ends
  its verdict with ``Score: 1`` or ``Score: 0``.

It enforces its own quota strictly, as the big APIs do: RPM and TPM are token
buckets refilled continuously (``rpm/60`` requests a second, with ``--rpm-burst``
requests of headroom), and a request over either one gets a 429 with
``Retry-After`` (whole seconds) and ``retry-after-ms``. It can inject latency
(log-normal from p50/p99), 5xx replies, connection resets, hangs and garbage.
``GET /stats`` reports what it saw: counts by outcome, per-second windows, and
with ``?log=1`` every request's arrival time and status.

Run ``python -m stream_reward.bench.verifier_server --port 0 --rpm 600``: the first line on
stdout is the base URL. From tests: ``async with VerifierServer(rpm=600) as srv:``
(``await srv.start()`` returns the base URL).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import random
import re
import signal
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, fields
from typing import Any

from aiohttp import web

from stream_reward.ops.worker_cli import add_deprecated_flag

__all__ = ["ServerConfig", "VerifierServer", "main"]

_RESPONSE = re.compile(r"<response>(.*?)</response>", re.S)
_REFERENCE = re.compile(r"<reference>(.*?)</reference>", re.S)
_LOG_MAX = 200_000


@dataclass
class ServerConfig:
    rpm: float | None = None
    tpm: float | None = None
    rpm_burst: float | None = None  # default: max(1, rpm/60) — one second of headroom
    tpm_burst: float | None = None  # default: tpm/60
    max_concurrent: int | None = None  # concurrent requests over this get a 429
    retry_after_s: float | None = None  # fixed Retry-After; default: when the bucket has room again
    latency_ms_p50: float = 0.0
    latency_ms_p99: float | None = None
    fail_5xx_rate: float = 0.0
    fail_status: int = 503
    reset_rate: float = 0.0
    timeout_rate: float = 0.0
    hang_s: float = 30.0  # how long a "timeout" request hangs before answering
    garbage_rate: float = 0.0
    rule: str = "exact"
    rm_keyword: str = "GOOD"
    name: str = "reference"
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.rule not in ("exact", "contains", "rules"):
            raise ValueError(f"rule must be exact, contains or rules, got {self.rule!r}")
        for name in ("fail_5xx_rate", "reset_rate", "timeout_rate", "garbage_rate"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {value}")


class _Bucket:
    """A token bucket: ``rate`` a second, ``capacity`` at most. May go negative (TPM
    charges the real usage after the fact)."""

    def __init__(self, rate: float, capacity: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self.level = capacity
        self.at = time.monotonic()

    def refill(self) -> float:
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now
        return self.level

    def wait_for(self, need: float) -> float:
        """Seconds until the level reaches ``need``."""
        return max(0.0, (need - self.level) / self.rate)


class _Stats:
    def __init__(self) -> None:
        self.started = time.time()
        self.counts: dict[str, int] = {
            "requests": 0,
            "ok": 0,
            "http_429": 0,
            "http_5xx": 0,
            "http_4xx": 0,
            "resets": 0,
            "timeouts": 0,
            "garbage": 0,
        }
        self.by_path: dict[str, int] = {}
        self.tokens = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.windows: dict[int, list[int]] = {}  # epoch second -> [received, ok, 429]
        self.log: deque[tuple[float, str, int]] = deque(maxlen=_LOG_MAX)
        self.loop_lags: list[tuple[float, float]] = []  # (when, lag seconds) over 20 ms: the server itself stalled

    def window(self, at: float) -> list[int]:
        return self.windows.setdefault(int(at), [0, 0, 0])

    def snapshot(self, *, with_log: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            **self.counts,
            "tokens": self.tokens,
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            "by_path": dict(self.by_path),
            "started": self.started,
            "now": time.time(),
            "windows": [[sec, *counts] for sec, counts in sorted(self.windows.items())],
        }
        out["loop_stalls"] = [[round(t, 4), round(lag, 4)] for t, lag in self.loop_lags[-100:]]
        if with_log:
            out["log"] = [list(entry) for entry in self.log]
        return out


def _tokens(*texts: Any) -> int:
    return sum(math.ceil(len(t) / 4) for t in texts if isinstance(t, str))


def _error(
    status: int, message: str, *, error_type: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    """An error reply in the OpenAI shape: ``{"error": {"message", "type"?}}``."""
    error = {"message": message} if error_type is None else {"message": message, "type": error_type}
    return web.json_response({"error": error}, status=status, headers=headers)


def _rm_texts(body: dict[str, Any]) -> list[str] | None:
    """A reward-model request's ``input`` (one string or a list of them) as a list; None if malformed."""
    inputs = body.get("input")
    texts = [inputs] if isinstance(inputs, str) else inputs
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        return None
    return texts


class VerifierServer:
    """The server, in-process. ``url = await srv.start()`` ... ``await srv.stop()``."""

    def __init__(
        self, config: ServerConfig | None = None, *, host: str = "127.0.0.1", port: int = 0, **overrides: Any
    ) -> None:
        self.config = config or ServerConfig(**overrides)
        if config is not None and overrides:
            self.config = ServerConfig(**{**asdict(config), **overrides})
        self.host = host
        self.port = port
        self.url = ""
        self._stats = _Stats()
        self._rng = random.Random(self.config.seed)
        cfg = self.config
        self._rpm = _Bucket(cfg.rpm / 60, cfg.rpm_burst or max(1.0, cfg.rpm / 60)) if cfg.rpm else None
        self._tpm = _Bucket(cfg.tpm / 60, cfg.tpm_burst or cfg.tpm / 60) if cfg.tpm else None
        self._runner: web.AppRunner | None = None
        self._watch: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> str:
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_post("/", self._generic)
        app.router.add_post("/score", self._generic)
        app.router.add_post("/classify", self._classify)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/stats", self._stats_view)
        app.router.add_get("/health", self._health)
        # handler_cancellation: a client that gave up (timeout test) cancels its hung handler.
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0, access_log=None)
        await self._runner.setup()
        # A backlog as deep as the kernel allows (somaxconn caps it): with aiohttp's 128, a
        # thousand clients connecting at once lose SYNs and wait out the 1 s retransmit,
        # which measures the listen queue, not the verifier or its callers.
        site = web.TCPSite(self._runner, self.host, self.port, backlog=4096)
        await site.start()
        port = self._runner.addresses[0][1]
        self._watch = asyncio.create_task(self._watch_loop())
        self.url = f"http://{self.host}:{port}"
        return self.url

    async def _watch_loop(self) -> None:
        # The quota is judged when a handler runs: a stalled server loop turns
        # evenly spaced arrivals into a burst. Record stalls so a bench can tell.
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(0.005)
            lag = loop.time() - before - 0.005
            if lag > 0.02:
                self._stats.loop_lags.append((time.time(), lag))

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            try:
                await self._watch
            except asyncio.CancelledError:
                pass
            self._watch = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> VerifierServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def stats(self, *, with_log: bool = False) -> dict[str, Any]:
        return self._stats.snapshot(with_log=with_log)

    # ------------------------------------------------------------------ the common path
    async def _serve(self, request: web.Request, handle: Any) -> web.StreamResponse:
        """Quota, fault injection and bookkeeping around one protocol handler."""
        st, cfg = self._stats, self.config
        arrived = time.time()
        st.counts["requests"] += 1
        st.by_path[request.path] = st.by_path.get(request.path, 0) + 1
        st.window(arrived)[0] += 1
        status = 0
        st.in_flight += 1
        st.max_in_flight = max(st.max_in_flight, st.in_flight)
        try:
            limited = self._over_quota()
            if limited is not None:
                status = 429
                return limited
            if self._rng.random() < cfg.reset_rate:
                st.counts["resets"] += 1
                if request.transport is not None:
                    request.transport.abort()
                status = -1
                raise asyncio.CancelledError  # nothing more to send on a dead connection
            if self._rng.random() < cfg.timeout_rate:
                st.counts["timeouts"] += 1
                status = -2
                await asyncio.sleep(cfg.hang_s)
            await self._latency()
            if self._rng.random() < cfg.fail_5xx_rate:
                st.counts["http_5xx"] += 1
                status = cfg.fail_status
                return _error(cfg.fail_status, "injected failure", error_type="server_error")
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                body = None
            if not isinstance(body, dict):
                st.counts["http_4xx"] += 1
                status = 400
                return _error(400, "body must be a JSON object")
            garbage = self._rng.random() < cfg.garbage_rate
            response, tokens = handle(body, garbage)
            if garbage:
                st.counts["garbage"] += 1
            elif response.status == 200:
                st.counts["ok"] += 1
                st.window(arrived)[1] += 1
            else:
                st.counts["http_4xx"] += 1
            st.tokens += tokens
            if self._tpm is not None:
                self._tpm.level -= tokens
            status = response.status
            return response
        finally:
            st.in_flight -= 1
            st.log.append((arrived, request.path, status))

    def _over_quota(self) -> web.Response | None:
        cfg, st = self.config, self._stats
        wait = None
        if cfg.max_concurrent is not None and st.in_flight > cfg.max_concurrent:
            wait = 0.05
        if wait is None and self._rpm is not None and self._rpm.refill() < 1:
            wait = self._rpm.wait_for(1)
        if wait is None and self._tpm is not None and self._tpm.refill() <= 0:
            wait = self._tpm.wait_for(1e-9)
        if wait is None:
            if self._rpm is not None:
                self._rpm.level -= 1
            return None
        st.counts["http_429"] += 1
        st.window(time.time())[2] += 1
        if cfg.retry_after_s is not None:
            wait = cfg.retry_after_s
        headers = {"Retry-After": str(max(1, math.ceil(wait))), "retry-after-ms": str(max(1, math.ceil(wait * 1000)))}
        return _error(429, "rate limit exceeded", error_type="rate_limit_exceeded", headers=headers)

    async def _latency(self) -> None:
        cfg = self.config
        if cfg.latency_ms_p50 <= 0:
            return
        if cfg.latency_ms_p99 and cfg.latency_ms_p99 > cfg.latency_ms_p50:
            sigma = math.log(cfg.latency_ms_p99 / cfg.latency_ms_p50) / 2.3263
            ms = cfg.latency_ms_p50 * math.exp(self._rng.gauss(0.0, sigma))
        else:
            ms = cfg.latency_ms_p50
        await asyncio.sleep(ms / 1000)

    # ------------------------------------------------------------------ protocols
    async def _generic(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, self._generic_reply)

    def _generic_reply(self, body: dict[str, Any], garbage: bool) -> tuple[web.Response, int]:
        if garbage:
            if self._rng.random() < 0.5:
                return web.Response(text="<html><body>502 upstream hiccup</body></html>", content_type="text/html"), 0
            return web.json_response({"result": "maybe"}), 0
        solution = body.get("solution_str")
        if not isinstance(solution, str):
            return _error(422, "solution_str must be a string"), 0
        ground_truth = body.get("ground_truth")
        score = self._rule(body.get("data_source"), solution, ground_truth, body.get("extra_info"))
        tokens = _tokens(solution, body.get("prompt"))
        return web.json_response(
            {"score": score, "acc": score > 0, "verifier": self.config.name, "usage": {"total_tokens": tokens}}
        ), tokens

    def _rule(self, data_source: Any, solution: str, ground_truth: Any, extra_info: Any) -> float:
        rule = self.config.rule
        if rule == "exact":
            return float(solution.strip() == str(ground_truth).strip())
        if rule == "contains":
            return float(str(ground_truth).strip() in solution)
        from stream_reward.scoring.rules import compute_score
        from stream_reward.scoring.scorer import normalize

        return normalize(compute_score(data_source, solution, ground_truth, extra_info or {})).score

    def _rm_score(self, text: str) -> float:
        return 0.9 if self.config.rm_keyword in text else 0.1

    async def _classify(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, self._classify_reply)

    def _classify_reply(self, body: dict[str, Any], garbage: bool) -> tuple[web.Response, int]:
        texts = _rm_texts(body)
        if texts is None:
            return _error(400, "input must be a string or a list of strings"), 0
        tokens = _tokens(*texts)
        if garbage:
            return web.json_response({"object": "list", "data": []}), 0
        data = []
        for i, text in enumerate(texts):
            p = self._rm_score(text)
            data.append(
                {"index": i, "label": "LABEL_1" if p > 0.5 else "LABEL_0", "probs": [1 - p, p], "num_classes": 2}
            )
        return web.json_response(
            {
                "id": f"classify-{self._rng.getrandbits(48):x}",
                "object": "list",
                "created": int(time.time()),
                "model": body.get("model"),
                "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
            }
        ), tokens

    async def _embeddings(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, self._embeddings_reply)

    def _embeddings_reply(self, body: dict[str, Any], garbage: bool) -> tuple[web.Response, int]:
        texts = _rm_texts(body)
        if texts is None:
            return _error(400, "input must be a string or a list of strings"), 0
        tokens = _tokens(*texts)
        if garbage:
            return web.json_response(
                {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": "NaN"}]}
            ), 0
        data = [{"object": "embedding", "index": i, "embedding": [self._rm_score(t)]} for i, t in enumerate(texts)]
        return web.json_response(
            {
                "object": "list",
                "data": data,
                "model": body.get("model"),
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        ), tokens

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, self._chat_reply)

    def _chat_reply(self, body: dict[str, Any], garbage: bool) -> tuple[web.Response, int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            return _error(400, "messages must be a non-empty list of objects"), 0
        user = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), None)
        if not isinstance(user, str):
            return _error(400, "no user message"), 0
        if garbage:
            content = "I am not able to decide whether this response is correct."
        else:
            response, reference = _RESPONSE.search(user), _REFERENCE.search(user)
            if response is None or reference is None:
                content = "The message has no <response> or <reference> section to compare.\nScore: 0"
            else:
                same = response.group(1).strip() == reference.group(1).strip()
                content = f"The response {'matches' if same else 'does not match'} the reference.\nScore: {int(same)}"
        prompt_tokens = _tokens(*(m.get("content") for m in messages))
        completion_tokens = _tokens(content)
        total = prompt_tokens + completion_tokens
        return web.json_response(
            {
                "id": f"chatcmpl-{self._rng.getrandbits(48):x}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model"),
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
                ],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": total,
                },
            }
        ), total

    async def _stats_view(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats(with_log=request.query.get("log") in ("1", "true")))

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "name": self.config.name})


# ---------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m stream_reward.bench.verifier_server", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (the URL is printed first)")
    for f in fields(ServerConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "rule":
            parser.add_argument(flag, default=f.default, choices=("exact", "contains", "rules"))
        elif f.name in ("name", "rm_keyword"):
            parser.add_argument(flag, default=f.default)
        elif f.name in ("max_concurrent", "seed", "fail_status"):
            parser.add_argument(flag, type=int, default=f.default)
        else:
            parser.add_argument(flag, type=float, default=f.default)
    add_deprecated_flag(parser, "--max-inflight", "--max-concurrent", type=int)
    return parser


async def _serve_forever(server: VerifierServer) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    url = await server.start()
    # Everything imported so far lives as long as the process: keep it out of the
    # collector's way, so a full collection does not stall the loop (and the quota
    # clock) mid-run.
    gc.collect()
    gc.freeze()
    print(url, flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    values = {f.name: getattr(args, f.name) for f in fields(ServerConfig)}
    try:
        config = ServerConfig(**values)
    except ValueError as exc:
        print(f"verifier_server: {exc}", file=sys.stderr)
        return 2
    asyncio.run(_serve_forever(VerifierServer(config, host=args.host, port=args.port)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
