"""The batch meta record: what ``open_batch`` declares and everyone else reads.

Written once by the producer (a hash under ``Keys.batch_meta``, created atomically
with the batch, see ``trainer/batches.py``), stamped ``collected`` by the first
collect, and read by the aggregator, the result listener's callers and ``status``.
This module is the one place that knows its fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stream_reward.config import DEFAULT_GROUP, BatchPolicy
from stream_reward.wire.codec import PROTOCOL_VERSION

__all__ = ["BatchMeta"]


@dataclass(slots=True)
class BatchMeta:
    size: int
    response_len: int
    policy: BatchPolicy
    created: float
    deadline: float  # epoch seconds, 0 = none
    partitions: int = 1
    group: str = DEFAULT_GROUP  # the consumer group whose results this batch collects
    collected: float = 0.0  # epoch seconds of the first collect, 0 = not yet
    forgotten: float = 0.0  # epoch seconds of RewardAggregator.forget: its results are gone

    def fields(self) -> dict[str, Any]:
        """The hash fields ``open_batch`` writes (``epoch``, ``collected`` and ``forgotten`` are stamped later)."""
        return {
            "v": PROTOCOL_VERSION,
            "size": self.size,
            "response_len": self.response_len,
            "on_failure": self.policy.on_failure,
            "fallback_score": self.policy.fallback_score,
            "deadline_s": self.policy.deadline_s or 0,
            "created": self.created,
            "deadline": self.deadline,
            "partitions": self.partitions,
            "group": self.group,
        }

    @classmethod
    def decode(cls, raw: Mapping[Any, Any]) -> BatchMeta:
        """From the hash's HGETALL reply (bytes or str). Raises KeyError or ValueError if it is not one."""
        m = {_text(k): _text(v) for k, v in raw.items()}
        return cls(
            size=int(m["size"]),
            response_len=int(m["response_len"]),
            policy=BatchPolicy(
                on_failure=m.get("on_failure", "mask"),  # type: ignore[arg-type]
                fallback_score=float(m.get("fallback_score", 0.0)),
            ),
            created=float(m.get("created", 0)),
            deadline=float(m.get("deadline", 0) or 0),
            partitions=int(m.get("partitions", 1)),
            group=m.get("group", DEFAULT_GROUP),
            collected=float(m.get("collected", 0) or 0),
            forgotten=float(m.get("forgotten", 0) or 0),
        )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
