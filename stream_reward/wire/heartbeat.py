"""The heartbeat record: what each worker process writes to the namespace's ``workers`` hash.

Written by the worker every ``heartbeat_interval_s`` (a msgpack map under its
consumer name) and read by ``status``, ``worker --check`` and the metrics
endpoint. This module is the one place that knows its shape and when a worker
counts as alive.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack

__all__ = ["ALIVE_FACTOR", "encode_heartbeat", "decode_heartbeat", "parse_heartbeats", "server_time", "text"]

ALIVE_FACTOR = 3  # a heartbeat older than this many intervals means the worker is not alive


def text(value: Any) -> Any:
    """Redis replies may be bytes (RESP2) or str: names and values read as text."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _text_tree(value: Any) -> Any:
    if isinstance(value, dict):
        return {text(k): _text_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_text_tree(v) for v in value]
    return text(value)


async def server_time(client: Any) -> float:
    """The Redis server's clock (TIME), in seconds: the one clock every process shares.
    A heartbeat's ``seen`` and every age judged from it use it, so a client whose own
    clock is off (an hour behind, an hour ahead) is judged by when Redis saw it."""
    seconds, micros = await client.time()
    return int(seconds) + int(micros) / 1e6


def encode_heartbeat(beat: Mapping[str, Any]) -> bytes:
    """``beat`` holds at least ``seen`` (the server's clock, see ``server_time``); the rest is the worker's counters."""
    return msgpack.packb(dict(beat))


def decode_heartbeat(packed: bytes) -> dict[str, Any] | None:
    """The record, or None for a value that is not a heartbeat (never let one bad value hide the others)."""
    try:
        beat = _text_tree(msgpack.unpackb(packed, raw=False))
    except (ValueError, msgpack.UnpackException, RecursionError):  # RecursionError: nested past Python's limit
        return None
    return beat if isinstance(beat, dict) else None


def parse_heartbeats(raw: Mapping[Any, bytes], *, interval_s: float, now: float) -> dict[str, dict[str, Any]]:
    """Consumer name -> heartbeat, with ``age_s`` and ``alive`` added, from the hash's HGETALL reply."""
    beats = {}
    for name, packed in raw.items():
        beat = decode_heartbeat(packed)
        if beat is None:
            continue
        try:
            seen = float(beat.get("seen", 0) or 0)
        except (TypeError, ValueError):
            continue
        beat["age_s"] = round(max(0.0, now - seen), 3)
        beat["alive"] = now - seen <= ALIVE_FACTOR * interval_s
        beats[text(name)] = beat
    return beats
