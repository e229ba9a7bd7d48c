"""Hand-packed commands (wire/packed.py) are plain RESP, byte for byte what redis-py sends."""

from __future__ import annotations

import pytest

from stream_reward.wire.packed import pack_command

pytestmark = pytest.mark.anyio


def test_pack_command_is_resp() -> None:
    assert pack_command("SET", b"k\r\n", 12) == b"*3\r\n$3\r\nSET\r\n$3\r\nk\r\n\r\n$2\r\n12\r\n"
    assert pack_command("ECHO", "é") == b"*2\r\n$4\r\nECHO\r\n$2\r\n\xc3\xa9\r\n"
