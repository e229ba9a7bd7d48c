"""The one error tree of stream-reward.

Everything the library raises on purpose derives from ``StreamRewardError``;
errors of dependencies (redis-py, aiohttp, msgpack) are translated once, at the
boundary where they happen, with ``raise ... from exc``::

    StreamRewardError
    ├── ConfigError                 invalid configuration, names the key
    ├── BadCallError                a front door called with arguments it cannot use (TRL columns)
    ├── CodecError                  a payload that cannot be decoded
    │   ├── SchemaVersionError      written by another protocol version
    │   ├── BadInputError           decodes, but a field cannot be scored (e.g. a null response)
    │   └── PayloadTooLargeError    over the configured maximum message size
    ├── ScoringError                one sample could not be scored (status `failed`)
    │   ├── UnknownDataSourceError  no scorer for the sample's data_source
    │   ├── ScorerTimeoutError      the scorer ran past its timeout and was killed
    │   ├── ScorerCrashedError      the scorer process died
    │   ├── VerifierError           a remote verifier's fault (infrastructure)
    │   └── BadReplyError           a verifier replied, but not with a score (data)
    ├── RetryLater                  control flow: a verifier asked us to come back
    ├── BackpressureError           the stream is too far ahead of the consumers
    ├── CollectTimeoutError         a batch did not complete in time
    │   └── RequestTimeoutError     a gateway request's batch did not (HTTP 504)
    ├── ResultTimeoutError          one sample's result did not land in time
    ├── PushConflictError           an index or uid already pushed with other content
    ├── BatchExistsError            a batch id reused while its results live
    ├── ProtocolMismatchError       the namespace speaks another protocol version
    ├── WorkersDiedError            a local pipeline's worker processes all exited
    ├── MissingExtraError           a feature needs an extra that is not installed ([trainer])
    ├── BadRequestError             a gateway request refused before anything was enqueued (HTTP 400/413)
    └── BrokerError                 Redis is unreachable or refused a command
        ├── StateLostError          the namespace's state vanished (restart without persistence)
        ├── RedisUnavailableError   no round trip to Redis completed within the liveness deadline
        └── EvictionPolicyError     Redis may evict keys (maxmemory-policy other than noeviction)

``ScoringError.reason`` is a short stable code ("unknown_data_source", "timeout",
...) that lands in the sample's result record, so dashboards can group failures
without parsing messages.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "StreamRewardError",
    "ConfigError",
    "BadCallError",
    "CodecError",
    "SchemaVersionError",
    "BadInputError",
    "PayloadTooLargeError",
    "ScoringError",
    "UnknownDataSourceError",
    "ScorerTimeoutError",
    "ScorerCrashedError",
    "VerifierError",
    "BadReplyError",
    "RetryLater",
    "BackpressureError",
    "CollectTimeoutError",
    "RequestTimeoutError",
    "ResultTimeoutError",
    "PushConflictError",
    "BrokerError",
    "EvictionPolicyError",
    "RedisUnavailableError",
    "BatchExistsError",
    "ProtocolMismatchError",
    "StateLostError",
    "WorkersDiedError",
    "MissingExtraError",
    "BadRequestError",
    "ConfigDeprecationWarning",
]


class StreamRewardError(Exception):
    """Base of every error stream-reward raises on purpose."""


class ConfigError(StreamRewardError, ValueError):
    """A configuration value is invalid. The message names the key and the reason."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"config {key!r}: {reason}")
        self.key = key
        self.reason = reason


class BadCallError(StreamRewardError, ValueError):
    """A front door (the TRL reward function) was called with arguments it cannot use:
    columns of the wrong length, a completion of an unknown shape. The message names
    the argument or column; nothing was enqueued."""


class CodecError(StreamRewardError, ValueError):
    """A message could not be decoded into a trajectory or result."""

    reason = "malformed"


class SchemaVersionError(CodecError):
    reason = "schema_version"


class BadInputError(CodecError):
    """The record decodes, but a field the scorer needs is missing or of the wrong
    type (a null ``response``): the sample fails with reason ``bad_input``."""

    reason = "bad_input"


class PayloadTooLargeError(CodecError):
    reason = "too_large"


class ScoringError(StreamRewardError):
    """One sample could not be scored; it is recorded as `failed` with `reason`.

    ``extra`` is what is known of the sample all the same (a composite's per-component
    columns): the failed result carries it, so its columns match the other samples'.
    """

    reason = "scorer_error"

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        attempts: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason
        self.attempts = attempts
        self.extra: dict[str, Any] = dict(extra) if extra else {}


class UnknownDataSourceError(ScoringError):
    reason = "unknown_data_source"


class ScorerTimeoutError(ScoringError):
    reason = "timeout"


class ScorerCrashedError(ScoringError):
    reason = "scorer_crashed"


class VerifierError(ScoringError):
    """Infrastructure fault of a remote verifier (connect error, 5xx, 429, timeout).

    ``retry_after_s`` is the server's ``Retry-After`` when it sent one (a 503 may).
    """

    reason = "verifier_unavailable"

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        attempts: int | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message, reason=reason, attempts=attempts)
        self.retry_after_s = retry_after_s


class BadReplyError(ScoringError):
    """The verifier answered, but the answer holds no usable score (a data fault)."""

    reason = "bad_reply"


class RetryLater(StreamRewardError):
    """Raised by a verifier to ask for another attempt after ``retry_after_s``.

    Not a failure: the retry loop catches it, honours the delay (and shares it
    with every worker when it came from a 429), and tries again.
    """

    def __init__(
        self,
        message: str = "retry later",
        *,
        retry_after_s: float | None = None,
        rate_limited: bool = False,
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.rate_limited = rate_limited
        # The code a spent budget reports.
        self.reason = reason or ("http_429" if rate_limited else "retry_later")


class BackpressureError(StreamRewardError):
    """The producer is too far ahead of the consumers and was told not to wait."""


class CollectTimeoutError(StreamRewardError, TimeoutError):
    """A batch did not complete before the collect timeout."""

    def __init__(self, batch_id: str, done: int, size: int) -> None:
        super().__init__(f"batch {batch_id!r}: {done} of {size} samples resolved before the timeout")
        self.batch_id = batch_id
        self.done = done
        self.size = size


class RequestTimeoutError(CollectTimeoutError):
    """A gateway request's samples were not all scored within its timeout (HTTP 504).
    ``stalled``: Redis stopped answering, so how far the batch got is unknown."""

    def __init__(self, batch_id: str, done: int, size: int, *, stalled: bool = False) -> None:
        super().__init__(batch_id, done, size)
        self.stalled = stalled


class ResultTimeoutError(StreamRewardError, TimeoutError):
    """One sample's result did not land before the timeout (``score`` / ``result``)."""

    def __init__(self, batch_id: str, uid: str, timeout_s: float) -> None:
        super().__init__(f"batch {batch_id!r}: no result for uid {uid!r} within {timeout_s:g}s")
        self.batch_id = batch_id
        self.uid = uid
        self.timeout_s = timeout_s


class PushConflictError(StreamRewardError, ValueError):
    """A push that contradicts one already in the batch: its index is taken by another
    uid, or its uid was pushed at another index or with other content. Checked in
    Redis, so it holds across producers; nothing of the refused push was queued."""

    def __init__(self, batch_id: str, index: int, uid: str, reason: str) -> None:
        super().__init__(f"batch {batch_id!r}: push of uid {uid!r} at index {index} refused: {reason}")
        self.batch_id = batch_id
        self.index = index
        self.uid = uid
        self.reason = reason


class BrokerError(StreamRewardError):
    """Redis could not be reached, or refused a command. Credentials are never in the message."""


class BatchExistsError(StreamRewardError, ValueError):
    """``open_batch`` of an id whose batch still lives in the namespace.

    A batch id is unique while its results live: reopening it would hand the
    trainer the previous batch's rewards. ``resume=True`` continues a batch
    opened with the same size, width and policy (a restarted producer).
    """

    def __init__(self, batch_id: str, message: str) -> None:
        super().__init__(message)
        self.batch_id = batch_id


class ProtocolMismatchError(StreamRewardError):
    """The namespace was set up by a build speaking another protocol version;
    joining it would poison its batches with records the others cannot read."""


class StateLostError(BrokerError):
    """State the pipeline wrote is gone: the namespace's epoch vanished (Redis restarted
    without persistence, was flushed, or failed over to an empty replica), or a key of
    a batch did (deleted, evicted, or lost in a failover to a replica that lagged;
    ``key`` names it). Queued trajectories and stored results of the batches named in
    ``batches`` are gone; rerun them."""

    def __init__(self, message: str, batches: list[str] | None = None, *, key: str | None = None) -> None:
        super().__init__(message)
        self.batches = list(batches or [])
        self.key = key


class RedisUnavailableError(BrokerError):
    """No round trip to Redis completed in time: the server is down, stopped, or the
    path to it drops packets. Raised instead of waiting on; the message names the
    masked address (when known) and what the client was doing."""


class EvictionPolicyError(BrokerError):
    """The server's ``maxmemory-policy`` lets it evict the pipeline's keys: refused at
    start, since an evicted trajectory or result is lost without a word."""


class WorkersDiedError(StreamRewardError):
    """Every worker process of a local pipeline (``score``, ``demo``) exited before the
    work was done; the message names the cause when a worker logged one."""


class MissingExtraError(StreamRewardError, ImportError):
    """A feature needs an optional dependency that is not installed. Worker hosts install
    ``stream-reward`` without torch; the tensors of the trainer side need ``stream-reward[trainer]``."""

    def __init__(self, module: str, extra: str, feature: str) -> None:
        super().__init__(
            f"{feature} needs {module}, which is not installed: pip install 'stream-reward[{extra}]'", name=module
        )
        self.module = module
        self.extra = extra


class BadRequestError(StreamRewardError, ValueError):
    """A gateway request that cannot be scored as sent: malformed JSON, a missing or
    mistyped field, lists of different lengths, a body over the limit. Refused whole,
    before anything is enqueued; ``status`` is the HTTP code (400, or 413 for a size)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class ConfigDeprecationWarning(FutureWarning):
    """An old spelling of a config key, flag, environment variable or keyword: it still works,
    and the message names the new one. A FutureWarning, so that command-line users see it."""
