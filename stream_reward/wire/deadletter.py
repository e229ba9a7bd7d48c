"""The dead-letter record: an entry that could not be scored, kept with the reason.

Written by the worker to the partition's dead-letter stream (one field ``e``, a
msgpack map); read by ``dlq list``/``redrive`` and ``status``. A dead letter holds
the reason code, the error message, the consumer, the delivery count, and the
entry's own fields, so it can be put back on the stream once the cause is fixed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from stream_reward.wire.codec import PROTOCOL_VERSION
from stream_reward.wire.entries import read_header

__all__ = ["DeadLetter", "encode_dead_letter", "decode_dead_letter"]


@dataclass(slots=True)
class DeadLetter:
    partition: int
    id: str
    reason: str
    error: str
    consumer: str
    deliveries: int
    at: float
    fields: dict[str, bytes]

    def summary(self) -> dict[str, Any]:
        """A JSON-able view; the payload is shown by size only."""
        batch, index, uid = read_header(self.fields)
        return {
            "partition": self.partition,
            "id": self.id,
            "reason": self.reason,
            "error": self.error,
            "consumer": self.consumer,
            "deliveries": self.deliveries,
            "at": self.at,
            "batch": batch,
            "index": index if index >= 0 else None,
            "uid": uid,
            "payload_bytes": len(self.fields.get("d") or b""),
        }


def encode_dead_letter(
    *,
    reason: str,
    error: str,
    entry_id: bytes,
    partition: int,
    consumer: str,
    deliveries: int,
    at: float,
    fields: dict[bytes, bytes],
) -> bytes:
    """The dead-letter stream entry's ``e`` field: why, who, when, and the entry's own fields."""
    return msgpack.packb(
        {
            "v": PROTOCOL_VERSION,
            "reason": reason,
            "error": error,
            "entry_id": entry_id,
            "partition": partition,
            "consumer": consumer,
            "deliveries": deliveries,
            "at": at,
            "fields": {k.decode(errors="replace"): v for k, v in fields.items()},
        },
        use_bin_type=True,
    )


def decode_dead_letter(partition: int, entry_id: bytes, fields: dict[bytes, bytes]) -> DeadLetter:
    """Raises KeyError, ValueError or msgpack's errors for an entry that is not a dead letter."""
    record = msgpack.unpackb(fields[b"e"], raw=False, strict_map_key=False)
    return DeadLetter(
        partition=partition,
        id=entry_id.decode(),
        reason=record.get("reason", "?"),
        error=record.get("error", ""),
        consumer=record.get("consumer", ""),
        deliveries=int(record.get("deliveries", 0)),
        at=float(record.get("at", 0)),
        fields=record.get("fields", {}),
    )
