"""Stream plumbing shared by producer, worker and aggregator.

The trajectory stream's entries have four fields: ``d`` (the msgpack payload)
and, duplicated outside it, ``b`` batch id, ``i`` index and ``u`` uid. The copies
cost a few bytes and let a worker resolve a sample as `failed` even when its
payload cannot be decoded, so a poison message never stalls its batch.

``read_group`` and ``read_streams`` are XREADGROUP / XREAD for a single node or
a cluster. In a cluster all the streams of one call must share a hash slot (one
partition); the call then goes straight to the node that owns the slot, because
redis-py would otherwise ask the server which arguments are keys (COMMAND
GETKEYS, a second round trip) before every read.
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import ResponseError

from .broker import is_cluster

__all__ = ["ensure_group", "entry_fields", "xadd_many_args", "XADD_MANY_SCRIPT", "XADD_MANY_CHUNK",
           "read_group", "read_streams",
           "FIELD_PAYLOAD", "FIELD_BATCH", "FIELD_INDEX", "FIELD_UID"]

FIELD_PAYLOAD = b"d"
FIELD_BATCH = b"b"
FIELD_INDEX = b"i"
FIELD_UID = b"u"


def entry_fields(payload: bytes, batch_id: str, index: int, uid: str) -> dict[str, Any]:
    return {"d": payload, "b": batch_id, "i": index, "u": uid}


# Many XADDs in one command. A redis-py pipeline of N XADDs costs the client a
# packed command and a parsed reply (each under its own timeout context) per
# entry: ~18 us of CPU for a 2 KB trajectory, more than encoding it. One EVALSHA
# carrying N entries costs ~4 us of client CPU an entry and the server ~2-3 us
# more than native XADDs. The script also makes each call all-or-nothing on the
# server, which a pipeline is not. Fields as in ``entry_fields``.
XADD_MANY_SCRIPT = """
for j = 1, #ARGV, 4 do
  redis.call('XADD', KEYS[1], '*', 'd', ARGV[j], 'b', ARGV[j + 1], 'i', ARGV[j + 2], 'u', ARGV[j + 3])
end
return #ARGV / 4
"""
# Entries per script call: bounds how long one call holds the server (~2 ms at 2 KB).
XADD_MANY_CHUNK = 256


def xadd_many_args(payload: bytes, batch_id: str, index: int, uid: str) -> tuple[bytes, str, int, str]:
    """One entry's ARGV for XADD_MANY_SCRIPT."""
    return payload, batch_id, index, uid


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


async def read_group(client: Any, group: str, consumer: str, streams: dict[str, str], *, count: int, block: int | None) -> Any:
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
    return await client.execute_command(command, *args, "STREAMS", *streams.keys(), *streams.values(), target_nodes=node)
