"""Stream plumbing shared by producer, worker and aggregator.

The trajectory stream's entries have four fields: ``d`` (the msgpack payload)
and, duplicated outside it, ``b`` batch id, ``i`` index and ``u`` uid. The copies
cost a few bytes and let a worker resolve a sample as `failed` even when its
payload cannot be decoded, so a poison message never stalls its batch.
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import ResponseError

__all__ = ["ensure_group", "entry_fields", "FIELD_PAYLOAD", "FIELD_BATCH", "FIELD_INDEX", "FIELD_UID"]

FIELD_PAYLOAD = b"d"
FIELD_BATCH = b"b"
FIELD_INDEX = b"i"
FIELD_UID = b"u"


def entry_fields(payload: bytes, batch_id: str, index: int, uid: str) -> dict[str, Any]:
    return {"d": payload, "b": batch_id, "i": index, "u": uid}


async def ensure_group(client: Any, stream: str, group: str) -> None:
    """Create the consumer group (and the stream) if missing; reading starts at the beginning.

    Starting at id 0 rather than ``$`` matters: trajectories pushed before the
    first worker joined must still be scored.
    """
    try:
        await client.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
