"""Every Redis key name of a namespace, in one place.

All keys of a namespace carry a hash tag, so the multi-key Lua scripts (result
write + ack, quota) stay in one Redis Cluster slot. A namespace may be split
into P partitions: partition p has its own trajectory stream, result ledgers,
done streams, quarantine and dead-letter stream under its own tag, so that
partitions spread over cluster nodes. Namespace-wide keys (batch meta, the open
batch index, heartbeats) live under partition 0's tag; each verifier's quota
keys under a tag of their own.

Partition 0 uses the plain ``{ns}`` tag, so a single-partition namespace reads
the same whatever P it was later given. Partition p > 0 uses ``{ns#p.k}``, with
the smallest k >= 0 that puts the tag's slot in the middle of the p-th of P
equal slot windows (counted on from partition 0's window). Plain ``{ns#p}``
tags would land on random nodes (3 partitions on 3 masters all on different
nodes only 2 times in 9); these land one window apart, so with P a multiple of
the master count and slots split evenly (as ``redis-cli --cluster create`` and
``rebalance`` do), every master serves exactly P / masters partitions. The tags
depend on P, which every component knows: workers and producers from their
config, the aggregator from the batch meta.
"""

from __future__ import annotations

import zlib
from binascii import crc_hqx
from dataclasses import dataclass
from functools import lru_cache

from stream_reward.config import DEFAULT_GROUP, DEFAULT_NAMESPACE, check_namespace

__all__ = ["Keys", "DEFAULT_NAMESPACE", "DEFAULT_GROUP", "HASH_SLOTS", "MAX_PARTITIONS", "key_slot"]

HASH_SLOTS = 16384
MAX_PARTITIONS = 1024  # far more than masters a cluster has; keeps the tag search (O(P^2) CRCs, once) short


def key_slot(key: str) -> int:
    """The Redis Cluster slot of ``key`` (CRC16 of its hash tag, as the server computes it)."""
    data = key.encode()
    start = data.find(b"{")
    if start > -1:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            data = data[start + 1 : end]
    return crc_hqx(data, 0) % HASH_SLOTS


@lru_cache(maxsize=256)
def _tags(namespace: str, partitions: int) -> tuple[str, ...]:
    tags = [f"{{{namespace}}}"]
    if partitions == 1:
        return tuple(tags)
    home = key_slot(tags[0]) * partitions // HASH_SLOTS  # partition 0's window
    for p in range(1, partitions):
        window = (home + p) % partitions
        lo, hi = window * HASH_SLOTS // partitions, (window + 1) * HASH_SLOTS // partitions
        quarter = (hi - lo) // 4  # aim inside the window, clear of a boundary off by a slot or two
        lo, hi = lo + quarter, hi - quarter
        k = 0
        while not lo <= key_slot(f"{{{namespace}#{p}.{k}}}") < hi:
            k += 1
        tags.append(f"{{{namespace}#{p}.{k}}}")
    return tuple(tags)


@dataclass(frozen=True, slots=True)
class Keys:
    namespace: str = DEFAULT_NAMESPACE
    partitions: int = 1

    def __post_init__(self) -> None:
        check_namespace(self.namespace)
        if not 1 <= self.partitions <= MAX_PARTITIONS:
            raise ValueError(f"partitions must be between 1 and {MAX_PARTITIONS}, got {self.partitions}")

    def tag(self, partition: int = 0) -> str:
        return _tags(self.namespace, self.partitions)[partition]

    def partition_of(self, uid: str, group: str | None = None) -> int:
        """The partition of a sample: by GRPO group when given, so a group stays together."""
        if self.partitions == 1:
            return 0
        return zlib.crc32((group or uid).encode()) % self.partitions

    # Per partition: the hot keys the worker's write script touches together.
    def stream(self, partition: int = 0) -> str:
        return f"{self.tag(partition)}:traj"

    # Results are kept per (consumer group, uid): each group scoring a stream
    # has its own write-once ledger and done stream for a batch, so a worker of
    # another group (other scorers, other judges) never decides this group's
    # rewards. A batch names the group it collects (batch meta ``group``); a
    # composite reward later names several and reads each group's ledger.
    def results(self, batch_id: str, partition: int = 0, group: str = DEFAULT_GROUP) -> str:
        """Hash uid -> mark: one group's write-once ledger of a batch (the records are in ``done``)."""
        return f"{self.tag(partition)}:res:{group}:{batch_id}"

    def done(self, batch_id: str, partition: int = 0, group: str = DEFAULT_GROUP) -> str:
        """Stream of one group's first results of a batch, in landing order, an entry per worker
        flush (see wire/ledger.py); the aggregator and the result listener read it."""
        return f"{self.tag(partition)}:done:{group}:{batch_id}"

    def claims(self, batch_id: str, partition: int = 0) -> str:
        """Hash of what was pushed to a batch: ``i<index>`` -> uid, ``u<uid>`` -> ``<index>:<digest>``;
        the push script refuses a conflicting push against it. Under partition 0's
        tag on a single node (one hash sees every push of the batch); per partition
        in a cluster, where the push script may touch only its stream's slot."""
        return f"{self.tag(partition)}:claim:{batch_id}"

    def quarantine(self, partition: int = 0) -> str:
        """Hash entry id -> solo attempts started, for suspects of a worker crash."""
        return f"{self.tag(partition)}:quarantine"

    def handed(self, entry_id: str, partition: int = 0, group: str = DEFAULT_GROUP) -> str:
        """The samples (batch and uid) consumer group ``group`` handed back from stream
        entry ``entry_id`` (a set, expiring): a redelivery of that entry leaves them to
        their own entries."""
        return f"{self.tag(partition)}:handed:{group}:{entry_id}"

    def pushed(self, partition: int = 0) -> str:
        """How many samples and entries were queued on the partition's stream, ever (a hash:
        ``samples``, ``entries``, and ``requeued``, those of them that workers handed back
        or a redrive queued again; see wire/push.py)."""
        return f"{self.tag(partition)}:pushed"

    def dead_letters(self, partition: int = 0) -> str:
        return f"{self.tag(partition)}:dlq"

    def streams(self) -> list[str]:
        return [self.stream(p) for p in range(self.partitions)]

    # Namespace-wide keys, under partition 0's tag.
    def batch_meta(self, batch_id: str) -> str:
        return f"{self.tag()}:batch:{batch_id}"

    def lengths(self, batch_id: str) -> str:
        """Hash index -> valid response length, written at push time: lets the
        aggregator place a fallback score for a sample that never got a result."""
        return f"{self.tag()}:lens:{batch_id}"

    def batches(self) -> str:
        """Sorted set of open batch ids, scored by creation time (for `status`)."""
        return f"{self.tag()}:batches"

    def namespace_info(self) -> str:
        """Hash: the protocol version the namespace speaks and its epoch (see wire.namespace)."""
        return f"{self.tag()}:info"

    def history(self) -> str:
        """Sorted set batch id -> open time of every batch opened lately (kept a week):
        tells a batch whose keys expired from one that was never opened."""
        return f"{self.tag()}:history"

    def workers(self) -> str:
        """Hash consumer name -> heartbeat record."""
        return f"{self.tag()}:workers"

    def quota(self, name: str) -> str:
        """Prefix of one verifier's quota keys; its own tag keeps them in one slot."""
        return f"{{{self.namespace}:quota:{name}}}"
