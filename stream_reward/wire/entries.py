"""Stream plumbing shared by producer, worker and aggregator.

The trajectory stream's entries have two fields: ``d`` (the msgpack payload)
and ``h``, a small msgpack header [batch id, index, uid] duplicated outside it.
The copy costs a few bytes and lets a worker resolve a sample as `failed` even
when its payload cannot be decoded, so a poison message never stalls its batch.
Two fields rather than one per value: every field costs the server and both
clients on every entry.

``read_group`` and ``read_streams`` are XREADGROUP / XREAD for a single node or
a cluster. In a cluster all the streams of one call must share a hash slot (one
partition); the call then goes straight to the node that owns the slot, because
redis-py would otherwise ask the server which arguments are keys (COMMAND
GETKEYS, a second round trip) before every read.
"""

from __future__ import annotations

from typing import Any

import msgpack
from redis.exceptions import ResponseError

from stream_reward.wire.codec import packb
from stream_reward.wire.connection import is_cluster

__all__ = [
    "group_state",
    "ensure_group",
    "entry_fields",
    "XADD_MANY_CHUNK",
    "read_group",
    "read_streams",
    "entry_header",
    "read_header",
    "FIELD_PAYLOAD",
    "FIELD_HEADER",
]

FIELD_PAYLOAD = b"d"
FIELD_HEADER = b"h"


def entry_header(batch_id: str, index: int, uid: str) -> bytes:
    return packb((batch_id, index, uid))


def entry_fields(payload: bytes, batch_id: str, index: int, uid: str) -> dict[str, Any]:
    return {"d": payload, "h": entry_header(batch_id, index, uid)}


def read_header(fields: dict[Any, Any]) -> tuple[str | None, int, str | None]:
    """(batch id, index, uid) from an entry's header; (None, -1, None) where it is
    missing or garbled. Accepts bytes or str field names (dead letters keep str)."""
    raw = fields.get(FIELD_HEADER, fields.get("h"))
    if not isinstance(raw, (bytes, bytearray)):  # missing; garbage of another type is caught below
        return None, -1, None
    try:
        batch, index, uid = msgpack.unpackb(raw, raw=False)
    except Exception:  # any garbage: the header is only a best effort for recovery
        return None, -1, None
    ok = isinstance(batch, str) and isinstance(uid, str) and type(index) is int and index >= 0
    return (batch, index, uid) if ok else (None, -1, None)


# Entries per push-script call (wire/push.py): bounds how long one call holds the
# server (~2 ms at 2 KB); the entries of a call travel as one msgpack blob.
XADD_MANY_CHUNK = 256


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


async def read_group(
    client: Any, group: str, consumer: str, streams: dict[str, str], *, count: int, block: int | None
) -> Any:
    """XREADGROUP of ``streams`` (name -> id); in a cluster they must share one slot."""
    if not is_cluster(client):
        return await client.xreadgroup(group, consumer, streams, count=count, block=block)
    args: list[Any] = ["GROUP", group, consumer, "COUNT", count]
    if block is not None:
        args += ["BLOCK", block]
    return await _routed(client, "XREADGROUP", args, streams)


async def read_streams(client: Any, streams: dict[str, str], *, count: int, block: int | None) -> Any:
    """XREAD of ``streams`` (name -> last id seen); in a cluster they must share one slot."""
    if not is_cluster(client):
        return await client.xread(streams, count=count, block=block)
    args: list[Any] = ["COUNT", count]
    if block is not None:
        args += ["BLOCK", block]
    return await _routed(client, "XREAD", args, streams)


async def _routed(client: Any, command: str, args: list[Any], streams: dict[str, str]) -> Any:
    await client.initialize()  # a no-op unless the slot map is missing or stale (after a failure)
    node = client.get_node_from_key(next(iter(streams)))
    return await client.execute_command(
        command, *args, "STREAMS", *streams.keys(), *streams.values(), target_nodes=node
    )


def group_state(group: dict[Any, Any]) -> dict[str, Any]:
    """One XINFO GROUPS row with text keys and typed values.

    ``lag`` is None when Redis cannot tell (entries deleted mid-range, or after
    an AOF reload): callers report it unknown, never 0.
    """
    row = {(k.decode() if isinstance(k, bytes) else k): v for k, v in group.items()}

    def text(value: Any) -> Any:
        return value.decode(errors="replace") if isinstance(value, bytes) else value

    def number(key: str) -> int | None:
        value = row.get(key)
        return int(value) if value is not None else None

    return {
        "name": text(row["name"]),
        "consumers": int(row.get("consumers", 0)),
        "pending": int(row.get("pending", 0)),
        "lag": number("lag"),
        "entries_read": number("entries-read"),
        "last_delivered_id": text(row.get("last-delivered-id")),
    }
