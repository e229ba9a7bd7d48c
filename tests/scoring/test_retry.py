"""The retry policy every remote scorer shares: ``Retry-After`` in its three forms
(clamped), HTTP statuses and transport errors mapped onto the failure taxonomy
(429 -> ``RetryLater``, 5xx and 408 -> ``VerifierError``, other 4xx ->
``BadReplyError``), jittered capped backoff, and ``call_with_retry``'s budget: data
faults are not retried, a 429 calls the pause hook, and a bug propagates."""

from __future__ import annotations

import pytest

from stream_reward.errors import BadReplyError, RetryLater, ScoringError, VerifierError
from stream_reward.scoring.retry import RetryPolicy, call_with_retry, parse_retry_after, status_error, transport_error

pytestmark = pytest.mark.anyio


def test_retry_after_is_read_from_seconds_ms_or_a_date_and_capped() -> None:
    assert parse_retry_after({"retry-after-ms": "250"}) == 0.25
    assert parse_retry_after({"Retry-After": "3"}) == 3.0
    assert parse_retry_after({"Retry-After": "Wed, 21 Oct 2015 07:28:10 GMT"}, now=1445412480.0) == 10.0
    assert parse_retry_after({"Retry-After": "soon"}) is None
    assert parse_retry_after({}) is None
    assert parse_retry_after({"Retry-After": "1e9"}) == 300.0


def test_status_and_transport_errors_map_to_the_taxonomy() -> None:
    rate = status_error(429, {"Retry-After": "2"})
    assert isinstance(rate, RetryLater) and rate.rate_limited and rate.retry_after_s == 2.0
    assert isinstance(status_error(503, {}), VerifierError)
    assert isinstance(status_error(408, {}), VerifierError)
    bad = status_error(422, {}, b'{"error": "no"}')
    assert isinstance(bad, BadReplyError) and bad.reason == "http_422" and "no" in str(bad)
    assert transport_error(TimeoutError()).reason == "timeout"
    assert transport_error(ConnectionRefusedError()).reason == "connect"
    assert transport_error(ConnectionResetError()).reason == "reset"
    assert transport_error(ValueError()) is None


def test_backoff_is_jittered_and_capped() -> None:
    policy = RetryPolicy(retries=3, backoff_base_s=0.1, backoff_max_s=0.5)
    for n, ceiling in ((1, 0.1), (2, 0.2), (3, 0.4), (8, 0.5)):
        delays = [policy.backoff_s(n) for _ in range(50)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays)
        assert len(set(delays)) > 1


async def test_call_with_retry_budget_and_hooks() -> None:
    slept: list[float] = []
    paused: list[float | None] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    async def pause(s: float | None) -> None:
        paused.append(s)

    async def always_429(n: int) -> None:
        raise status_error(429, {"retry-after-ms": "1500"})

    with pytest.raises(VerifierError) as info:
        await call_with_retry(always_429, RetryPolicy(retries=2), on_rate_limited=pause, sleep=sleep)
    assert (info.value.reason, info.value.attempts) == ("http_429", 3)
    assert paused == [1.5, 1.5, 1.5] and len(slept) == 2 and all(1.5 <= s <= 1.65 for s in slept)

    calls = []

    async def bad_then(n: int) -> None:
        calls.append(n)
        raise BadReplyError("nope")

    with pytest.raises(BadReplyError) as bad:
        await call_with_retry(bad_then, RetryPolicy(retries=5), sleep=sleep)
    assert calls == [1] and bad.value.attempts == 1

    async def flaky(n: int) -> str:
        if n < 3:
            raise VerifierError("down", reason="http_502")
        return "ok"

    assert await call_with_retry(flaky, RetryPolicy(retries=5), sleep=sleep) == "ok"

    async def crash(n: int) -> None:
        raise KeyError("bug")

    with pytest.raises(KeyError):
        await call_with_retry(crash, RetryPolicy(retries=5), sleep=sleep)
    assert issubclass(VerifierError, ScoringError)
