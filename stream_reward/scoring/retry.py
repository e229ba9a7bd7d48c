"""Retries for remote verifiers, and the failure taxonomy they rely on.

Two kinds of fault, never confused:

* **infrastructure** — the verifier could not answer: connect errors, resets,
  timeouts, 408, 5xx, 429. Retried with jittered exponential backoff (honouring
  ``Retry-After``) up to a budget; when it is spent the sample fails with
  ``VerifierError`` whose ``reason`` says what kept failing (``"timeout"``,
  ``"connect"``, ``"reset"``, ``"http_503"``, ``"http_429"``...) and whose
  ``attempts`` says how often we tried.
* **data** — the verifier answered, but not with a score: other 4xx, a body that
  is not JSON, a verdict no parser understands. Retrying would get the same
  answer, so ``BadReplyError`` is raised at once.

A 429 is the verifier asking us to slow down. It is raised as ``RetryLater``
(``rate_limited=True``) so the loop can share the pause with every worker
(``on_rate_limited``, which the HTTP scorers point at ``QuotaLimiter.block_for``).

The module knows nothing about a particular protocol: ``status_error`` and
``transport_error`` translate HTTP statuses and aiohttp / OS exceptions into the
taxonomy, and ``call_with_retry`` drives any ``attempt(n)`` coroutine, so the
sandbox client can reuse all three.
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from stream_reward.errors import BadReplyError, RetryLater, ScoringError, VerifierError

__all__ = [
    "RetryPolicy",
    "call_with_retry",
    "status_error",
    "transport_error",
    "parse_retry_after",
]

T = TypeVar("T")

# A Retry-After further away than this is a misconfigured server, not advice.
MAX_RETRY_AFTER_S = 300.0


@dataclass(slots=True)
class RetryPolicy:
    """How often and how patiently to retry infrastructure faults.

    ``retries`` counts attempts after the first (verl's ``max_retries``), so a
    sample is tried at most ``retries + 1`` times. The delay before retry ``n``
    (1-based) is drawn from ``[d/2, d]`` with ``d = min(backoff_max_s,
    backoff_base_s * 2**(n-1))``: equal jitter keeps a floor under the delay
    while still spreading workers that failed together.
    """

    retries: int = 5
    backoff_base_s: float = 0.1
    backoff_max_s: float = 10.0

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        if self.backoff_base_s < 0 or self.backoff_max_s < 0:
            raise ValueError("backoff delays must be >= 0")

    def backoff_s(self, retry: int, rng: random.Random | None = None) -> float:
        ceiling = min(self.backoff_max_s, self.backoff_base_s * (2 ** max(0, retry - 1)))
        draw = (rng or random).random()
        return ceiling * (0.5 + 0.5 * draw)


def parse_retry_after(headers: Mapping[str, str], *, now: float | None = None) -> float | None:
    """Seconds to wait from ``retry-after-ms`` (OpenAI, vLLM) or ``Retry-After``
    (delta-seconds or an HTTP date); None when absent or unreadable."""
    value = headers.get("retry-after-ms") or headers.get("Retry-After-Ms")
    if value:
        try:
            return _clamp(float(value) / 1000.0)
        except ValueError:
            pass
    value = headers.get("Retry-After") or headers.get("retry-after")
    if not value:
        return None
    try:
        return _clamp(float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return _clamp(when.timestamp() - (time.time() if now is None else now))


def _clamp(seconds: float) -> float | None:
    if seconds != seconds:  # NaN
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


def status_error(
    status: int, headers: Mapping[str, str], body: bytes | str = b"", *, what: str = "verifier"
) -> Exception:
    """The taxonomy's exception for a non-2xx HTTP status (returned, not raised)."""
    snippet = body.decode(errors="replace") if isinstance(body, bytes) else body
    snippet = " ".join(snippet.split())[:200]
    detail = f"{what} replied HTTP {status}" + (f": {snippet}" if snippet else "")
    retry_after = parse_retry_after(headers)
    if status == 429:
        return RetryLater(detail, retry_after_s=retry_after, rate_limited=True, reason="http_429")
    if status == 408 or status >= 500:
        return VerifierError(detail, reason=f"http_{status}", retry_after_s=retry_after)
    return BadReplyError(detail, reason=f"http_{status}")


def transport_error(exc: BaseException, *, what: str = "verifier") -> VerifierError | None:
    """``VerifierError`` for an aiohttp / asyncio / OS transport fault, None for anything else.

    Reasons: ``timeout`` (no answer in time), ``connect`` (could not reach the
    server), ``reset`` (the connection broke mid-request).
    """
    reason = _transport_reason(exc)
    if reason is None:
        return None
    text = str(exc)
    return VerifierError(f"{what}: {reason} ({type(exc).__name__}{': ' + text if text else ''})", reason=reason)


def _transport_reason(exc: BaseException) -> str | None:
    try:
        import aiohttp
    except ImportError:  # pragma: no cover - aiohttp is a dependency
        aiohttp = None  # type: ignore[assignment]
    if aiohttp is not None:
        # Order matters: ConnectionTimeoutError is both a ServerTimeoutError and
        # a TimeoutError; ClientConnectorError is a ClientOSError.
        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            return "connect"
        if isinstance(exc, (aiohttp.ServerTimeoutError, asyncio.TimeoutError)):
            return "timeout"
        if isinstance(exc, aiohttp.ClientConnectorError):
            return "connect"
        if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError)):
            return "reset"
        if isinstance(exc, aiohttp.ClientResponseError):
            return None  # a status: see status_error
        if isinstance(exc, aiohttp.ClientConnectionError):
            return "reset"
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return "timeout"
    if isinstance(exc, ConnectionRefusedError):
        return "connect"
    if isinstance(exc, (ConnectionError, OSError)):
        return "reset"
    return None


RetryHook = Callable[[BaseException, int, float], None]
RateLimitHook = Callable[[float | None], Awaitable[None]]


async def call_with_retry(
    attempt: Callable[[int], Awaitable[T]],
    policy: RetryPolicy,
    *,
    on_retry: RetryHook | None = None,
    on_rate_limited: RateLimitHook | None = None,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    rng: random.Random | None = None,
) -> T:
    """Run ``attempt(n)`` (n = 1, 2, ...) until it returns, retrying infrastructure faults.

    ``attempt`` signals an infrastructure fault by raising ``VerifierError`` or
    ``RetryLater`` (``transport_error`` / ``status_error`` build them); any other
    ``ScoringError`` (a data fault) and any unrelated exception propagate at once,
    with ``attempts`` set on ScoringErrors. ``on_rate_limited(retry_after_s)`` is
    awaited for every 429 before backing off; ``on_retry(exc, n, delay_s)`` is
    told about each retry (counters, logs).
    """
    n = 0
    while True:
        n += 1
        fault: BaseException
        try:
            return await attempt(n)
        except RetryLater as exc:
            fault = exc
            retry_after = exc.retry_after_s
            if exc.rate_limited and on_rate_limited is not None:
                await on_rate_limited(retry_after)
            if n > policy.retries:
                raise VerifierError(f"{exc} (gave up after {n} attempts)", reason=exc.reason, attempts=n) from exc
            # The shared pause (if any) already holds every worker back until
            # retry_after; a little jitter keeps the restart from being a stampede.
            delay = (
                retry_after * (1.0 + 0.1 * (rng or random).random())
                if retry_after is not None
                else policy.backoff_s(n, rng)
            )
        except VerifierError as exc:
            fault = exc
            if n > policy.retries:
                exc.attempts = n
                exc.args = (f"{exc.args[0] if exc.args else exc} (gave up after {n} attempts)",)
                raise
            delay = policy.backoff_s(n, rng)
            retry_after = exc.retry_after_s
            if retry_after is not None:
                delay = max(delay, retry_after)
        except ScoringError as exc:
            exc.attempts = n
            raise
        if on_retry is not None:
            on_retry(fault, n, delay)
        await sleep(delay)
