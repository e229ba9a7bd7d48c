"""``HttpScorer``: how every remote scorer sends a request, whatever its protocol.

A protocol (``stream_reward.scoring.http.verifiers``) says what to send (``request``), where
(``endpoint_url``) and how to read the reply (``parse``). Everything else is here.
Each request:

1. takes a lease of the verifier's global quota (``stream_reward.scoring.quota``) — RPM,
   TPM (charged with an estimate, settled with the reply's ``usage``), in flight,
   and the shared pause after a 429;
2. goes to the base URL the ``Router`` picks (``stream_reward.scoring.http.router``):
   the fewest requests in flight whose circuit breaker is closed;
3. is retried on infrastructure faults (``stream_reward.scoring.retry``); a 429 pauses
   every worker for its ``Retry-After``; data faults fail the sample at once.

The aiohttp session is created on first use inside the running loop (never in
``__init__``) with a bounded connector, and closed by ``aclose()``. ``stats``
holds the counters a metrics collector reads.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, ClassVar

import aiohttp

from stream_reward.errors import BadReplyError, ScoringError, VerifierError
from stream_reward.scoring.http.options import HttpOptions
from stream_reward.scoring.http.router import CircuitBreaker, Endpoint, Router
from stream_reward.scoring.quota import QuotaLimiter
from stream_reward.scoring.retry import RetryPolicy, call_with_retry, status_error, transport_error
from stream_reward.scoring.scorer import Scored
from stream_reward.wire.codec import to_plain
from stream_reward.wire.connection import mask_url
from stream_reward.wire.trajectory import Trajectory

__all__ = ["HttpScorer", "Transport", "masked_spec"]

log = logging.getLogger(__name__)


# ``transport(url, body, headers) -> (status, headers, body)`` replaces the aiohttp
# session: unit tests of a protocol hand in a plain async function (as httpx's
# MockTransport takes a handler) and may raise aiohttp's errors to act a fault.
Transport = Callable[[str, bytes, Mapping[str, str]], Awaitable[tuple[int, Mapping[str, str], bytes]]]


def masked_spec(kind: str, urls: list[str]) -> str:
    """``kind:URL,...`` with credentials masked: safe for logs, metrics and key names."""
    return f"{kind}:" + ",".join(mask_url(u) for u in urls)


class _NoLease:
    """Stands in for a quota lease when the scorer has no limiter."""

    waited_s = 0.0

    def settle(self, actual_tokens: int) -> None:
        pass

    async def __aenter__(self) -> _NoLease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


_NO_LEASE = _NoLease()


def _json_default(value: Any) -> Any:
    # Samples carry numpy scalars and arrays, sets and bytes from datasets: send
    # them as the JSON they mean rather than failing the sample.
    if isinstance(value, (bytes, bytearray)):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, (set, frozenset)):
        return list(value)
    return to_plain(value, unknown=str)


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
        transport: Transport | None = None,
    ) -> None:
        self.options = options or HttpOptions()
        self._transport = transport
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy(
            backoff_base_s=self.options.backoff_base_s, backoff_max_s=self.options.backoff_max_s
        )
        self.limiter = limiter
        self.estimated_tokens = estimated_tokens
        self.max_connections = max_connections
        o = self.options
        self.router = Router(
            [
                Endpoint(
                    self.endpoint_url(u),
                    CircuitBreaker(o.breaker_failures, o.breaker_cooldown_s, o.breaker_max_cooldown_s, clock),
                )
                for u in urls
            ]
        )
        # What metrics and logs call this verifier; build_http_scorer sets the quota name.
        self.name = masked_spec(self.kind, urls)
        self.stats: dict[str, Any] = {
            "requests": 0,
            "ok": 0,
            "failed": 0,
            "retries": 0,
            "http_429": 0,
            "quota_wait_s": 0.0,
            "tokens": 0,
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
    def _session_now(self) -> aiohttp.ClientSession | None:
        if self._slots is None:
            # Waiting for a pooled connection would count against the request's
            # timeout inside aiohttp; waiting here does not.
            self._slots = asyncio.Semaphore(self.max_connections)
        if self._transport is not None:
            return None  # an injected transport needs no session
        if self._session is None or self._session.closed:
            timeout = aiohttp.ClientTimeout(
                total=self.timeout_s, connect=min(self.timeout_s, self.options.connect_timeout_s)
            )
            connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0, ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, headers=self._headers)
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self.limiter is not None:
            await self.limiter.aclose()

    def endpoints(self) -> list[dict[str, Any]]:
        """Per-server counters and breaker state (for `status` and metrics)."""
        return [
            {
                "url": ep.label,
                "in_flight": ep.in_flight,
                "requests": ep.requests,
                "failures": ep.failures,
                "breaker": ep.breaker.state,
                "trips": ep.breaker.trips,
            }
            for ep in self.router.endpoints
        ]

    def _count_failure(self, reason: str) -> None:
        self.stats["failed"] += 1
        by_reason = self.stats["failures_by_reason"]
        by_reason[reason] = by_reason.get(reason, 0) + 1

    # -------------------------------------------------------------- scoring
    async def score(self, traj: Trajectory) -> Scored:
        try:
            body = json.dumps(self.request(traj), default=_json_default).encode()
        except (TypeError, ValueError) as exc:
            self._count_failure("bad_request")
            raise ScoringError(
                f"cannot encode the request for uid {traj.uid!r}: {exc}", reason="bad_request", attempts=0
            ) from exc
        limiter = self.limiter

        async def pause_everyone(retry_after_s: float | None) -> None:
            if limiter is not None:
                await limiter.block_for(retry_after_s if retry_after_s is not None else self.retry.backoff_s(1))

        def on_retry(exc: BaseException, n: int, delay: float) -> None:
            self.stats["retries"] += 1
            log.debug(
                "uid %r: attempt %d failed (%s); retrying in %.2fs", traj.uid, n, getattr(exc, "reason", exc), delay
            )

        async def attempt(n: int) -> Scored:
            scored = await self._attempt(traj, body)
            scored.attempts = n  # real attempts, counted where they are made
            return scored

        try:
            scored = await call_with_retry(attempt, self.retry, on_retry=on_retry, on_rate_limited=pause_everyone)
        except ScoringError as exc:
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
                endpoint.failed()
                raise fault from exc
            if status == 429:
                self.stats["http_429"] += 1
            if not 200 <= status < 300:
                err = status_error(status, headers, raw, what=endpoint.label)
                if isinstance(err, VerifierError):
                    endpoint.failed()
                else:  # the server is up: 429 and 4xx are not its health's business
                    endpoint.breaker.success()
                raise err
            endpoint.breaker.success()
            try:
                reply = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                snippet = " ".join(raw[:200].decode(errors="replace").split())
                raise BadReplyError(
                    f"{endpoint.label} replied 200 with a body that is not JSON: {snippet!r}", reason="bad_json"
                ) from None
            scored, used = self.parse(reply, traj)
            if used is not None:
                self.stats["tokens"] += used
                lease.settle(used)
            elif self.estimated_tokens:
                self.stats["tokens"] += self.estimated_tokens
            return scored

    async def _post(
        self, session: aiohttp.ClientSession | None, endpoint: Endpoint, body: bytes
    ) -> tuple[int, Any, bytes]:
        endpoint.in_flight += 1
        endpoint.requests += 1
        self.stats["requests"] += 1
        try:
            if session is None:
                assert self._transport is not None
                return await self._transport(endpoint.url, body, self._headers)
            async with session.post(endpoint.url, data=body) as resp:
                return resp.status, resp.headers, await resp.read()
        finally:
            endpoint.in_flight -= 1
