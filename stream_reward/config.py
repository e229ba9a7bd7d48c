"""Small configuration dataclasses, grouped by concern, units in the names."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Literal

from .codec import DEFAULT_MAX_MESSAGE_BYTES
from .errors import ConfigError
from .keys import DEFAULT_GROUP, DEFAULT_NAMESPACE

__all__ = ["ConsumerConfig", "ProducerConfig", "BatchPolicy", "FailurePolicy", "default_consumer_name"]

FailurePolicy = Literal["fallback", "mask", "drop"]


def default_consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(slots=True)
class ConsumerConfig:
    """How one worker process reads, scores and acknowledges."""

    namespace: str = DEFAULT_NAMESPACE
    group: str = DEFAULT_GROUP
    partitions: int = 1
    consumer: str = field(default_factory=default_consumer_name)
    concurrency: int = 256  # samples in flight per process
    read_count: int = 256  # entries per XREADGROUP
    block_ms: int = 200  # also bounds how fast a stop request is noticed
    reclaim_idle_ms: int = 30_000  # a pending entry idle this long belongs to a dead consumer
    reclaim_interval_s: float = 5.0
    # An entry delivered more than this often (its consumers died with it in
    # flight) is scored alone, so a crash can be pinned on the right sample.
    quarantine_after_deliveries: int = 2
    max_deliveries: int = 10  # backstop: past this, dead-letter without another try
    drain_timeout_s: float = 10.0
    heartbeat_interval_s: float = 2.0
    trim_interval_s: float = 2.0
    result_ttl_s: int = 7 * 24 * 3600  # results of batches never collected
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    def __post_init__(self) -> None:
        for name in ("concurrency", "read_count", "max_deliveries", "partitions"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("block_ms", "reclaim_idle_ms"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")


@dataclass(slots=True)
class ProducerConfig:
    namespace: str = DEFAULT_NAMESPACE
    partitions: int = 1
    group: str = DEFAULT_GROUP
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # Backpressure: entries not yet read by the group, above which push() waits
    # (or raises BackpressureError with on_backlog="raise"). 0 disables the check.
    max_backlog: int = 100_000
    on_backlog: Literal["wait", "raise"] = "wait"
    backlog_poll_s: float = 0.05
    result_ttl_s: int = 7 * 24 * 3600

    def __post_init__(self) -> None:
        if self.on_backlog not in ("wait", "raise"):
            raise ConfigError("on_backlog", f"must be 'wait' or 'raise', got {self.on_backlog!r}")
        if self.max_backlog < 0:
            raise ConfigError("max_backlog", f"must be >= 0, got {self.max_backlog}")


@dataclass(slots=True)
class BatchPolicy:
    """What the aggregator does with samples that failed or missed the deadline."""

    on_failure: FailurePolicy = "mask"
    fallback_score: float = 0.0
    deadline_s: float | None = None  # after open_batch; unfinished samples resolve as failed

    def __post_init__(self) -> None:
        if self.on_failure not in ("fallback", "mask", "drop"):
            raise ConfigError("on_failure", f"must be fallback, mask or drop, got {self.on_failure!r}")
        if self.deadline_s is not None and self.deadline_s <= 0:
            raise ConfigError("deadline_s", f"must be > 0, got {self.deadline_s}")
