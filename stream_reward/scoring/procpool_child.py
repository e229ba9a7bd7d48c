"""Child side of ``procpool``: load one scorer, answer calls over stdin/stdout.

Requests and replies are length-prefixed msgpack frames. The protocol keeps the
original stdout descriptor; fd 1 is pointed at stderr so that a user's
``print`` cannot corrupt the frames.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import struct
import sys
from typing import Any, BinaryIO

import msgpack

from stream_reward.errors import ScoringError
from stream_reward.scoring.scorer import load_function, normalize
from stream_reward.wire.codec import to_plain

_HEADER = struct.Struct(">I")


def _read(stream: BinaryIO) -> Any:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    return msgpack.unpackb(stream.read(size), raw=False, strict_map_key=False)


def _write(stream: BinaryIO, message: Any) -> None:
    data = msgpack.packb(message, use_bin_type=True, default=repr)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _resolve(value: Any) -> Any:
    if inspect.isawaitable(value):
        return asyncio.run(_await(value))
    return value


async def _await(value: Any) -> Any:
    return await value


def _one(fn: Any, args: list[Any], kwargs: dict[str, Any]) -> list[Any]:
    data_source, solution_str, ground_truth, extra_info = args
    scored = normalize(_resolve(fn(data_source, solution_str, ground_truth, extra_info, **kwargs)))
    return [True, [scored.score, {k: to_plain(v) for k, v in scored.extra.items()}]]


def _batch(fn: Any, rows: list[list[Any]], kwargs: dict[str, Any]) -> list[Any]:
    values = _resolve(
        fn(
            data_sources=[r[0] for r in rows],
            solution_strs=[r[1] for r in rows],
            ground_truths=[r[2] for r in rows],
            extra_infos=[r[3] for r in rows],
            **kwargs,
        )
    )
    values = list(values)
    if len(values) != len(rows):
        raise ValueError(f"batched scorer returned {len(values)} results for {len(rows)} samples")
    out = []
    for value in values:
        try:
            scored = normalize(value)
            out.append([True, scored.score, {k: to_plain(v) for k, v in scored.extra.items()}])
        except ScoringError as exc:
            out.append([False, str(exc), exc.reason])
    return out


def main() -> None:
    spec = sys.argv[1]
    proto_in = sys.stdin.buffer
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        fn = load_function(spec)
        load_error = None
    except Exception as exc:
        fn, load_error = None, f"{type(exc).__name__}: {exc}"
    while True:
        request = _read(proto_in)
        if request is None:
            return
        kind = request[0]
        if kind == "ping":
            _write(proto_out, [load_error is None, None, load_error])
            continue
        try:
            if kind == "one":
                _write(proto_out, _one(fn, request[1], request[2]))
            elif kind == "batch":
                _write(proto_out, [True, _batch(fn, request[1], request[2])])
            else:
                _write(proto_out, [False, "ProtocolError", f"unknown request {kind!r}"])
        except Exception as exc:
            # A ScoringError's reason (bad_score, no_score, ...) travels with it: the parent
            # records the same reason as for a scorer on its own loop.
            reason = exc.reason if isinstance(exc, ScoringError) else "scorer_error"
            _write(proto_out, [False, type(exc).__name__, str(exc)[:2000], reason])


if __name__ == "__main__":
    try:
        main()
    except (BrokenPipeError, KeyboardInterrupt):
        # The worker went away (or was stopped) mid-request: nothing to report, and
        # a traceback here would land on the terminal after the shell prompt.
        os._exit(0)
