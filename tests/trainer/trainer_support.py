"""What several trainer test files share: sample makers, an in-process worker that scores
by identity, and looks into the process's result listener (what waits, what is due).

Imported as ``trainer_support`` (pytest puts this folder on the path, as tests/verl does
with verl_support.py); tests/helpers.py holds what the whole suite shares.
"""

from __future__ import annotations

import asyncio

import msgpack
from helpers import Timed, running_worker

from stream_reward import ScoreResult, Trajectory
from stream_reward.wire.codec import encode_result


def graded(batch: str, i: int, right: bool) -> Trajectory:
    """Sample ``i`` of ``batch`` answering its ground truth rightly or not, in GRPO group ``i // 4``."""
    gt = str(1000 + i)
    return Trajectory(batch, i, "test/exact", response=gt if right else gt + "0", ground_truth=gt, group=f"g{i // 4}")


def expected(t: Trajectory) -> float:
    """The score ``worker`` gives ``t``."""
    return t.index + len(t.response) / 1000


def worker(url: str, ns: str, **cfg):
    """An in-process worker scoring by identity (helpers.Timed: index + len(response)/1000)."""
    return running_worker(url, ns, Timed(), **cfg)


def waiters(listener) -> dict:
    streams = [(name, f) for r in listener._readers.values() for name, f in r.streams.items()]
    return {(name, u): list(fs) for name, f in streams for u, fs in f.waiters.items()}


def due(listener) -> int:
    return sum(len(d) for d in listener._due.values())


def clean(listener) -> None:
    assert due(listener) == 0, listener._due
    assert waiters(listener) == {}, waiters(listener)


async def outcome(aw) -> object:
    try:
        return await aw
    except BaseException as exc:  # noqa: BLE001
        return exc


async def settle(aws, timeout_s: float = 10) -> list:
    """Each awaitable's result or exception (all of them within ``timeout_s``)."""
    return await asyncio.wait_for(asyncio.gather(*aws, return_exceptions=True), timeout_s)


def record(batch: str, i: int, uid: str | None = None, score: float = 1.0) -> bytes:
    return encode_result(ScoreResult(uid or f"{batch}/{i}", batch, i, score))


def garbage_row(batch: str, i: int, **over: object) -> bytes:
    row = [3, f"{batch}/{i}", batch, i, 1.0, "ok", 1, 0.0, None, None, None, None, None, None]
    for k, v in over.items():
        row[{"score": 4, "extra": 8, "attempts": 6}[k]] = v
    return msgpack.packb(row, use_bin_type=True)
