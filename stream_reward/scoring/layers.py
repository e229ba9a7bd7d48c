"""The layers a manager puts around a scorer: shape its score or limit its calls.

Each layer is itself a Scorer, so a manager is a stack of them (``managers``
builds the named stacks):

=====================  =======================================================
``PrecomputedScore``   a sample's ``rm_score`` is its task score; no call
``OverlongShaping``    DAPO's overlong penalty (``OverlongConfig``) and ``acc``
``MicroBatchScorer``   samples gathered into one batched call
``RateLimitedScorer``  a lease of the global Redis quota per attempt, retries
=====================  =======================================================
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from stream_reward.config import ManagerConfig, OverlongConfig, QuotaConfig
from stream_reward.errors import BadReplyError, ConfigError, ScoringError
from stream_reward.scoring.quota import QuotaLimiter
from stream_reward.scoring.retry import RetryPolicy, call_with_retry
from stream_reward.scoring.scorer import Scored, Scorer
from stream_reward.wire.trajectory import Trajectory

__all__ = [
    "PrecomputedScore",
    "OverlongConfig",
    "overlong_penalty",
    "OverlongShaping",
    "BatchCall",
    "MicroBatchScorer",
    "RateLimitedScorer",
]


class _Wrapper:
    """Forwards ``inline`` and ``aclose`` to the scorer it wraps."""

    def __init__(self, inner: Scorer) -> None:
        self.inner = inner
        self.inline = bool(getattr(inner, "inline", False))

    async def aclose(self) -> None:
        close = getattr(self.inner, "aclose", None)
        if close is not None:
            await close()


class PrecomputedScore(_Wrapper):
    """A sample that carries ``rm_score`` is not scored again: that is its task score."""

    async def score(self, traj: Trajectory) -> Scored:
        if traj.rm_score is not None:
            return Scored(float(traj.rm_score))
        return await self.inner.score(traj)


def overlong_penalty(valid_response_length: int, max_resp_len: int, buffer_len: int, penalty_factor: float) -> float:
    """DAPO's soft overlong punishment: 0 up to ``max_resp_len - buffer_len`` tokens,
    then linear down to ``-penalty_factor`` at ``max_resp_len`` (and further past it,
    as verl does). A plain float, never -0.0."""
    expected = max_resp_len - buffer_len
    exceed = valid_response_length - expected
    return min(-exceed / buffer_len * penalty_factor, 0.0) + 0.0


class OverlongShaping(_Wrapper):
    """``dapo``: the task score plus the overlong penalty, computed on the worker.

    Like verl's DAPORewardManager, a scorer's bare-number result is also logged
    as ``acc``; ``overlong_reward`` and ``overlong`` (the penalty was applied)
    are logged when ``log`` is on.
    """

    def __init__(self, inner: Scorer, overlong: OverlongConfig, max_resp_len: int | None) -> None:
        super().__init__(inner)
        self.overlong = overlong
        self.max_resp_len = max_resp_len

    def _limits(self, traj: Trajectory) -> tuple[int, int]:
        length = traj.response_length
        if length is None:
            raise ScoringError(
                "dapo needs the response length: set valid_response_length or response_ids", reason="no_response_length"
            )
        max_len = self.max_resp_len if self.max_resp_len is not None else traj.max_response_length
        if max_len is None:
            raise ScoringError(
                "dapo needs max_resp_len (manager option) or the trajectory's max_response_length", reason="config"
            )
        if max_len < self.overlong.len:
            raise ScoringError(
                f"max_response_length {max_len} is shorter than overlong_buffer_cfg.len {self.overlong.len}",
                reason="config",
            )
        return length, max_len

    async def score(self, traj: Trajectory) -> Scored:
        limits = self._limits(traj) if self.overlong.enable else None
        scored = await self.inner.score(traj)
        extra = dict(scored.extra)
        if not extra:
            extra["acc"] = scored.score
        reward = scored.score
        if limits is not None:
            penalty = overlong_penalty(limits[0], limits[1], self.overlong.len, self.overlong.penalty_factor)
            reward += penalty
            if self.overlong.log:
                extra["overlong_reward"] = penalty
                extra["overlong"] = penalty < 0
        return Scored(reward, extra)


BatchCall = Callable[[list[Trajectory]], Awaitable[list["Scored | ScoringError"]]]


class MicroBatchScorer:
    """``batch``: ``score(traj)`` parks the sample until ``batch_size`` samples are
    waiting or ``batch_wait_s`` has passed since the first, then one batched call
    scores them all. The worker calls ``score`` concurrently (not inline)."""

    inline = False

    def __init__(
        self,
        call: BatchCall,
        *,
        batch_size: int,
        batch_wait_s: float,
        close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        if batch_size < 1:
            raise ConfigError("batch_size", f"must be >= 1, got {batch_size}")
        if batch_wait_s < 0:
            raise ConfigError("batch_wait_ms", f"must be >= 0, got {batch_wait_s * 1000:g}")
        self._call = call
        self._close = close
        self.batch_size = batch_size
        self.batch_wait_s = batch_wait_s
        self.calls = 0
        self._waiting: list[tuple[Trajectory, asyncio.Future[Scored]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def score(self, traj: Trajectory) -> Scored:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Scored] = loop.create_future()
        self._waiting.append((traj, future))
        if len(self._waiting) >= self.batch_size:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.batch_wait_s, self._flush)
        return await future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiting, self._waiting = self._waiting, []
        if waiting:
            task = asyncio.get_running_loop().create_task(self._run(waiting))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, waiting: list[tuple[Trajectory, asyncio.Future[Scored]]]) -> None:
        self.calls += 1
        try:
            results = await self._call([traj for traj, _ in waiting])
            if len(results) != len(waiting):
                raise BadReplyError(f"batched scorer returned {len(results)} results for {len(waiting)} samples")
        except Exception as exc:  # the whole call failed: every sample in it fails with the reason
            for _, future in waiting:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, future), result in zip(waiting, results):
            if future.done():  # cancelled while waiting (worker shutdown)
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._close is not None:
            await self._close()


class RateLimitedScorer(_Wrapper):
    """``rate_limited``: every attempt holds a lease of the global quota (RPM, TPM,
    in flight) for its duration; the tokens a verifier reports settle TPM.
    Infrastructure faults (``VerifierError``, ``RetryLater``) are retried with
    backoff up to ``retries`` times, each attempt under a fresh lease; a 429
    (``RetryLater(rate_limited=True)``) pauses the quota for every worker. The
    limiter is created on first use, inside the worker's loop."""

    def __init__(self, inner: Scorer, config: ManagerConfig) -> None:
        super().__init__(inner)
        self.inline = False
        self.config = config
        self.policy = RetryPolicy(retries=config.retries)
        self.limiter: Any = None

    def _get_limiter(self) -> Any:
        if self.limiter is None:
            c = self.config
            if not c.redis_url:
                raise ConfigError("redis_url", "rate_limited keeps its quota in Redis and needs the worker's Redis URL")
            self.limiter = QuotaLimiter(
                c.redis_url,
                QuotaConfig(
                    name=c.quota_key or c.scorer,
                    max_rpm=c.max_rpm,
                    max_tpm=c.max_tpm,
                    max_concurrent=c.max_concurrent,
                    estimated_tokens_per_request=c.estimated_tokens_per_request,
                    lease_ttl_s=max(60.0, 2 * c.timeout),
                ),
                namespace=c.namespace,
            )
        return self.limiter

    async def score(self, traj: Trajectory) -> Scored:
        limiter = self._get_limiter()

        async def attempt(n: int) -> Scored:
            async with limiter.lease() as lease:
                scored = await self.inner.score(traj)
                used = _tokens_used(scored.extra)
                if used is not None:
                    lease.settle(used)
                # attempts of this layer times the inner scorer's own (it may retry too)
                scored.attempts = (n - 1) + scored.attempts
                return scored

        async def pause_everyone(retry_after_s: float | None) -> None:
            await limiter.block_for(retry_after_s if retry_after_s is not None else self.policy.backoff_s(1))

        return await call_with_retry(attempt, self.policy, on_rate_limited=pause_everyone)

    async def aclose(self) -> None:
        if self.limiter is not None:
            await self.limiter.aclose()
            self.limiter = None
        await super().aclose()


def _tokens_used(extra: Mapping[str, Any]) -> int | None:
    """Tokens a verifier reported (``total_tokens``, or OpenAI's ``usage.total_tokens``)."""
    value = extra.get("total_tokens")
    usage = extra.get("usage")
    if value is None and isinstance(usage, Mapping):
        value = usage.get("total_tokens")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return int(value)
    return None
