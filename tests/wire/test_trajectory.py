"""The trajectory record (wire/trajectory.py): a response that is not a string is bad
input, and a JSONL line with a null response is a bad line.
"""

from __future__ import annotations

import msgpack
import pytest

from stream_reward import Trajectory
from stream_reward.wire.codec import PROTOCOL_VERSION, decode_trajectory, encode_trajectory

pytestmark = pytest.mark.anyio


def test_non_string_response_is_bad_input() -> None:
    from stream_reward.errors import CodecError

    for bad in (None, 5, ["a"]):
        payload = msgpack.packb({"v": PROTOCOL_VERSION, "u": "u", "b": "b", "i": 0, "ds": "x", "r": bad})
        with pytest.raises(CodecError, match="'response'") as info:
            decode_trajectory(payload)
        assert info.value.reason == "bad_input"
    missing = msgpack.packb({"v": PROTOCOL_VERSION, "u": "u", "b": "b", "i": 0, "ds": "x"})
    with pytest.raises(CodecError, match="'response'"):
        decode_trajectory(missing)
    assert decode_trajectory(encode_trajectory(Trajectory("b", 0, "x", response=""))).response == ""


def test_jsonl_null_response_is_a_bad_line() -> None:
    from stream_reward.wire.trajectory import trajectory_from_json

    with pytest.raises(ValueError, match="'response'"):
        trajectory_from_json({"data_source": "x", "response": None}, "b", 0)
