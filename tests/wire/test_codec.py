"""The msgpack codecs (wire/codec.py): a trajectory and a result round-trip every field;
token ids pack four bytes each; garbage, a non-map, a wrong schema version, wrong fields
and an oversized payload are a CodecError that names what is wrong; arbitrary bytes and
records decode or raise CodecError, never anything else; the fast field check accepts and
names exactly what the reference decoder does; every record carries the one protocol
version; a batch's codec rows round-trip and fail their own sample.
"""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stream_reward.errors import CodecError, PayloadTooLargeError, SchemaVersionError
from stream_reward.wire.codec import (
    _TRAJECTORY_FIELDS,
    PROTOCOL_VERSION,
    SCHEMA_VERSION,
    decode_result,
    decode_trajectory,
    encode_result,
    encode_trajectory,
    pack_ids,
    result_from_row,
    stored_result,
    unpack_ids,
)
from stream_reward.wire.trajectory import ScoreResult, Trajectory, trajectory_from_json

pytestmark = pytest.mark.anyio


def full_trajectory() -> Trajectory:
    return Trajectory(
        batch_id="b",
        index=3,
        data_source="openai/gsm8k",
        response="#### 4",
        ground_truth={"answer": "4"},
        uid="u-3",
        prompt="2+2?",
        response_ids=[1, 2, 2**31 - 1, 0],
        valid_response_length=4,
        max_response_length=16,
        extra_info={"split": "train"},
        group="g0",
        rm_score=0.25,
    )


def _containers(children):
    return st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=20),
    _containers,
    max_leaves=10,
)


# A plain field-by-field decoder, kept as the reference for the one-expression check:
# the fast check must accept exactly what it accepted, and name the same fault.
_REFERENCE_FIELDS = _TRAJECTORY_FIELDS  # the field types the reference decoder checks


def _reference_decode(obj: dict) -> Trajectory:
    from stream_reward.errors import BadInputError

    for key, value in obj.items():
        spec = _REFERENCE_FIELDS.get(key)
        if spec is not None and value is not None and type(value) not in spec[1]:
            raise CodecError(
                f"field {spec[0]!r} must be {' or '.join(t.__name__ for t in spec[1])}, got {type(value).__name__}"
            )
    for key in ("i", "u", "b", "ds"):
        if obj.get(key) is None:
            raise CodecError(f"missing field {_REFERENCE_FIELDS[key][0]!r}")
    if type(obj.get("r")) is not str:
        raise BadInputError(f"field 'response' must be a string, got {type(obj.get('r')).__name__}")
    if obj["i"] < 0:
        raise CodecError(f"field 'index' must be >= 0, got {obj['i']}")
    vl = obj.get("vl")
    if vl is not None and vl < 0:
        raise CodecError(f"field 'valid_response_length' must be >= 0, got {vl}")
    ids, rm = obj.get("ids"), obj.get("rm")
    return Trajectory(
        batch_id=obj["b"],
        index=obj["i"],
        data_source=obj["ds"],
        response=obj["r"],
        ground_truth=obj.get("gt"),
        uid=obj["u"],
        prompt=obj.get("p"),
        response_ids=unpack_ids(ids) if ids is not None else None,
        valid_response_length=vl,
        max_response_length=obj.get("ml"),
        extra_info=obj.get("x") or {},
        group=obj.get("g"),
        rm_score=float(rm) if rm is not None else None,
    )


_field_values = {
    "u": st.none() | st.text(max_size=6) | st.integers(-2, 2) | st.booleans(),
    "b": st.none() | st.text(max_size=6) | st.integers(-2, 2),
    "i": st.none() | st.integers(-3, 3) | st.booleans() | st.floats(allow_nan=False) | st.text(max_size=2),
    "ds": st.none() | st.text(max_size=6) | st.integers(0, 2),
    "r": st.none() | st.text(max_size=6) | st.integers(0, 2) | st.binary(max_size=4),
    "gt": json_values,
    "p": st.none() | st.text(max_size=6) | st.integers(0, 2),
    "ids": st.none()
    | st.binary(max_size=8).map(lambda b: b[: len(b) // 4 * 4])
    | st.lists(st.integers(0, 9), max_size=3),
    "vl": st.none() | st.integers(-3, 3) | st.booleans() | st.floats(allow_nan=False),
    "ml": st.none() | st.integers(-3, 3) | st.booleans() | st.text(max_size=2),
    "x": st.none()
    | st.dictionaries(st.text(max_size=3), st.integers(-5, 5), max_size=2)
    | st.lists(st.integers(-5, 5), max_size=2),
    "g": st.none() | st.text(max_size=4) | st.integers(0, 3),
    "rm": st.none() | st.integers(-3, 3) | st.floats(allow_nan=False) | st.booleans() | st.text(max_size=2),
}


_valid_values = {
    "u": st.text(max_size=6),
    "b": st.text(max_size=6),
    "i": st.integers(0, 3),
    "ds": st.text(max_size=6),
    "r": st.text(max_size=6),
    "gt": json_values,
    "p": st.none() | st.text(max_size=6),
    "ids": st.none() | st.binary(max_size=8).map(lambda b: b[: len(b) // 4 * 4]),
    "vl": st.none() | st.integers(0, 3),
    "ml": st.none() | st.integers(-3, 3),
    "x": st.none() | st.dictionaries(st.text(max_size=3), st.integers(-5, 5), max_size=2),
    "g": st.none() | st.text(max_size=4),
    "rm": st.none() | st.integers(-3, 3) | st.floats(allow_nan=False),
}


@st.composite
def _payloads(draw: st.DrawFn) -> dict:
    """A valid payload, then up to two fields given any value of the wide strategies
    (None: dropped) and the keys in any order: mostly near the line between a sample
    and a precise error."""
    obj = {"v": SCHEMA_VERSION, **{k: draw(v) for k, v in _valid_values.items()}}
    for key in draw(st.lists(st.sampled_from(sorted(_field_values)), max_size=2, unique=True)):
        value = draw(_field_values[key])
        if value is None and draw(st.booleans()):
            del obj[key]
        else:
            obj[key] = value
    return dict(draw(st.permutations(list(obj.items()))))


def test_round_trip_keeps_every_field():
    traj = full_trajectory()
    assert decode_trajectory(encode_trajectory(traj)) == traj


def test_minimal_trajectory_gets_default_uid():
    traj = decode_trajectory(encode_trajectory(Trajectory("b7", 5, "x", response="r")))
    assert traj.uid == "b7/5"
    assert traj.response_ids is None and traj.extra_info == {}


def test_token_ids_are_packed_four_bytes_each():
    ids = list(range(1000))
    assert len(pack_ids(ids)) == 4000
    assert unpack_ids(pack_ids(ids)) == ids
    with pytest.raises(CodecError, match="multiple of 4"):
        unpack_ids(b"\x00\x01\x02")


def test_garbage_is_a_codec_error():
    with pytest.raises(CodecError, match="not valid msgpack"):
        decode_trajectory(b"\xc1\xff\x00garbage")


def test_non_map_payload_is_rejected():
    with pytest.raises(CodecError, match="must be a msgpack map"):
        decode_trajectory(msgpack.packb([1, 2, 3]))


def test_wrong_schema_version_is_precise():
    payload = msgpack.packb({"v": SCHEMA_VERSION + 1, "u": "u", "b": "b", "i": 0, "ds": "x"})
    with pytest.raises(SchemaVersionError, match=f"schema version {SCHEMA_VERSION + 1}"):
        decode_trajectory(payload)


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"i": None}, "missing field 'index'"),
        ({"i": "3"}, "field 'index' must be int, got str"),
        ({"i": True}, "field 'index' must be int, got bool"),
        ({"i": -1}, "must be >= 0"),
        ({"ds": 5}, "field 'data_source' must be str"),
        ({"x": [1]}, "field 'extra_info' must be dict"),
        ({"vl": -2}, "valid_response_length"),
        ({"ids": [1, 2]}, "field 'response_ids' must be bytes"),
    ],
)
def test_wrong_fields_are_named(patch, message):
    obj = msgpack.unpackb(encode_trajectory(full_trajectory()))
    obj.update(patch)
    obj = {k: v for k, v in obj.items() if v is not None}
    with pytest.raises(CodecError, match=message):
        decode_trajectory(msgpack.packb(obj, use_bin_type=True))


def test_oversized_payload_is_refused_both_ways():
    traj = Trajectory("b", 0, "x", response="y" * 5000)
    with pytest.raises(PayloadTooLargeError):
        encode_trajectory(traj, max_bytes=1000)
    data = encode_trajectory(traj)
    with pytest.raises(PayloadTooLargeError, match="over the maximum of 1000"):
        decode_trajectory(data, max_bytes=1000)


def test_result_round_trip_and_unencodable_extra():
    result = ScoreResult(
        "u",
        "b",
        1,
        0.5,
        "failed",
        {"k": [1, 2]},
        reason="timeout",
        error="slow",
        attempts=3,
        valid_response_length=7,
        data_source="d",
        group="g",
        scored_at=12.5,
    )
    assert decode_result(encode_result(result)) == result
    # What a collected batch keeps of it (trainer/aggregator.py: BatchRewards), every field in place.
    assert ScoreResult.from_record(result.record(), result.extra) == result
    odd = ScoreResult("u", "b", 1, 1.0, extra={"s": {1, 2}, "obj": object()})
    decoded = decode_result(encode_result(odd))
    assert decoded.score == 1.0 and isinstance(decoded.extra["s"], str)


def test_trajectory_from_json_names_bad_fields():
    assert trajectory_from_json({"response": "r", "data_source": "d", "zzz": 1}, "b", 2).index == 2
    with pytest.raises(ValueError, match="missing required field 'response'"):
        trajectory_from_json({"data_source": "d"}, "b", 0)
    with pytest.raises(ValueError, match="'valid_response_length' must be int"):
        trajectory_from_json({"response": "r", "data_source": "d", "valid_response_length": "5"}, "b", 0)
    with pytest.raises(ValueError, match="list of integers"):
        trajectory_from_json({"response": "r", "data_source": "d", "response_ids": [1, "a"]}, "b", 0)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_decode_or_raise_codec_error(data):
    try:
        traj = decode_trajectory(data)
    except CodecError:
        return
    assert isinstance(traj, Trajectory)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["v", "u", "b", "i", "ds", "r", "gt", "ids", "vl", "x", "g", "rm", "p"]), json_values
    )
)
def test_arbitrary_records_decode_or_raise_codec_error(obj):
    try:
        traj = decode_trajectory(msgpack.packb(obj, use_bin_type=True))
    except CodecError:
        return
    assert isinstance(traj.index, int) and traj.index >= 0
    assert isinstance(traj.batch_id, str) and isinstance(traj.data_source, str)


@settings(max_examples=1500, deadline=None)
@given(_payloads())
def test_the_fast_check_accepts_and_names_exactly_what_the_reference_decoder_does(obj):
    try:
        want: object = _reference_decode(obj)
    except CodecError as exc:
        want = (type(exc), str(exc))
    try:
        got: object = decode_trajectory(msgpack.packb(obj, use_bin_type=True))
    except CodecError as exc:
        got = (type(exc), str(exc))
    assert got == want


def test_every_record_carries_the_one_protocol_version() -> None:
    from stream_reward.wire import codec

    traj = msgpack.unpackb(encode_trajectory(Trajectory("b", 0, "x", response="r")))
    assert traj["v"] == PROTOCOL_VERSION
    assert msgpack.unpackb(encode_result(ScoreResult("u", "b", 0, 1.0)))[0] == PROTOCOL_VERSION
    assert PROTOCOL_VERSION >= 2  # bumped when results became positional arrays
    assert codec.SCHEMA_VERSION == PROTOCOL_VERSION


def test_codec_rows_round_trip_and_fail_their_own_sample() -> None:
    r = ScoreResult("u", "b", 3, 1, "ok", {"n": {"x": [1]}}, None, None, 2, 7, "ds", "g", 1.5)
    row = msgpack.unpackb(encode_result(r))
    back = result_from_row(row)
    assert back == dataclasses.replace(r, score=1.0) and type(back.score) is float
    assert stored_result(row) == back
    foreign = stored_result([PROTOCOL_VERSION + 7, "u", "b", 3, "anything"])
    assert (foreign.uid, foreign.index, foreign.batch_id, foreign.status, foreign.reason) == (
        "u",
        3,
        "b",
        "failed",
        "schema_version",
    )
    assert foreign.extra == {} and foreign.score == 0.0
    assert stored_result([PROTOCOL_VERSION, 5, "b"]) is None
    # Two failed results of unreadable rows never share an extra.
    a, b = stored_result([99, "a", 1, 0]), stored_result([99, "b", None, 1])
    assert a.batch_id == "" and b.batch_id == ""
    a.extra["k"] = 1
    assert b.extra == {}
