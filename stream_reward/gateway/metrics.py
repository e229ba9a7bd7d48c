"""The gateway's Prometheus metrics (``GET /metrics``), named like the worker's
(``stream_reward_<what>_total``, seconds, the worker's latency buckets).

Per route: requests by HTTP code, samples by status, failed samples by reason, and the
request latency. The pipeline's own state (lag, workers, dead letters) is the workers'
``--metrics-port``: this endpoint counts what the gateway itself saw.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from stream_reward.wire.trajectory import ScoreResult
from stream_reward.worker.metrics import LATENCY_BUCKETS

__all__ = ["GatewayMetrics", "CONTENT_TYPE_LATEST"]


class GatewayMetrics:
    """One registry per gateway (tests run several in one process)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "stream_reward_gateway_requests",
            "requests answered, by route and HTTP status code",
            ("route", "code"),
            registry=self.registry,
        )
        self.samples = Counter(
            "stream_reward_gateway_samples",
            "samples scored through the gateway, by route and status (ok, failed)",
            ("route", "status"),
            registry=self.registry,
        )
        self.failures = Counter(
            "stream_reward_gateway_failures",
            "failed samples by route and reason (a verifier down, a timeout, ...)",
            ("route", "reason"),
            registry=self.registry,
        )
        self.latency = Histogram(
            "stream_reward_gateway_request_seconds",
            "time from a request's arrival to its answer, by route",
            ("route",),
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "stream_reward_gateway_requests_in_flight", "requests being answered now", registry=self.registry
        )

    def observe_samples(self, route: str, n: int, failed: Iterable[ScoreResult]) -> None:
        """``n`` samples answered, of which ``failed`` the pipeline could not score."""
        count = 0
        for result in failed:
            count += 1
            self.failures.labels(route, result.reason or "unknown").inc()
        if n > count:
            self.samples.labels(route, "ok").inc(n - count)
        if count:
            self.samples.labels(route, "failed").inc(count)

    def observe_unanswered(self, route: str, n: int, reason: str) -> None:
        """``n`` samples of a request that got no scores (a 504): failed, for ``reason``."""
        self.failures.labels(route, reason).inc(n)
        self.samples.labels(route, "failed").inc(n)

    def observe_request(self, route: str, code: int, seconds: float) -> None:
        self.requests.labels(route, str(code)).inc()
        self.latency.labels(route).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
