"""The gateway's one path into the pipeline: a request's samples in, their results out.

Every request is a batch of its own (``gw-<uuid>``): opened with the request's size,
pushed with ``RolloutProducer.push_many``, collected with ``RewardAggregator.collect``.
So whatever holds for a trainer's batch holds here unchanged: the global quota, the
retries, the scorer timeouts, the dead letters, any number of worker hosts. The
service knows nothing of HTTP; the route modules turn wire formats into ``Sample``
lists and ``Outcome`` back into replies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from stream_reward.config import BatchPolicy, ProducerConfig
from stream_reward.errors import (
    BadRequestError,
    CodecError,
    CollectTimeoutError,
    ConfigError,
    PayloadTooLargeError,
    RequestTimeoutError,
)
from stream_reward.gateway.metrics import GatewayMetrics
from stream_reward.trainer.aggregator import RewardAggregator
from stream_reward.trainer.producer import RolloutProducer
from stream_reward.wire.codec import encode_trajectory
from stream_reward.wire.trajectory import ScoreResult, Trajectory

__all__ = ["GatewayConfig", "Sample", "Outcome", "GatewayService"]

log = logging.getLogger(__name__)

# rm_scores are not used by any front door, but a batch declares a row width: one column.
_RESPONSE_LEN = 1
# How long a timed-out request's batch gets to be resolved and expired (see _give_up).
_GIVE_UP_S = 5.0


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """What every route shares. ``on_failure``: ``error`` answers 503 for a request with
    any failed sample; ``zero`` answers 0.0 for it and counts it in the reply."""

    redis_url: str
    producer: ProducerConfig = field(default_factory=ProducerConfig)
    data_source: str | None = None
    on_failure: Literal["error", "zero"] = "error"
    timeout_s: float = 100.0  # under OpenRLHF's 180 s and slime's 120 s client timeouts
    max_body_bytes: int = 64 * 1024 * 1024
    max_samples: int = 4096  # per request
    max_requests: int = 256  # scored at once; more wait their turn (bounded memory)
    # The scorer's numeric extra-info keys OpenRLHF's replies carry (openrlhf.py): declared,
    # since OpenRLHF needs the same keys in every reply of a step.
    extra_logs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.on_failure not in ("error", "zero"):
            raise ConfigError("gateway.on_failure", f"must be 'error' or 'zero', got {self.on_failure!r}")
        for name in ("timeout_s", "max_body_bytes", "max_samples", "max_requests"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"gateway.{name}", f"must be > 0, got {getattr(self, name)}")
        for key in self.extra_logs:
            # openrlhf.FAILURE_COLUMNS: a declared key of that name would overwrite the
            # failure marker with the scorer's value, hiding the failure.
            if key == "failed" or key.startswith("failed_"):
                raise ConfigError(
                    "gateway.extra_logs", f"{key!r} is the name of a failure column of the gateway's own; rename it"
                )

    @property
    def namespace(self) -> str:
        return self.producer.namespace


@dataclass(slots=True)
class Sample:
    """One sample as a front door read it, before it becomes a trajectory."""

    response: str
    ground_truth: Any = None
    prompt: str | None = None
    data_source: str | None = None
    extra_info: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Outcome:
    """A request's results in index order: each sample's score and status, the batch's
    ``reward_extra_info`` (a list per key, None where a sample lacks the key), and the
    results of the samples the pipeline could not score. Plain lists, as the aggregator
    holds them: no result object per sample on the path where all went well."""

    batch_id: str
    scores: list[float]
    status: list[str]
    extra_info: dict[str, list[Any]]
    failed: list[ScoreResult]

    @property
    def n(self) -> int:
        return len(self.status)

    def extra_of(self, index: int) -> dict[str, Any]:
        return {key: values[index] for key, values in self.extra_info.items() if values[index] is not None}

    def failed_rows(self) -> list[dict[str, Any]]:
        return [{"index": r.index, "uid": r.uid, "reason": r.reason, "error": r.error} for r in self.failed]


class GatewayService:
    """``async with GatewayService(config) as svc: outcome = await svc.score(samples, route="openrlhf")``."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or GatewayMetrics()
        self._producer: RolloutProducer | None = None
        self._aggregator: RewardAggregator | None = None
        self._slots: asyncio.Semaphore | None = None  # made on the loop (see STYLE: no loop in __init__)

    async def __aenter__(self) -> GatewayService:
        # One producer and one aggregator for every request: pushes of concurrent requests
        # share round trips (the producer's coalescer), and collects share the connection pool.
        self._producer = RolloutProducer(self.config.redis_url, self.config.producer)
        self._aggregator = RewardAggregator(
            self.config.redis_url, namespace=self.config.namespace, allow_eviction=self.config.producer.allow_eviction
        )
        self._slots = asyncio.Semaphore(self.config.max_requests)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        producer, self._producer = self._producer, None
        aggregator, self._aggregator = self._aggregator, None
        if producer is not None:
            await producer.aclose()
        if aggregator is not None:
            await aggregator.aclose()

    def data_source_of(self, sample: Sample, index: int) -> str:
        source = sample.data_source or self.config.data_source
        if not source:
            raise BadRequestError(
                f"sample {index}: no data_source; send one, or start the gateway with --data-source NAME"
            )
        return source

    def check_size(self, n: int) -> None:
        if n > self.config.max_samples:
            raise BadRequestError(
                f"{n} samples in one request, over the gateway's limit of {self.config.max_samples} (--max-samples)",
                status=413,
            )

    async def score(self, samples: list[Sample], *, route: str) -> Outcome:
        """Enqueue ``samples`` as one batch and wait for every result. Raises BadRequestError
        (nothing enqueued), RequestTimeoutError, or BrokerError when Redis fails."""
        if self._producer is None or self._aggregator is None or self._slots is None:
            raise RuntimeError("GatewayService used outside its async with")
        self.check_size(len(samples))
        batch_id = f"gw-{uuid.uuid4().hex}"
        # Checked whole before the first push: a request refused half way would leave a
        # batch that can never complete.
        trajs = [
            Trajectory(
                batch_id=batch_id,
                index=i,
                data_source=self.data_source_of(s, i),
                response=s.response,
                ground_truth=s.ground_truth,
                prompt=s.prompt,
                extra_info=s.extra_info,
            )
            for i, s in enumerate(samples)
        ]
        if not trajs:
            return Outcome(batch_id, [], [], {}, [])
        started = time.monotonic()
        try:
            async with self._slots:
                remaining = self.config.timeout_s - (time.monotonic() - started)
                if remaining <= 0:
                    raise RequestTimeoutError(batch_id, 0, len(trajs))
                try:
                    # The collect has its own bound; this one covers Redis calls that retry
                    # past it (a server that stopped answering), so no request ever hangs.
                    outcome = await asyncio.wait_for(self._run(batch_id, trajs, remaining), remaining + 1.0)
                except RequestTimeoutError:
                    raise  # its own count of what was done (a TimeoutError too, from 3.11 on asyncio's)
                except asyncio.TimeoutError:  # the outer bound: a Redis call that never returned
                    raise RequestTimeoutError(batch_id, 0, len(trajs), stalled=True) from None
        except RequestTimeoutError as exc:
            # No sample of it got a score: failed, so that /metrics' failure rate counts them.
            self.metrics.observe_unanswered(route, len(trajs), "redis_stalled" if exc.stalled else "request_timeout")
            raise
        self.metrics.observe_samples(route, outcome.n, outcome.failed)
        return outcome

    async def _run(self, batch_id: str, trajs: list[Trajectory], timeout_s: float) -> Outcome:
        assert self._producer is not None and self._aggregator is not None
        end = time.monotonic() + timeout_s
        # The batch's deadline is the request's: a sample still unscored by then resolves
        # as failed in Redis too, so nothing of a given-up request stays open.
        policy = BatchPolicy(on_failure="mask", deadline_s=timeout_s)
        await self._producer.open_batch(batch_id, len(trajs), _RESPONSE_LEN, policy=policy)
        try:
            # push_many encodes every sample before it sends any: a refusal queues none.
            await self._producer.push_many(trajs)
        except CodecError as exc:
            await self._give_up(batch_id)
            raise _refusal(trajs, exc, self.config.producer.max_message_bytes) from None
        try:
            rewards = await self._aggregator.collect(batch_id, timeout_s=max(0.001, end - time.monotonic()))
        except CollectTimeoutError as exc:
            await self._give_up(batch_id)
            raise RequestTimeoutError(batch_id, exc.done, exc.size) from None
        failed = (
            [r for r in rewards.results if r is not None and r.status != "ok"] if "failed" in rewards.status else []
        )
        # A sample the batch deadline resolved is a timeout of this request, not a verdict.
        missed = sum(1 for r in failed if r.reason in ("deadline", "never_pushed"))
        if missed:
            raise RequestTimeoutError(batch_id, rewards.n - missed, rewards.n)
        return Outcome(batch_id, rewards.scores, rewards.status, rewards.reward_extra_info, failed)

    async def _give_up(self, batch_id: str) -> None:
        """Resolve what is missing and expire the batch's keys, bounded: a failure here
        must not hide the timeout the caller is about to get."""
        assert self._aggregator is not None
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                self._aggregator.collect(batch_id, timeout_s=0.001, on_timeout="resolve"), _GIVE_UP_S
            )


def _refusal(trajs: list[Trajectory], exc: CodecError, max_bytes: int) -> BadRequestError:
    """The request's refusal for a sample the stream cannot carry (JSON that parsed but
    that msgpack cannot hold: a lone surrogate, an integer past 64 bits, a sample over
    the message limit), naming the first such sample: encoding again only on this path
    keeps the good path at one encoding a sample."""
    for traj in trajs:
        try:
            encode_trajectory(traj, max_bytes)
        except CodecError as bad:
            status = 413 if isinstance(bad, PayloadTooLargeError) else 400
            return BadRequestError(f"sample {traj.index}: cannot be queued: {bad}", status=status)
    return BadRequestError(f"a sample cannot be queued: {exc}")
