"""Prometheus metrics of one worker process (``stream-reward worker --metrics-port``).

Three sources, each read the cheapest way:

* per-sample events come through the worker's hooks (``on_scored``,
  ``on_dead_letter``): counters by status / data source / reason and latency
  histograms, updated on the event loop as samples settle;
* counters the worker and its scorer already keep (``worker.stats``,
  ``scorer.stats``: in flight, reclaimed, verifier requests, retries, 429s, quota
  waits) are read at scrape time by a custom collector, so scoring pays nothing;
* namespace-wide state (stream length; per group and partition the lag in entries
  and in samples (wire/lag.py) and the pending entries; dead-letter stream length,
  live workers, open batches) is read from Redis every
  ``metrics_refresh_s`` by a task on the worker's loop, with its own connection.
  Every worker reports these same series: aggregate them with ``max``, not ``sum``.

With ``--processes N`` each worker process serves its own endpoint on
``port + i`` (i = 0..N-1); the supervisor serves none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from stream_reward.wire.connection import REDIS_ERRORS, connect, mask_url
from stream_reward.wire.heartbeat import parse_heartbeats, server_time
from stream_reward.wire.keys import Keys
from stream_reward.wire.lag import read_group_lags
from stream_reward.wire.trajectory import ScoreResult

__all__ = ["WorkerMetrics", "LATENCY_BUCKETS"]

log = logging.getLogger(__name__)

# Rule scorers take microseconds, remote verifiers and sandboxes seconds to minutes.
LATENCY_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

# A scorer's ``stats`` keys with a metric of their own; other numeric keys go to
# ``stream_reward_verifier_events_total{event=...}``. Every ``stats`` value is a running
# count, so all of them are counters (exposed with ``_total``).
_VERIFIER_COUNTERS = {
    "requests": ("stream_reward_verifier_requests", "requests sent to the verifier"),
    "retries": ("stream_reward_verifier_retries", "retried verifier requests (infrastructure faults)"),
    "http_429": ("stream_reward_verifier_http_429", "429 Too Many Requests replies from the verifier"),
    "quota_wait_s": ("stream_reward_verifier_quota_wait_seconds", "seconds spent waiting for the shared quota"),
    "tokens": ("stream_reward_verifier_tokens", "tokens charged to the verifier's quota (reported, else estimated)"),
}
_WRAPPED = ("inner", "scorer", "_inner", "_scorer")  # where a manager keeps the scorer it wraps
OTHER = "other"


class WorkerMetrics:
    """The hooks object and Prometheus collector of one worker. ``Worker(..., hooks=metrics)``."""

    def __init__(
        self,
        *,
        namespace: str,
        group: str,
        consumer: str,
        scorer: str = "",
        manager: str = "",
        verifier: str | None = None,
        registry: CollectorRegistry | None = None,
        max_data_sources: int = 64,
        heartbeat_interval_s: float = 2.0,
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self.namespace, self.group, self.consumer = namespace, group, consumer
        self.scorer, self.manager = mask_url(scorer), manager  # a spec may be a URL with credentials
        self.verifier = verifier or self.scorer or "scorer"
        self.heartbeat_interval_s = heartbeat_interval_s
        self._max_data_sources = max_data_sources
        self._data_sources: set[str] = set()
        self._worker: Any = None
        self._started = time.time()
        self._snapshot: dict[str, Any] = {}
        self._server: Any = None
        self.trajectories = Counter(
            "stream_reward_trajectories",
            "settled trajectories by status and data source",
            ["status", "data_source"],
            registry=self.registry,
        )
        self.failures = Counter(
            "stream_reward_failures", "failed trajectories by reason", ["reason"], registry=self.registry
        )
        self.latency = Histogram(
            "stream_reward_scoring_latency_seconds",
            "scoring time of one trajectory",
            ["scorer", "data_source"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.dead_letters = Counter(
            "stream_reward_dead_letters",
            "entries sent to the dead-letter stream by reason",
            ["reason"],
            registry=self.registry,
        )
        self.registry.register(_Collector(self))

    # ------------------------------------------------------------------ hooks (event loop)
    def _source(self, data_source: str | None) -> str:
        # A label per distinct value is a time series per value: cap what bad input can create.
        source = data_source or "unknown"
        if source in self._data_sources:
            return source
        if len(self._data_sources) >= self._max_data_sources:
            return OTHER
        self._data_sources.add(source)
        return source

    def on_scored(self, result: ScoreResult, latency_s: float) -> None:
        source = self._source(result.data_source)
        self.trajectories.labels(result.status, source).inc()
        if result.status != "ok":
            self.failures.labels(result.reason or "unknown").inc()
        self.latency.labels(self.scorer, source).observe(latency_s)

    def on_dead_letter(self, reason: str) -> None:
        self.dead_letters.labels(reason or "unknown").inc()

    def bind(self, worker: Any) -> None:
        """Read ``worker.stats`` and ``worker.scorer.stats`` at scrape time."""
        self._worker = worker

    # ------------------------------------------------------------------ endpoint
    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Start the HTTP endpoint (a daemon thread); returns the bound port."""
        self._server, _ = start_http_server(port, addr, registry=self.registry)
        return int(self._server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # ------------------------------------------------------------------ Redis state
    async def refresh(self, client: Any, keys: Keys) -> None:
        """Read the namespace-wide gauges once; the collector serves the latest reading."""
        snap: dict[str, Any] = {"streams": [], "dlq": [], "at": time.time()}
        lags = await read_group_lags(client, keys)
        for p, stream in enumerate(keys.streams()):
            length = int(await client.xlen(stream))
            snap["streams"].append((stream, p, length, [g for g in lags if g.partition == p]))
        for p in range(keys.partitions):
            snap["dlq"].append((keys.dead_letters(p), int(await client.xlen(keys.dead_letters(p)))))
        beats = parse_heartbeats(
            await client.hgetall(keys.workers()), interval_s=self.heartbeat_interval_s, now=await server_time(client)
        )
        snap["workers_alive"] = sum(beat["alive"] for beat in beats.values())
        snap["open_batches"] = int(await client.zcard(keys.batches()))
        self._snapshot = snap  # one assignment: the scrape thread sees the old or the new reading

    async def refresh_forever(self, redis_url: str, keys: Keys, interval_s: float, stop: asyncio.Event) -> None:
        """Refresh until ``stop`` is set. Stopped by an event, not by cancellation:
        a cancel that lands inside a redis-py command can be swallowed (Python 3.11's
        wait_for), and a swallowed cancel here would keep the worker from exiting."""
        client = connect(redis_url)
        try:
            while not stop.is_set():
                try:
                    await self.refresh(client, keys)
                except REDIS_ERRORS as exc:
                    log.debug("metrics refresh skipped: %s", type(exc).__name__)
                    self._snapshot = {**self._snapshot, "failed_at": time.time()}
                with contextlib.suppress(asyncio.TimeoutError):  # not yet TimeoutError on 3.10
                    await asyncio.wait_for(stop.wait(), interval_s)
        finally:
            await client.aclose()

    # ------------------------------------------------------------------ scrape (HTTP thread)
    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "stream_reward_worker_info",
            "this worker process",
            labels=["namespace", "group", "consumer", "manager", "scorer"],
        )
        info.add_metric([self.namespace, self.group, self.consumer, self.manager, self.scorer], 1)
        yield info
        yield GaugeMetricFamily(
            "stream_reward_worker_start_time_seconds", "when this worker started (unix time)", value=self._started
        )
        worker = self._worker
        if worker is not None:
            stats = worker.stats
            yield GaugeMetricFamily(
                "stream_reward_in_flight", "trajectories read but not yet settled", value=stats.in_flight
            )
            yield CounterMetricFamily(
                "stream_reward_reclaimed", "entries reclaimed from dead or slow consumers", value=stats.reclaimed
            )
            yield CounterMetricFamily(
                "stream_reward_duplicates",
                "results not written because another worker's came first",
                value=stats.duplicates,
            )
            yield from self._verifier_metrics(worker.scorer)
        yield from self._redis_metrics()

    def _verifier_metrics(self, scorer: Any) -> Iterator[Metric]:
        rows = list(_scorer_stats(scorer, self.verifier))
        if not rows:
            return
        families = {
            key: CounterMetricFamily(name, doc, labels=["verifier"]) for key, (name, doc) in _VERIFIER_COUNTERS.items()
        }
        failures = CounterMetricFamily(
            "stream_reward_verifier_failures",
            "verifier failures by reason (after retries)",
            labels=["verifier", "reason"],
        )
        other = CounterMetricFamily(
            "stream_reward_verifier_events", "other counts a scorer reports, by event", labels=["verifier", "event"]
        )
        for verifier, stats in rows:
            for key, value in stats.items():
                if key in families and _number(value):
                    families[key].add_metric([verifier], float(value))
                elif _number(value):
                    other.add_metric([verifier, str(key)], float(value))
                elif isinstance(value, Mapping):  # a breakdown, e.g. failures_by_reason
                    for sub, count in value.items():
                        if not _number(count):
                            continue
                        if key == "failures_by_reason":
                            failures.add_metric([verifier, str(sub)], float(count))
                        else:
                            other.add_metric([verifier, f"{key}.{sub}"], float(count))
        for family in (*families.values(), failures, other):
            if family.samples:
                yield family

    def _redis_metrics(self) -> Iterator[Metric]:
        snap = self._snapshot
        if not snap:
            return
        up = GaugeMetricFamily("stream_reward_redis_up", "1 if the last metrics read of Redis succeeded")
        up.add_metric([], 0.0 if snap.get("failed_at", 0) > snap.get("at", 0) else 1.0)
        yield up
        yield GaugeMetricFamily(
            "stream_reward_redis_read_timestamp_seconds", "when the stream gauges were read", value=snap["at"]
        )
        length = GaugeMetricFamily("stream_reward_stream_length", "entries in the trajectory stream", labels=["stream"])
        by_group = ["stream", "group"]
        lag = GaugeMetricFamily("stream_reward_group_lag", "entries not yet delivered to the group", labels=by_group)
        # The same lag in samples (an entry holds up to samples_per_entry), by partition too:
        # what an HPA on Prometheus should scale on. ``_exact`` 0: the samples are an estimate.
        by_partition = ["stream", "partition", "group"]
        lag_samples = GaugeMetricFamily(
            "stream_reward_group_lag_samples", "samples not yet delivered to the group", labels=by_partition
        )
        lag_exact = GaugeMetricFamily(
            "stream_reward_group_lag_samples_exact",
            "1 if the lag in samples is exact (read from the entries' stamps), 0 if estimated",
            labels=by_partition,
        )
        pending = GaugeMetricFamily("stream_reward_group_pending", "entries delivered but not acked", labels=by_group)
        consumers = GaugeMetricFamily(
            "stream_reward_group_consumers", "consumers registered in the group", labels=by_group
        )
        for stream, p, n, groups in snap["streams"]:
            length.add_metric([stream], n)
            for g in groups:
                pending.add_metric([stream, g.group], g.pending_entries)
                consumers.add_metric([stream, g.group], g.consumers)
                if g.lag_entries is not None:
                    lag.add_metric([stream, g.group], g.lag_entries)
                lag_samples.add_metric([stream, str(p), g.group], g.lag_samples)
                lag_exact.add_metric([stream, str(p), g.group], 1.0 if g.exact else 0.0)
        yield from (length, lag, lag_samples, lag_exact, pending, consumers)
        dlq = GaugeMetricFamily(
            "stream_reward_dead_letter_stream_length", "entries in the dead-letter stream", labels=["stream"]
        )
        for stream, n in snap["dlq"]:
            dlq.add_metric([stream], n)
        yield dlq
        yield GaugeMetricFamily(
            "stream_reward_workers_alive",
            "workers of the namespace with a fresh heartbeat",
            value=snap["workers_alive"],
        )
        yield GaugeMetricFamily(
            "stream_reward_open_batches", "batches opened and not yet collected", value=snap["open_batches"]
        )


class _Collector:
    def __init__(self, metrics: WorkerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return self._metrics.collect()


def _scorer_stats(scorer: Any, default_name: str, depth: int = 0) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(verifier name, its ``stats`` mapping) for the scorer and the scorers it wraps.

    A scorer names itself with ``name``; otherwise the quota key or scorer spec is used.
    """
    if scorer is None or depth > 3:
        return
    stats = getattr(scorer, "stats", None)
    if stats is not None and not isinstance(stats, Mapping) and hasattr(stats, "as_dict"):
        stats = stats.as_dict()
    if isinstance(stats, Mapping) and stats:
        yield str(getattr(scorer, "name", None) or default_name), stats
    for attr in _WRAPPED:
        inner = getattr(scorer, attr, None)
        if inner is not None and inner is not scorer:
            yield from _scorer_stats(inner, default_name, depth + 1)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _s(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
