"""msgpack wire format of trajectories and results.

A codec is two functions per record (``encode_*`` / ``decode_*``). One protocol
version, ``PROTOCOL_VERSION``, covers every record stream-reward writes
(trajectory, result, heartbeat, batch meta, dead letter) and is bumped on any
change to any of them; a namespace records the version it speaks (see
``wire.namespace``), so builds of two versions never share one. Version 2: results
became positional arrays. Version 3: a done-stream entry carries its flush's
result records as one run of records (``wire.ledger``). Trajectory payloads are
msgpack maps with short keys and the version under ``"v"``; token ids are
packed as little-endian int32 bytes (4 bytes a token instead of up to 5 plus
per-item framing, and one memcpy to decode). Decoding validates every field's
type, so a bad message fails here with a precise reason instead of deep inside
a scorer.
"""

from __future__ import annotations

import sys
import threading
from array import array
from collections.abc import Callable, Mapping
from typing import Any

import msgpack

from stream_reward.config import DEFAULT_MAX_MESSAGE_BYTES
from stream_reward.errors import BadInputError, CodecError, PayloadTooLargeError, SchemaVersionError
from stream_reward.wire.trajectory import ResultRecord, ScoreResult, Trajectory

__all__ = [
    "to_plain",
    "PROTOCOL_VERSION",
    "SCHEMA_VERSION",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "encode_trajectory",
    "decode_trajectory",
    "encode_result",
    "decode_result",
    "result_from_row",
    "record_from_row",
    "stored_result",
    "stored_record",
    "result_rows",
    "row_header",
    "pack_ids",
    "unpack_ids",
    "packb",
]

PROTOCOL_VERSION = 4
SCHEMA_VERSION = PROTOCOL_VERSION  # the older name

_LITTLE = sys.byteorder == "little"

_packers = threading.local()


def packb(obj: Any, *, bin_type: bool = True) -> bytes:
    """``msgpack.packb`` with a Packer kept per thread. ``msgpack.packb`` builds a
    Packer (and its 256 KiB buffer) per call: measured inside a running trainer
    process, that made a 2 KB trajectory cost 4 us to pack instead of 1, on a
    path run for every sample. ``bin_type=False`` for what Lua's cmsgpack reads."""
    name = "bin" if bin_type else "raw"
    packer = getattr(_packers, name, None)
    if packer is None:
        packer = msgpack.Packer(use_bin_type=bin_type)
        setattr(_packers, name, packer)
    return packer.pack(obj)  # type: ignore[no-any-return]  # autoreset: bytes; the buffer resets on errors too


def pack_ids(ids: list[int]) -> bytes:
    packed = array("i", ids)
    if not _LITTLE:
        packed.byteswap()
    return packed.tobytes()


def unpack_ids(data: bytes) -> list[int]:
    if len(data) % 4:
        raise CodecError("response_ids: byte length is not a multiple of 4")
    ids = array("i")
    ids.frombytes(data)
    if not _LITTLE:
        ids.byteswap()
    return ids.tolist()


def _pack(obj: dict[str, Any], max_bytes: int) -> bytes:
    try:
        data = packb(obj)
    except (TypeError, ValueError, OverflowError) as exc:
        raise CodecError(f"cannot encode: {exc}") from exc
    if len(data) > max_bytes:
        raise PayloadTooLargeError(f"payload is {len(data)} bytes, over the maximum of {max_bytes}")
    return data


def _unpack(data: bytes, max_bytes: int) -> dict[Any, Any]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError(f"payload must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise PayloadTooLargeError(f"payload is {len(data)} bytes, over the maximum of {max_bytes}")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise CodecError(f"not valid msgpack: {type(exc).__name__}: {exc}") from exc
    if not isinstance(obj, dict):
        raise CodecError(f"payload must be a msgpack map, got {type(obj).__name__}")
    version = obj.get("v")
    if version != SCHEMA_VERSION:
        raise SchemaVersionError(f"schema version {version!r}, this build reads version {SCHEMA_VERSION}")
    return obj


def _type_names(types: type | tuple[type, ...]) -> str:
    if isinstance(types, tuple):
        return " or ".join(t.__name__ for t in types)
    return types.__name__


def encode_trajectory(traj: Trajectory, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> bytes:
    obj: dict[str, Any] = {
        "v": SCHEMA_VERSION,
        "u": traj.uid,
        "b": traj.batch_id,
        "i": traj.index,
        "ds": traj.data_source,
        "r": traj.response,
        "gt": traj.ground_truth,
    }
    # Optional fields are left out when empty: most trajectories carry few of them.
    if traj.prompt is not None:
        obj["p"] = traj.prompt
    if traj.response_ids is not None:
        obj["ids"] = pack_ids(traj.response_ids)
    if traj.valid_response_length is not None:
        obj["vl"] = traj.valid_response_length
    if traj.max_response_length is not None:
        obj["ml"] = traj.max_response_length
    if traj.extra_info:
        obj["x"] = traj.extra_info
    if traj.group is not None:
        obj["g"] = traj.group
    if traj.rm_score is not None:
        obj["rm"] = float(traj.rm_score)
    return _pack(obj, max_bytes)


# Wire key -> (field name, accepted types). Checked with ``type(v) in types``,
# which is exact: bool is not accepted as an int, nor a subclass for a builtin.
_TRAJECTORY_FIELDS: dict[str, tuple[str, tuple[type, ...]]] = {
    "u": ("uid", (str,)),
    "b": ("batch_id", (str,)),
    "i": ("index", (int,)),
    "ds": ("data_source", (str,)),
    "p": ("prompt", (str,)),
    "ids": ("response_ids", (bytes,)),
    "vl": ("valid_response_length", (int,)),
    "ml": ("max_response_length", (int,)),
    "x": ("extra_info", (dict,)),
    "g": ("group", (str,)),
    "rm": ("rm_score", (int, float)),
}
_REQUIRED = ("i", "u", "b", "ds")


def decode_trajectory(data: bytes, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Trajectory:
    obj = _unpack(data, max_bytes)
    get = obj.get
    uid, batch_id, index, data_source, response = get("u"), get("b"), get("i"), get("ds"), get("r")
    prompt, ids, vl, ml, extra, group, rm = get("p"), get("ids"), get("vl"), get("ml"), get("x"), get("g"), get("rm")
    # The common case in one expression (this runs once per sample on the worker's hot
    # path); anything off is named precisely by _trajectory_error.
    if not (
        type(uid) is str
        and type(batch_id) is str
        and type(index) is int
        and index >= 0
        and type(data_source) is str
        and type(response) is str
        and (prompt is None or type(prompt) is str)
        and (ids is None or type(ids) is bytes)
        and (vl is None or (type(vl) is int and vl >= 0))
        and (ml is None or type(ml) is int)
        and (extra is None or type(extra) is dict)
        and (group is None or type(group) is str)
        and (rm is None or type(rm) in _NUMBER)
    ):
        raise _trajectory_error(obj)
    # Positional, in the dataclass's field order: 13 keyword arguments cost a dataclass
    # __init__ about 0.5 us more, once per sample on the worker (test_codec checks the order).
    return Trajectory(
        batch_id,
        index,
        data_source,
        response,
        get("gt"),  # ground_truth
        uid,
        prompt,
        unpack_ids(ids) if ids is not None else None,  # response_ids
        vl,  # valid_response_length
        ml,  # max_response_length
        extra or {},  # extra_info
        group,
        float(rm) if rm is not None else None,  # rm_score
    )


def _trajectory_error(obj: dict[Any, Any]) -> CodecError:
    """What is wrong with a decoded payload that failed decode_trajectory's check: the
    first field of a wrong type (in the payload's order), then a missing one, then a
    value out of range."""
    for key, value in obj.items():
        spec = _TRAJECTORY_FIELDS.get(key)
        if spec is not None and value is not None and type(value) not in spec[1]:
            return CodecError(f"field {spec[0]!r} must be {_type_names(spec[1])}, got {type(value).__name__}")
    for key in _REQUIRED:
        if obj.get(key) is None:
            return CodecError(f"missing field {_TRAJECTORY_FIELDS[key][0]!r}")
    response = obj.get("r")
    if type(response) is not str:
        # A missing response is the producer's fault, not an empty answer to score 0.
        return BadInputError(f"field 'response' must be a string, got {type(response).__name__}")
    index = obj["i"]
    if index < 0:
        return CodecError(f"field 'index' must be >= 0, got {index}")
    vl = obj.get("vl")
    if vl is not None and vl < 0:
        return CodecError(f"field 'valid_response_length' must be >= 0, got {vl}")
    return CodecError("payload fails the trajectory check")  # pragma: no cover  # the checks above cover it


def encode_result(result: ScoreResult) -> bytes:
    """A result as a positional msgpack array: results are written and read only by
    this code (worker -> aggregator), once per sample on both hot paths, and an
    array packs and unpacks ~2-3x faster than a map with key strings.

    The first four positions (version, uid, batch id, index) never move in any
    version: a reader meeting a record of another version still knows which
    sample it belongs to, and fails that sample rather than the batch."""
    row = (
        SCHEMA_VERSION,
        result.uid,
        result.batch_id,
        result.index,
        result.score,
        result.status,
        result.attempts,
        result.scored_at,
        result.extra or None,
        result.reason,
        result.error,
        result.valid_response_length,
        result.data_source,
        result.group,
    )
    try:
        return packb(row)
    except (TypeError, ValueError, OverflowError):
        # A scorer returned extra info msgpack cannot carry (a tensor, a set...):
        # keep the score, stringify the extras rather than lose the sample.
        extra = {str(k): to_plain(v) for k, v in result.extra.items()}
        return packb(row[:8] + (extra,) + row[9:])


def to_plain(value: Any, unknown: Callable[[Any], Any] = repr) -> Any:
    """``value`` as the plain Python msgpack and JSON carry: the one converter for
    numpy / torch scalars and arrays, tuples, and mappings of any kind.
    What has no plain form becomes ``unknown(value)``."""
    if value is None or type(value) in (bool, int, float, str, bytes):
        return value
    if isinstance(value, Mapping):
        return {str(k): to_plain(v, unknown) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v, unknown) for v in value]
    for convert in ("item", "tolist"):  # numpy / torch scalars, then arrays and tensors
        method = getattr(value, convert, None)
        if callable(method):
            try:
                return to_plain(method(), unknown)
            except (TypeError, ValueError, RuntimeError):
                continue
    for plain in (bool, str, bytes, float, int):  # subclasses (numpy.str_, enum values, ...)
        if isinstance(value, plain):
            return plain(value)  # type: ignore[arg-type]  # value is an instance of plain
    return unknown(value)


def decode_result(data: bytes) -> ScoreResult:
    try:
        row = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # garbage of any kind: msgpack raises unrelated types
        raise CodecError(f"not a result record: {type(exc).__name__}: {exc}") from exc
    return result_from_row(row)


def result_rows(data: bytes) -> tuple[list[Any], str | None]:
    """The records of a run of encoded results (one done-stream entry), unpacked in
    one pass; and what stopped the pass early (bytes that are not msgpack), or None."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(data), 1))
    unpacker.feed(data)
    rows: list[Any] = []
    try:
        rows.extend(unpacker)
    except Exception as exc:  # garbage of any kind: msgpack raises unrelated types
        return rows, f"{type(exc).__name__}: {exc}"
    return rows, None


def result_from_row(row: Any) -> ScoreResult:
    """A result from its unpacked record; CodecError / SchemaVersionError if it is none of this version."""
    return ScoreResult.from_record(*record_from_row(row))


def record_from_row(row: Any) -> tuple[ResultRecord, dict[str, Any]]:
    """The same as a ResultRecord and its extra, with no ScoreResult made: what a batch keeps."""
    if not isinstance(row, list) or not row:
        raise CodecError(f"not a result record: a {type(row).__name__}")
    if row[0] != PROTOCOL_VERSION:
        raise SchemaVersionError(
            f"result written by protocol version {row[0]!r}, this build reads version {PROTOCOL_VERSION}"
        )
    try:
        version, uid, batch_id, index, score, status, attempts, scored_at, extra, reason, error, vl, ds, group = row
    except ValueError as exc:
        raise CodecError(f"not a result record: {exc}") from exc
    # Every field's type, as for a trajectory: a record a foreign writer garbled fails
    # its own sample here, never a collect (or every waiter of the listener) later.
    # One expression for the common case (this runs per result on the trainer).
    if not (
        type(uid) is str
        and type(batch_id) is str
        and type(index) is int
        and type(score) in _NUMBER
        and (status == "ok" or status == "failed")
        and type(attempts) is int
        and type(scored_at) in _NUMBER
        and (extra is None or type(extra) is dict)
        and (reason is None or type(reason) is str)
        and (error is None or type(error) is str)
        and (vl is None or type(vl) is int)
        and (ds is None or type(ds) is str)
        and (group is None or type(group) is str)
    ):
        raise CodecError(_bad_result_field(row))
    # In ResultRecord's order, ScoreResult's without extra (test_codec's round trip checks it).
    return (uid, batch_id, index, float(score), status, reason, error, attempts, vl, ds, group, scored_at), extra or {}


_NUMBER = (int, float)
_RESULT_FIELDS: tuple[tuple[str, tuple[type, ...]], ...] = (
    ("uid", (str,)),
    ("batch_id", (str,)),
    ("index", (int,)),
    ("score", _NUMBER),
    ("status", (str,)),
    ("attempts", (int,)),
    ("scored_at", _NUMBER),
    ("extra", (dict, type(None))),
    ("reason", (str, type(None))),
    ("error", (str, type(None))),
    ("valid_response_length", (int, type(None))),
    ("data_source", (str, type(None))),
    ("group", (str, type(None))),
)


def _bad_result_field(row: list[Any]) -> str:
    for (name, types), value in zip(_RESULT_FIELDS, row[1:]):
        if type(value) not in types:
            return f"result field {name!r} must be {_type_names(types)}, got {type(value).__name__}"
    return f"result field 'status' must be 'ok' or 'failed', got {row[5]!r}"


def row_header(row: Any) -> tuple[str, int] | None:
    """(uid, index) of an unpacked result record of any protocol version, or None."""
    if isinstance(row, list) and len(row) >= 4 and isinstance(row[1], str) and type(row[3]) is int:
        return row[1], row[3]
    return None


def stored_result(row: Any) -> ScoreResult | None:
    """What a reader makes of a stored record: its result; a record of another
    protocol version (or broken past its fixed prefix) fails its own sample;
    None for one that names no sample."""
    stored = stored_record(row)
    return None if stored is None else ScoreResult.from_record(*stored)


def stored_record(row: Any) -> tuple[ResultRecord, dict[str, Any]] | None:
    """The same as a ResultRecord and its extra."""
    try:
        return record_from_row(row)
    except CodecError as exc:
        header = row_header(row)
        if header is None:
            return None
        uid, index = header
        batch_id = row[2] if isinstance(row[2], str) else ""
        failed = ScoreResult(uid, batch_id, index, 0.0, "failed", reason=exc.reason, error=f"unreadable result: {exc}")
        return failed.record(), failed.extra
