"""Every Redis key name of a namespace, in one place.

All keys of a namespace carry a hash tag, so the multi-key Lua scripts (result
write + ack, quota) stay in one Redis Cluster slot. A namespace may be split
into P partitions: partition p has its own trajectory stream, result ledgers and
dead-letter stream under its own tag, so partitions spread over cluster nodes.
Partition 0 uses the plain ``{ns}`` tag, so a single-partition namespace reads
the same whatever P it was later given.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

__all__ = ["Keys", "DEFAULT_NAMESPACE", "DEFAULT_GROUP"]

DEFAULT_NAMESPACE = "sr"
DEFAULT_GROUP = "scorers"


@dataclass(frozen=True, slots=True)
class Keys:
    namespace: str = DEFAULT_NAMESPACE
    partitions: int = 1

    def __post_init__(self) -> None:
        if not self.namespace or any(c in self.namespace for c in "{}"):
            raise ValueError(f"namespace {self.namespace!r} must be non-empty and contain no braces")
        if self.partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {self.partitions}")

    def tag(self, partition: int = 0) -> str:
        return f"{{{self.namespace}}}" if partition == 0 else f"{{{self.namespace}#{partition}}}"

    def partition_of(self, uid: str, group: str | None = None) -> int:
        """The partition of a sample: by GRPO group when given, so a group stays together."""
        if self.partitions == 1:
            return 0
        return zlib.crc32((group or uid).encode()) % self.partitions

    # Per partition: the hot keys the worker's write script touches together.
    def stream(self, partition: int = 0) -> str:
        return f"{self.tag(partition)}:traj"

    def results(self, batch_id: str, partition: int = 0) -> str:
        """Hash uid -> result payload: the write-once ledger of a batch (HSETNX)."""
        return f"{self.tag(partition)}:res:{batch_id}"

    def done(self, batch_id: str, partition: int = 0) -> str:
        """Stream of first results of a batch, in landing order; the aggregator blocks on it."""
        return f"{self.tag(partition)}:done:{batch_id}"

    def quarantine(self, partition: int = 0) -> str:
        """Hash entry id -> solo attempts started, for suspects of a worker crash."""
        return f"{self.tag(partition)}:quarantine"

    def dead_letters(self, partition: int = 0) -> str:
        return f"{self.tag(partition)}:dlq"

    def streams(self) -> list[str]:
        return [self.stream(p) for p in range(self.partitions)]

    # Namespace-wide keys, under partition 0's tag.
    def batch_meta(self, batch_id: str) -> str:
        return f"{self.tag()}:batch:{batch_id}"

    def batches(self) -> str:
        """Sorted set of open batch ids, scored by creation time (for `status`)."""
        return f"{self.tag()}:batches"

    def workers(self) -> str:
        """Hash consumer name -> heartbeat record."""
        return f"{self.tag()}:workers"

    def quota(self, name: str) -> str:
        """Prefix of one verifier's quota keys; its own tag keeps them in one slot."""
        return f"{{{self.namespace}:quota:{name}}}"
