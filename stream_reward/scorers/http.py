"""Remote verifiers over HTTP: a generic verifier, discriminative and generative reward models.

Specs (``--scorer``), each taking one or more base URLs separated by commas::

    http:URL[,URL...]    POST URL  {"uid", "data_source", "solution_str", "ground_truth",
                                    "extra_info", "prompt"} -> {"score": float, ...}
    disrm:URL[,URL...]   a reward model: vLLM  POST /classify  {"model", "input"} -> data[-1].probs[-1]
                                         SGLang POST /v1/embeddings             -> data[-1].embedding[i]
    genrm:URL[,URL...]   an LLM judge on POST /v1/chat/completions; the verdict is parsed for a score

Options come from ``reward_kwargs`` (``--reward-kwargs '{"api": "embeddings"}'``);
see ``HttpOptions`` and docs/remote.md. Each request:

1. takes a lease of the verifier's global quota (``stream_reward.quota``) — RPM,
   TPM (charged with an estimate, settled with the reply's ``usage``), in flight,
   and the shared pause after a 429;
2. goes to the base URL with the fewest requests in flight whose circuit breaker
   is closed (a server failing ``breaker_failures`` times in a row is skipped for
   a cool-down, then probed with a single request);
3. is retried on infrastructure faults (``stream_reward.retry``); a 429 pauses
   every worker for its ``Retry-After``; data faults fail the sample at once.

The aiohttp session is created on first use inside the running loop (never in
``__init__``) with a bounded connector, and closed by ``aclose()``. ``stats``
holds the counters a metrics collector reads.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import aiohttp
from yarl import URL

from ..broker import mask_url
from ..errors import BadReplyError, ConfigError, ScoringError, VerifierError
from ..quota import QuotaConfig, QuotaLimiter
from ..retry import RetryPolicy, call_with_retry, status_error, transport_error
from ..scoring import Scored, load_function, normalize
from ..trajectory import Trajectory

__all__ = [
    "HttpOptions",
    "HttpScorer",
    "GenericVerifier",
    "DisRMScorer",
    "GenRMScorer",
    "CircuitBreaker",
    "Router",
    "build_http_scorer",
]

log = logging.getLogger(__name__)

DEFAULT_GENRM_TEMPLATE = (
    "Judge whether the response answers the question correctly. Compare it with the reference answer.\n\n"
    "<question>{prompt}</question>\n\n"
    "<reference>{ground_truth}</reference>\n\n"
    "<response>{response}</response>\n\n"
    'Think briefly, then end with a last line "Score: 1" if the response is correct or "Score: 0" if it is not.'
)
# The last "Score: x" (or "score = x", "**Score:** x") or \boxed{x} of the verdict.
DEFAULT_SCORE_PATTERN = r"(?:\\boxed\{\s*|(?i:score)\**\s*[:=]\s*\**\s*)(-?\d+(?:\.\d+)?)"

_PLACEHOLDER = re.compile(r"\{(prompt|response|ground_truth|data_source|uid)\}")


def render(template: str, traj: Trajectory) -> str:
    """Fill ``{prompt}``, ``{response}``, ``{ground_truth}``, ``{data_source}``, ``{uid}``.

    Only these names are replaced, so any other brace in a template (``\\boxed{}``,
    JSON examples) is left alone — ``str.format`` would choke on it.
    """
    values = {
        "prompt": traj.prompt or "",
        "response": traj.response,
        "ground_truth": "" if traj.ground_truth is None else str(traj.ground_truth),
        "data_source": traj.data_source,
        "uid": traj.uid,
    }
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


# ---------------------------------------------------------------------- options
@dataclass
class HttpOptions:
    """Options of the HTTP scorers, from ``reward_kwargs``. Unknown keys are an error.

    Common: ``headers`` (sent with every request), ``api_key`` / ``api_key_env``
    (``Authorization: Bearer``; also keys the quota when no ``quota_key`` is set),
    ``connect_timeout_s``, ``max_connections`` (per process; default
    ``max_concurrent`` or 256), ``breaker_failures`` / ``breaker_cooldown_s`` /
    ``breaker_max_cooldown_s``, ``backoff_base_s`` / ``backoff_max_s``,
    ``adaptive_rate`` (lower the shared rate after repeated 429s), ``burst``
    (GCRA burst, requests), ``model`` (sent when set), ``extra_body`` (merged into
    every request body).

    ``disrm``: ``api`` = ``classify`` (vLLM, default) or ``embeddings`` (SGLang),
    ``template`` (default ``{prompt}{response}``; apply the model's chat template
    here), ``embedding_index`` (default 0).

    ``genrm``: ``template`` (user message; default asks for ``Score: 0|1``),
    ``system``, ``score_pattern`` (regex, group 1 is the score; the last match
    wins), ``score_parser`` (``FILE.py:FUNC`` or ``module:FUNC``, ``fn(verdict) ->
    float | dict | None``; None means unparseable), ``score_scale`` (multiplies a
    regex score), ``max_tokens``, ``temperature``, ``keep_verdict`` (verdict text
    in the extra info as ``genrm_verdict``).
    """

    headers: dict[str, str] = field(default_factory=dict)
    api_key: str | None = None
    api_key_env: str | None = None
    connect_timeout_s: float = 10.0
    max_connections: int | None = None
    breaker_failures: int = 3
    breaker_cooldown_s: float = 5.0
    breaker_max_cooldown_s: float = 60.0
    backoff_base_s: float = 0.1
    backoff_max_s: float = 10.0
    adaptive_rate: bool = False
    burst: float = 1.0
    model: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    # disrm
    api: str = "classify"
    template: str | None = None
    embedding_index: int = 0
    # genrm
    system: str | None = None
    score_pattern: str = DEFAULT_SCORE_PATTERN
    score_parser: Any = None
    score_scale: float = 1.0
    max_tokens: int = 1024
    temperature: float = 0.0
    keep_verdict: bool = False

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any] | None) -> HttpOptions:
        kwargs = dict(kwargs or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"reward_kwargs.{unknown[0]}", f"unknown option of the HTTP scorers; known: {', '.join(sorted(known))}")
        options = cls(**kwargs)
        options.validate()
        return options

    def validate(self) -> None:
        if self.api not in ("classify", "embeddings"):
            raise ConfigError("reward_kwargs.api", f"must be 'classify' or 'embeddings', got {self.api!r}")
        for key in ("connect_timeout_s", "breaker_cooldown_s", "breaker_max_cooldown_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"reward_kwargs.{key}", f"must be > 0, got {getattr(self, key)!r}")
        if self.breaker_failures < 1:
            raise ConfigError("reward_kwargs.breaker_failures", f"must be >= 1, got {self.breaker_failures!r}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ConfigError("reward_kwargs.max_connections", f"must be >= 1, got {self.max_connections!r}")
        try:
            compiled = re.compile(self.score_pattern)
        except re.error as exc:
            raise ConfigError("reward_kwargs.score_pattern", f"not a valid regex: {exc}") from None
        if compiled.groups < 1:
            raise ConfigError("reward_kwargs.score_pattern", "needs a capturing group around the score")
        if self.api_key_env and not self.api_key:
            import os

            self.api_key = os.environ.get(self.api_key_env)
            if not self.api_key:
                raise ConfigError("reward_kwargs.api_key_env", f"environment variable {self.api_key_env!r} is not set")


# ---------------------------------------------------------------------- routing
class CircuitBreaker:
    """Closed -> open after ``failures`` infrastructure faults in a row; after
    ``cooldown_s`` one probe request is let through (half-open): success closes
    the breaker, failure re-opens it with twice the cool-down (up to ``max_cooldown_s``)."""

    def __init__(self, failures: int = 3, cooldown_s: float = 5.0, max_cooldown_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = failures
        self.base_cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.state = "closed"
        self.consecutive = 0
        self.open_until = 0.0
        self.trips = 0

    def available(self) -> bool:
        if self.state == "closed":
            return True
        return self.state == "open" and self.clock() >= self.open_until

    def on_pick(self) -> None:
        if self.state == "open":
            self.state = "half_open"  # this request is the probe; others keep away

    def success(self) -> None:
        if self.state != "closed":
            log.info("circuit closed again after a successful probe")
        self.state = "closed"
        self.consecutive = 0
        self.cooldown_s = self.base_cooldown_s

    def failure(self) -> None:
        self.consecutive += 1
        if self.state == "half_open":
            self.cooldown_s = min(self.cooldown_s * 2, self.max_cooldown_s)
            self._open()
        elif self.state == "closed" and self.consecutive >= self.threshold:
            self._open()

    def abandon(self) -> None:
        """The probe ended without a verdict (cancelled): let another one through."""
        if self.state == "half_open":
            self.state = "open"

    def _open(self) -> None:
        self.state = "open"
        self.open_until = self.clock() + self.cooldown_s
        self.trips += 1


class Endpoint:
    def __init__(self, url: str, breaker: CircuitBreaker) -> None:
        self.url = url
        self.label = mask_url(url)
        self.breaker = breaker
        self.in_flight = 0
        self.requests = 0
        self.failures = 0


class Router:
    """Fewest requests in flight among the servers whose breaker lets them through;
    when no breaker does, the server due back soonest (fail open)."""

    def __init__(self, endpoints: list[Endpoint]) -> None:
        if not endpoints:
            raise ConfigError("scorer", "no base URL")
        self.endpoints = endpoints
        self._next = 0

    def pick(self) -> Endpoint:
        n = len(self.endpoints)
        best: Endpoint | None = None
        # Start the scan at a rotating offset: ties go round-robin, not always to the first.
        for i in range(n):
            ep = self.endpoints[(self._next + i) % n]
            if ep.breaker.available() and (best is None or ep.in_flight < best.in_flight):
                best = ep
        self._next = (self._next + 1) % n
        if best is None:
            # Every server is failing. Refusing to send would only burn the retry
            # budget without a real attempt (and with one server, the breaker
            # would be all harm): send to the one due back soonest; the retry
            # backoff, not the breaker, paces these attempts.
            return min(self.endpoints, key=lambda ep: (ep.breaker.open_until, ep.in_flight))
        best.breaker.on_pick()
        return best


# ---------------------------------------------------------------------- scorers
class _NoLease:
    waited_s = 0.0

    def settle(self, actual_tokens: int) -> None:
        pass

    async def __aenter__(self) -> _NoLease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


_NO_LEASE = _NoLease()


def _json_default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    item = getattr(value, "item", None)
    if callable(item):
        return item()
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    return str(value)


class HttpScorer:
    """Common machinery; subclasses say what to send (``request``) and how to read
    the reply (``parse``)."""

    kind: ClassVar[str] = "http"
    # This scorer takes its own quota leases: a rate-limiting wrapper must not add a second.
    manages_quota: ClassVar[bool] = True

    def __init__(
        self,
        urls: list[str],
        *,
        options: HttpOptions | None = None,
        timeout_s: float = 30.0,
        retry: RetryPolicy | None = None,
        limiter: QuotaLimiter | None = None,
        estimated_tokens: int | None = None,
        max_connections: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.options = options or HttpOptions()
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy(backoff_base_s=self.options.backoff_base_s, backoff_max_s=self.options.backoff_max_s)
        self.limiter = limiter
        self.estimated_tokens = estimated_tokens
        self.max_connections = max_connections
        o = self.options
        self.router = Router([Endpoint(self.endpoint_url(u), CircuitBreaker(o.breaker_failures, o.breaker_cooldown_s, o.breaker_max_cooldown_s, clock))
                              for u in urls])
        # What metrics and logs call this verifier; build_http_scorer sets the quota name.
        self.name = f"{self.kind}:" + ",".join(mask_url(u) for u in urls)
        self.stats: dict[str, Any] = {
            "requests": 0, "ok": 0, "failed": 0, "retries": 0, "http_429": 0, "quota_wait_s": 0.0, "tokens": 0,
            "failures_by_reason": {},
        }
        headers = {"Content-Type": "application/json", **o.headers}
        if o.api_key:
            headers.setdefault("Authorization", f"Bearer {o.api_key}")
        self._headers = headers
        self._session: aiohttp.ClientSession | None = None
        self._slots: asyncio.Semaphore | None = None

    # -------------------------------------------------------------- protocol hooks
    def endpoint_url(self, base: str) -> str:
        return base

    def request(self, traj: Trajectory) -> dict[str, Any]:
        raise NotImplementedError

    def parse(self, reply: Any, traj: Trajectory) -> tuple[Scored, int | None]:
        raise NotImplementedError

    def _with_model(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.options.model is not None:
            body["model"] = self.options.model
        body.update(self.options.extra_body)
        return body

    # -------------------------------------------------------------- plumbing
    def _session_now(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            timeout = aiohttp.ClientTimeout(total=self.timeout_s, connect=min(self.timeout_s, self.options.connect_timeout_s))
            connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0, ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, headers=self._headers)
            # Waiting for a pooled connection would count against the request's
            # timeout inside aiohttp; waiting here does not.
            self._slots = asyncio.Semaphore(self.max_connections)
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self.limiter is not None:
            await self.limiter.aclose()

    def endpoints(self) -> list[dict[str, Any]]:
        """Per-server counters and breaker state (for `status` and metrics)."""
        return [{"url": ep.label, "in_flight": ep.in_flight, "requests": ep.requests, "failures": ep.failures,
                 "breaker": ep.breaker.state, "trips": ep.breaker.trips} for ep in self.router.endpoints]

    def _count_failure(self, reason: str) -> None:
        by_reason = self.stats["failures_by_reason"]
        by_reason[reason] = by_reason.get(reason, 0) + 1

    # -------------------------------------------------------------- scoring
    async def score(self, traj: Trajectory) -> Scored:
        try:
            body = json.dumps(self.request(traj), default=_json_default).encode()
        except (TypeError, ValueError) as exc:
            self.stats["failed"] += 1
            self._count_failure("bad_request")
            raise ScoringError(f"cannot encode the request for uid {traj.uid!r}: {exc}", reason="bad_request", attempts=0) from exc
        limiter = self.limiter

        async def pause_everyone(retry_after_s: float | None) -> None:
            if limiter is not None:
                await limiter.block_for(retry_after_s if retry_after_s is not None else self.retry.backoff_s(1))

        def on_retry(exc: BaseException, n: int, delay: float) -> None:
            self.stats["retries"] += 1
            log.debug("uid %r: attempt %d failed (%s); retrying in %.2fs", traj.uid, n, getattr(exc, "reason", exc), delay)

        try:
            scored = await call_with_retry(lambda n: self._attempt(traj, body), self.retry,
                                           on_retry=on_retry, on_rate_limited=pause_everyone)
        except ScoringError as exc:
            self.stats["failed"] += 1
            self._count_failure(exc.reason)
            raise
        self.stats["ok"] += 1
        return scored

    async def _attempt(self, traj: Trajectory, body: bytes) -> Scored:
        session = self._session_now()
        assert self._slots is not None
        lease_cm: Any = self.limiter.lease(self.estimated_tokens) if self.limiter is not None else _NO_LEASE
        async with lease_cm as lease:
            self.stats["quota_wait_s"] += lease.waited_s
            endpoint = self.router.pick()
            try:
                async with self._slots:
                    status, headers, raw = await self._post(session, endpoint, body)
            except asyncio.CancelledError:
                endpoint.breaker.abandon()
                raise
            except Exception as exc:
                fault = transport_error(exc, what=endpoint.label)
                if fault is None:
                    endpoint.breaker.abandon()
                    raise
                endpoint.failures += 1
                endpoint.breaker.failure()
                raise fault from exc
            if status == 429:
                self.stats["http_429"] += 1
            if not 200 <= status < 300:
                err = status_error(status, headers, raw, what=endpoint.label)
                if isinstance(err, VerifierError):
                    endpoint.failures += 1
                    endpoint.breaker.failure()
                else:  # the server is up: 429 and 4xx are not its health's business
                    endpoint.breaker.success()
                raise err
            endpoint.breaker.success()
            try:
                reply = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                snippet = " ".join(raw[:200].decode(errors="replace").split())
                raise BadReplyError(f"{endpoint.label} replied 200 with a body that is not JSON: {snippet!r}", reason="bad_json") from None
            scored, used = self.parse(reply, traj)
            if used is not None:
                self.stats["tokens"] += used
                lease.settle(used)
            elif self.estimated_tokens:
                self.stats["tokens"] += self.estimated_tokens
            return scored

    async def _post(self, session: aiohttp.ClientSession, endpoint: Endpoint, body: bytes) -> tuple[int, Any, bytes]:
        endpoint.in_flight += 1
        endpoint.requests += 1
        self.stats["requests"] += 1
        try:
            async with session.post(endpoint.url, data=body) as resp:
                return resp.status, resp.headers, await resp.read()
        finally:
            endpoint.in_flight -= 1


def _usage_tokens(reply: dict[str, Any]) -> int | None:
    usage = reply.get("usage")
    if not isinstance(usage, dict):
        return None
    total = usage.get("total_tokens")
    if total is None:
        parts = [usage.get("prompt_tokens"), usage.get("completion_tokens")]
        if all(p is None for p in parts):
            return None
        total = sum(p for p in parts if isinstance(p, (int, float)))
    if isinstance(total, bool) or not isinstance(total, (int, float)) or total < 0:
        return None
    return int(total)


def _path(url: str, *suffixes: str) -> str:
    """``url`` if it already ends with one of ``suffixes`` (a full endpoint URL),
    else the base URL with the first suffix appended (``/v1`` bases get the rest)."""
    trimmed = url.rstrip("/")
    for suffix in suffixes:
        if trimmed.endswith(suffix):
            return trimmed
    full = suffixes[0]
    if trimmed.endswith("/v1") and full.startswith("/v1/"):
        return trimmed + full[3:]
    return trimmed + full


class GenericVerifier(HttpScorer):
    """``http:URL`` — POST the sample; the reply's ``score`` is the score, every other
    key but ``usage`` lands in the extra info."""

    kind = "http"

    def request(self, traj: Trajectory) -> dict[str, Any]:
        body = {"uid": traj.uid, "data_source": traj.data_source, "solution_str": traj.response,
                "ground_truth": traj.ground_truth, "extra_info": traj.extra_info, "prompt": traj.prompt}
        body.update(self.options.extra_body)
        return body

    def parse(self, reply: Any, traj: Trajectory) -> tuple[Scored, int | None]:
        if not isinstance(reply, dict):
            raise BadReplyError(f"verifier replied with a JSON {type(reply).__name__}, not an object", reason="no_score")
        if "score" not in reply:
            raise BadReplyError(f"verifier reply has no 'score' (keys: {sorted(map(str, reply))[:10]})", reason="no_score")
        used = _usage_tokens(reply)
        return normalize({k: v for k, v in reply.items() if k != "usage"}), used


class DisRMScorer(HttpScorer):
    """``disrm:URL`` — a discriminative reward model behind vLLM ``/classify`` or
    SGLang ``/v1/embeddings`` (option ``api``)."""

    kind = "disrm"

    def endpoint_url(self, base: str) -> str:
        if self.options.api == "embeddings":
            return _path(base, "/v1/embeddings", "/embeddings")
        return _path(base, "/classify")

    def request(self, traj: Trajectory) -> dict[str, Any]:
        return self._with_model({"input": render(self.options.template or "{prompt}{response}", traj)})

    def parse(self, reply: Any, traj: Trajectory) -> tuple[Scored, int | None]:
        try:
            item = reply["data"][-1]
            if self.options.api == "embeddings":
                value = item["embedding"][self.options.embedding_index]
            else:
                value = item["probs"][-1]
        except (KeyError, IndexError, TypeError):
            shape = "data[-1].embedding" if self.options.api == "embeddings" else "data[-1].probs[-1]"
            raise BadReplyError(f"reward model reply has no {shape}: {json.dumps(reply)[:200]}", reason="no_score") from None
        return normalize(value), _usage_tokens(reply) if isinstance(reply, dict) else None


class GenRMScorer(HttpScorer):
    """``genrm:URL`` — an LLM judge on an OpenAI-compatible ``/v1/chat/completions``."""

    kind = "genrm"

    def __init__(self, urls: list[str], **kwargs: Any) -> None:
        super().__init__(urls, **kwargs)
        o = self.options
        self._pattern = re.compile(o.score_pattern)
        parser = o.score_parser
        if isinstance(parser, str):
            parser = load_function(parser)
        if parser is not None and not callable(parser):
            raise ConfigError("reward_kwargs.score_parser", f"must be FILE.py:FUNC, module:FUNC or a callable, got {parser!r}")
        self._parser: Callable[[str], Any] | None = parser

    def endpoint_url(self, base: str) -> str:
        return _path(base, "/v1/chat/completions", "/chat/completions")

    def request(self, traj: Trajectory) -> dict[str, Any]:
        o = self.options
        messages = []
        if o.system:
            messages.append({"role": "system", "content": render(o.system, traj)})
        messages.append({"role": "user", "content": render(o.template or DEFAULT_GENRM_TEMPLATE, traj)})
        return self._with_model({"messages": messages, "max_tokens": o.max_tokens, "temperature": o.temperature})

    def parse(self, reply: Any, traj: Trajectory) -> tuple[Scored, int | None]:
        try:
            verdict = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise BadReplyError(f"judge reply has no choices[0].message.content: {json.dumps(reply)[:200]}", reason="no_verdict") from None
        if not isinstance(verdict, str):
            raise BadReplyError(f"judge verdict is {type(verdict).__name__}, not text", reason="no_verdict")
        used = _usage_tokens(reply)
        scored = self.verdict_score(verdict)
        if self.options.keep_verdict:
            scored.extra["genrm_verdict"] = verdict
        return scored, used

    def verdict_score(self, verdict: str) -> Scored:
        if self._parser is not None:
            try:
                value = self._parser(verdict)
            except Exception as exc:  # the user's parser refusing a verdict is a data fault
                raise BadReplyError(f"score_parser raised {type(exc).__name__}: {exc}", reason="unparseable_verdict") from exc
            if value is None:
                raise BadReplyError(f"score_parser found no score in the verdict: {_tail(verdict)!r}", reason="unparseable_verdict")
            return normalize(value)
        matches = self._pattern.findall(verdict)
        if not matches:
            raise BadReplyError(f"no score matching {self.options.score_pattern!r} in the verdict: {_tail(verdict)!r}",
                                reason="unparseable_verdict")
        last = matches[-1]
        text = last[0] if isinstance(last, tuple) else last
        try:
            value = float(text) * self.options.score_scale
        except ValueError:
            raise BadReplyError(f"score {text!r} in the verdict is not a number", reason="unparseable_verdict") from None
        if not math.isfinite(value):
            raise BadReplyError(f"score {text!r} in the verdict is not finite", reason="unparseable_verdict")
        return Scored(value)


def _tail(text: str, n: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else "..." + text[-n:]


_KINDS: dict[str, type[HttpScorer]] = {"http": GenericVerifier, "disrm": DisRMScorer, "genrm": GenRMScorer}


# ---------------------------------------------------------------------- factory
def parse_spec(spec: str) -> tuple[str, list[str]]:
    """``kind:URL[,URL...]`` -> (kind, urls), validated."""
    kind, sep, rest = spec.partition(":")
    if kind not in _KINDS or not sep:
        raise ConfigError("scorer", f"{spec!r} is not http:URL, disrm:URL or genrm:URL")
    urls = [u.strip() for u in rest.split(",") if u.strip()]
    if not urls:
        raise ConfigError("scorer", f"{spec!r} needs at least one URL: {kind}:URL[,URL...]")
    for url in urls:
        try:
            parsed = URL(url)
        except (ValueError, TypeError) as exc:
            raise ConfigError("scorer", f"{mask_url(url)!r} is not a URL: {exc}") from None
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ConfigError("scorer", f"{mask_url(url)!r} must be an http:// or https:// URL with a host")
    return kind, urls


def quota_name(kind: str, urls: list[str], options: HttpOptions, quota_key: str | None) -> str:
    """The quota's key: ``quota_key``; else the API key's fingerprint (providers meter
    per key); else the spec with credentials masked."""
    if quota_key:
        name = quota_key
    elif options.api_key:
        name = "key-" + hashlib.sha256(options.api_key.encode()).hexdigest()[:16]
    else:
        name = f"{kind}:" + ",".join(mask_url(u) for u in urls)
    return name.replace("{", "(").replace("}", ")")


def build_http_scorer(spec: str, config: Any) -> HttpScorer:
    """The scorer for an ``http:`` / ``disrm:`` / ``genrm:`` spec under a ManagerConfig.

    ``config.timeout`` bounds each HTTP request (time spent waiting for quota is
    not counted); ``config.retries`` is the budget for infrastructure faults;
    ``max_rpm`` / ``max_tpm`` / ``max_concurrent`` become the global quota named
    ``quota_key``. With a Redis URL the quota (and the shared 429 pause) is
    always on; without one, limits are a configuration error.
    """
    kind, urls = parse_spec(spec)
    options = HttpOptions.from_kwargs(getattr(config, "reward_kwargs", None))
    redis_url = getattr(config, "redis_url", None)
    limits = {"max_rpm": config.max_rpm, "max_tpm": config.max_tpm, "max_inflight": config.max_concurrent}
    limiter = None
    if redis_url:
        limiter = QuotaLimiter(redis_url, QuotaConfig(
            name=quota_name(kind, urls, options, config.quota_key),
            **limits,
            estimated_tokens_per_request=config.estimated_tokens_per_request,
            lease_ttl_s=max(60.0, 2 * config.timeout),
            burst=options.burst,
            adaptive=options.adaptive_rate,
        ), namespace=config.namespace)
    elif any(v is not None for v in limits.values()):
        raise ConfigError("redis_url", f"{', '.join(k for k, v in limits.items() if v is not None)} need a Redis URL: the quota is kept in Redis")
    if not config.timeout > 0:
        raise ConfigError("timeout", f"must be > 0, got {config.timeout!r}")
    try:
        retry = RetryPolicy(retries=config.retries, backoff_base_s=options.backoff_base_s, backoff_max_s=options.backoff_max_s)
    except ValueError as exc:
        raise ConfigError("retries", str(exc)) from None
    scorer = _KINDS[kind](
        urls,
        options=options,
        timeout_s=config.timeout,
        retry=retry,
        limiter=limiter,
        estimated_tokens=config.estimated_tokens_per_request,
        max_connections=options.max_connections or config.max_concurrent or 256,
    )
    scorer.name = quota_name(kind, urls, options, config.quota_key)
    return scorer
