"""Stream plumbing shared by producer, worker and aggregator.

A trajectory-stream entry holds one or more samples (up to the producer's
``samples_per_entry``) in two fields: ``d``, their msgpack payloads back to back,
and ``h``, a small msgpack header per sample, [batch id, index, uid, payload
size], back to back in the same order. The header copy costs a few bytes and
lets a worker resolve a sample as `failed` even when its payload cannot be
decoded, so a poison message never stalls its batch. Several samples to an
entry because a stream entry costs the server and both clients more than a
sample's own bytes do: XADD, the pending-entries list, the reply's parsing and
XACK, each once per entry. Measured with the bare redis-py loop of ``bench
throughput``, 16 samples to an entry cut the CPU per sample from 25.6 to 10.7 us.
Two fields rather than one per value for the same reason.

A worker scores an entry's samples one by one and acks the entry once every
one of them has its result (see ``stream_reward.worker.opening``); a sample it dead-letters
is kept as an entry of its own (``member_fields``), so a redrive re-queues that
sample alone.

``read_group`` and ``read_streams`` are XREADGROUP / XREAD for a single node or
a cluster. In a cluster all the streams of one call must share a hash slot (one
partition); the call then goes straight to the node that owns the slot, because
redis-py would otherwise ask the server which arguments are keys (COMMAND
GETKEYS, a second round trip) before every read.
"""

from __future__ import annotations

import io
import math
import re
from typing import TYPE_CHECKING, Any, cast

import msgpack
from redis.exceptions import ResponseError

from stream_reward.wire.codec import packb
from stream_reward.wire.connection import is_cluster
from stream_reward.wire.packed import pack_command

if TYPE_CHECKING:
    from stream_reward.wire.lane import Lane

__all__ = [
    "read_place",
    "refused_uid",
    "group_state",
    "ensure_group",
    "entry_fields",
    "XADD_MANY_CHUNK",
    "read_group",
    "read_streams",
    "entry_header",
    "read_header",
    "read_members",
    "member_fields",
    "FIELD_PAYLOAD",
    "FIELD_HEADER",
    "FIELD_HANDED_BACK",
    "FIELD_FOR_GROUP",
]

FIELD_PAYLOAD = b"d"
FIELD_HEADER = b"h"
# On an entry a worker handed back (stream_reward.worker.opening: EntryOpening._spill): the id of the entry
# its sample came from (for telling the copy from a producer's push). On it and on a dead
# letter: the consumer group that wrote it; only that group scores the copy or the
# redriven letter. Every group reads the stream, and every other group has the sample
# in the entry it came from.
FIELD_HANDED_BACK = b"s"
FIELD_FOR_GROUP = b"g"


def entry_header(batch_id: str, index: int, uid: str, size: int) -> bytes:
    """One sample's header; ``size`` is its payload's length in bytes."""
    return packb((batch_id, index, uid, size))


def entry_fields(payload: bytes, batch_id: str, index: int, uid: str) -> dict[str, Any]:
    """The fields of an entry holding one sample."""
    return {"d": payload, "h": entry_header(batch_id, index, uid, len(payload))}


# One sample of an entry: (batch id, index, uid, payload size).
Member = tuple[str, int, str, int]


def _names_a_sample(batch: Any, index: Any, uid: Any) -> bool:
    """A header's (or a payload's) batch id, index and uid have the types and range of one."""
    return type(batch) is str and type(uid) is str and type(index) is int and index >= 0


def read_members(fields: dict[Any, Any]) -> list[Member] | None:
    """The samples of an entry, in order; None when the headers are missing or garbled,
    or their sizes do not add up to the payloads (nothing of it can be trusted then)."""
    raw = fields.get(FIELD_HEADER, fields.get("h"))
    data = fields.get(FIELD_PAYLOAD, fields.get("d"))
    if not isinstance(raw, (bytes, bytearray)) or not isinstance(data, (bytes, bytearray)):
        return None
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(raw)
    total = 0
    try:
        out: list[Member] = list(unpacker)  # all at once: the loop below only checks
        for batch, index, uid, size in out:
            # (_names_a_sample, inlined: this runs once per sample on the worker.)
            if not (
                type(batch) is str
                and type(uid) is str
                and type(index) is int
                and index >= 0
                and type(size) is int
                and size >= 0
            ):
                return None
            total += size
    except Exception:  # any garbage: the headers are only a best effort for recovery
        return None
    return out if out and total == len(data) else None


# Where a payload can start: the first byte of a msgpack map.
_MAP_START = re.compile(b"[\x80-\x8f\xde\xdf]")
# An entry without headers is split by scanning its bytes. Bounded work for a hostile one:
# its size, and the bytes its parses may read in all (a multiple of its size).
_SPLIT_MAX_BYTES = 1 << 20
_SPLIT_READ_FACTOR = 4


def members_from_payloads(data: Any) -> list[tuple[int, Member | None]] | None:
    """The samples of an entry whose headers are lost, from its payloads: msgpack maps back
    to back, each naming its batch, index and uid. Each part's size and its header, or
    None for bytes that name no sample (dead-lettered alone; a whole value that names
    none is skipped whole, never searched inside). The scan goes on at the next map that
    names a sample, so junk takes no good sample with it.

    None (the entry is read whole, as one sample) unless there are two or more parts and
    one names a sample; and None where the split would be a guess: a sample's map that
    holds another sample's map (a truncated payload that swallowed the next one, or a
    payload that carries one), or a scan past its budget."""
    if not isinstance(data, (bytes, bytearray)) or len(data) > _SPLIT_MAX_BYTES:
        return None
    scan = _Scan(data)
    out: list[tuple[int, Member | None]] = []
    at, junk, size = 0, -1, len(data)
    while at < size:
        found = scan.value_at(at) if data[at] in _MAP_FIRST else None
        if found is not None and found[0] is not None:
            head, end = found
            if scan.holds_a_sample(at + 1, end):
                return None
            if junk >= 0:
                out.append((at - junk, None))
                junk = -1
            out.append((end - at, head))
            at = end
            continue
        if scan.over_budget:
            return None
        junk = at if junk < 0 else junk
        # Past a whole value that names no sample (never inside it), else past this byte;
        # then on to the next byte a map can start at.
        at = found[1] if found is not None else at + 1
        next_map = _MAP_START.search(data, at)
        at = next_map.start() if next_map else size
    if junk >= 0:
        out.append((size - junk, None))
    named = any(head is not None for _, head in out)
    return out if len(out) > 1 and named else None


_MAP_FIRST = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}


class _Scan:
    """Parses single msgpack values of ``data`` at given offsets, counting the bytes read."""

    def __init__(self, data: bytes | bytearray) -> None:
        self.data = data
        self.source = io.BytesIO(data)
        self.read = 0
        self.budget = _SPLIT_READ_FACTOR * len(data) + 65536

    @property
    def over_budget(self) -> bool:
        return self.read > self.budget

    def value_at(self, at: int) -> tuple[Member | None, int] | None:
        """The sample the value at ``at`` names (or None) and where the value ends; None
        if no whole value starts there (or the budget is spent)."""
        if self.over_budget:
            return None
        self.source.seek(at)
        unpacker = msgpack.Unpacker(self.source, raw=False, strict_map_key=False, read_size=1024)
        try:
            obj = unpacker.unpack()
        except Exception:  # garbage, or cut short
            return None
        finally:
            self.read += self.source.tell() - at
        end = at + unpacker.tell()
        if not isinstance(obj, dict):
            return None, end
        batch, index, uid = obj.get("b"), obj.get("i"), obj.get("u")
        if not _names_a_sample(batch, index, uid):
            return None, end
        return cast(Member, (batch, index, uid, end - at)), end

    def holds_a_sample(self, start: int, end: int) -> bool:
        """Whether a map naming a sample starts anywhere in ``data[start:end]`` (or the
        budget ran out looking: then it is taken as so)."""
        for match in _MAP_START.finditer(self.data, start, end):
            found = self.value_at(match.start())
            if self.over_budget or (found is not None and found[0] is not None):
                return True
        return False


def member_fields(
    payload: bytes, member: Member | None, *, handed_back_from: bytes | None = None, group: str = ""
) -> dict[bytes, bytes]:
    """An entry of its own for one sample of a larger entry: what a dead letter of consumer
    group ``group`` keeps (a redrive queues it for that group only), or what a worker of
    ``group`` hands back to the stream, from the entry ``handed_back_from``. A payload
    that names no sample (``member`` None) goes without a header."""
    fields = {FIELD_PAYLOAD: payload}
    if member is not None:
        fields[FIELD_HEADER] = entry_header(*member)
    if handed_back_from is not None:
        fields[FIELD_HANDED_BACK] = handed_back_from
    if group:
        fields[FIELD_FOR_GROUP] = group.encode()
    return fields


def read_header(fields: dict[Any, Any]) -> tuple[str | None, int, str | None]:
    """(batch id, index, uid) of an entry's only sample; (None, -1, None) where the
    header is missing or garbled, or names several samples. Accepts bytes or str
    field names (dead letters keep str)."""
    raw = fields.get(FIELD_HEADER, fields.get("h"))
    if not isinstance(raw, (bytes, bytearray)):  # missing; garbage of another type is caught below
        return None, -1, None
    try:
        batch, index, uid, _size = msgpack.unpackb(raw, raw=False)
    except Exception:  # any garbage (or several headers): the header is only a best effort
        return None, -1, None
    return (batch, index, uid) if _names_a_sample(batch, index, uid) else (None, -1, None)


# Payloads larger than this are not unpacked to find their place: a refused entry's
# dead-letter path must stay cheap however big what it refuses.
_PLACE_MAX_BYTES = 1 << 20


def refused_uid(index: int, entry_id: bytes) -> str:
    """The uid a refused sample's result goes by when its entry names none usable: made of
    its index and its entry, the same when the entry is delivered again (written once), and
    apart for two entries at one index (each keeps its dead letter; the first result is the
    index's). A producer's uid never looks like this."""
    return f"<no uid>#{index}@{entry_id.decode()}"


def read_place(fields: dict[Any, Any]) -> tuple[str | None, int, str | None]:
    """Where an entry's only sample belongs, for a refused entry's `failed` result:
    (batch id, index, uid) as ``read_header``, but a batch and index are kept when the
    header's uid is missing or not a string, and are taken from the payload's own map when
    the header names none; uid None then (a payload that could not be read is no
    authority on its uid). (None, -1, None) when neither names a batch and index."""
    batch, index, uid = read_header(fields)
    if batch is not None:
        return batch, index, uid
    for raw in (fields.get(FIELD_HEADER, fields.get("h")), fields.get(FIELD_PAYLOAD, fields.get("d"))):
        if not isinstance(raw, (bytes, bytearray)) or len(raw) > _PLACE_MAX_BYTES:
            continue
        try:
            obj = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except Exception:  # garbage, or several values: nothing to place it by
            continue
        found: tuple[Any, Any, Any]
        if isinstance(obj, (list, tuple)) and len(obj) == 4:
            found = (obj[0], obj[1], obj[2])
        elif isinstance(obj, dict):
            found = (obj.get("b"), obj.get("i"), obj.get("u"))
        else:
            continue
        at_batch, at_index, _uid = found
        if type(at_batch) is str and type(at_index) is int and at_index >= 0:
            return at_batch, at_index, None
    return None, -1, None


# A stop gives a worker's unfinished entries back to its group: marked idle for ever, so
# the next reclaim sweep of any worker takes them at once. Atomic per stream: only entries
# this consumer holds (never one a peer claimed), not released already; the delivery each
# claim cost is taken back (a graceful stop is not a crash, and deliveries count crashes).
RELEASE_SCRIPT = """
-- KEYS[1]: the stream. ARGV[1]: the group; ARGV[2]: the consumer; ARGV[3]: the idle to
-- mark (ms); ARGV[4...]: ids of entries to keep. Returns how many were released.
local keep = {}
for i = 4, #ARGV do
  keep[ARGV[i]] = true
end
local released = 0
for _, row in ipairs(redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 100000, ARGV[2])) do
  -- row: id, consumer, idle ms, times delivered
  if not keep[row[1]] and row[3] < tonumber(ARGV[3]) / 2 then
    local count = math.max(row[4] - 1, 0)
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, row[1], 'IDLE', ARGV[3], 'RETRYCOUNT', count, 'JUSTID')
    released = released + 1
  end
end
return released
"""

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
    client: Any,
    group: str,
    consumer: str,
    streams: dict[str, str],
    *,
    count: int,
    block: int | None,
    lane: Lane | None = None,
) -> Any:
    """XREADGROUP of ``streams`` (name -> id); in a cluster they must share one slot.
    On ``lane`` when given (a single node's), in redis-py's reply shape."""
    if lane is not None:
        args: list[Any] = ["XREADGROUP", "GROUP", group, consumer, "COUNT", count]
        if block is not None:
            args += ["BLOCK", block]
        packed = [pack_command(*args, "STREAMS", *streams.keys(), *streams.values())]
        return _stream_reply(await lane.call(packed, block_s=_block_s(block)))
    if not is_cluster(client):
        args = ["XREADGROUP", "GROUP", group, consumer, "COUNT", count]
        if block is not None:
            args += ["BLOCK", block]
        return await _blocking_read(client, [*args, "STREAMS", *streams.keys(), *streams.values()], block)
    routed: list[Any] = ["GROUP", group, consumer, "COUNT", count]
    if block is not None:
        routed += ["BLOCK", block]
    return await _routed(client, "XREADGROUP", routed, streams)


async def read_streams(
    client: Any, streams: dict[str, str], *, count: int, block: int | None, lane: Lane | None = None
) -> Any:
    """XREAD of ``streams`` (name -> last id seen); in a cluster they must share one slot.
    On ``lane`` when given (a single node's), in redis-py's reply shape."""
    if lane is not None:
        args: list[Any] = ["XREAD", "COUNT", count]
        if block is not None:
            args += ["BLOCK", block]
        packed = [pack_command(*args, "STREAMS", *streams.keys(), *streams.values())]
        return _stream_reply(await lane.call(packed, block_s=_block_s(block)))
    if not is_cluster(client):
        args = ["XREAD", "COUNT", count]
        if block is not None:
            args += ["BLOCK", block]
        return await _blocking_read(client, [*args, "STREAMS", *streams.keys(), *streams.values()], block)
    routed: list[Any] = ["COUNT", count]
    if block is not None:
        routed += ["BLOCK", block]
    return await _routed(client, "XREAD", routed, streams)


def _block_s(block: int | None) -> float | None:
    """How long a read may wait on the server beyond the reply timeout (None: for ever)."""
    if block is None:
        return 0.0
    return None if block == 0 else block / 1000


async def _blocking_read(client: Any, args: list[Any], block: int | None) -> Any:
    """``args`` (an XREAD or XREADGROUP) on one of ``client``'s pooled connections, its
    reply awaited for the connection's socket timeout plus the BLOCK: the socket timeout
    alone would cut every read that blocks longer. No redis-py retry: the callers' loops
    decide whether to read again."""
    pool = client.connection_pool
    conn = await pool.get_connection()
    try:
        extra = _block_s(block)
        base = conn.socket_timeout
        timeout = math.inf if base is None or extra is None else base + extra
        await conn.send_command(*args)
        reply = await conn.read_response(timeout=timeout)
    except ResponseError:
        raise  # an error reply (NOGROUP, ...): the connection is in step
    except BaseException:
        await conn.disconnect()  # a reply may still come: never reuse this connection
        raise
    finally:
        await pool.release(conn)
    callback = client.response_callbacks.get(args[0])
    return reply if callback is None else callback(reply)


def _stream_reply(replies: list[Any]) -> Any:
    """A lane's raw XREAD/XREADGROUP reply in redis-py's shape; an error reply raised."""
    (reply,) = replies
    if isinstance(reply, BaseException):
        raise reply
    if reply is None:  # the block ran out
        return None
    return [[name, [(None, None) if e is None else (e[0], _pairs(e[1])) for e in entries]] for name, entries in reply]


def _pairs(flat: list[Any]) -> dict[Any, Any]:
    """An entry's [field, value, ...] as redis-py's dict (a deleted entry's: none)."""
    return dict(zip(flat[::2], flat[1::2])) if flat else {}


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
