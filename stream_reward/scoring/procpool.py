"""A pool of scorer processes that can be killed: the home of sync, CPU-heavy or
hang-prone ``compute_score`` functions.

Threads cannot be killed, so a sync scorer that hangs in a thread is abandoned,
holding its slot forever. Here each call goes to a child process over a pipe
(length-prefixed msgpack); on timeout the child's whole process group is
SIGKILLed and a fresh child takes its place on the next call. A child that dies
mid-call fails that one sample (``scorer_crashed``), nothing else.

With ``timeout_score`` set, a per-sample timeout is the sample's loss instead of a
failure: the scorer's own input was too costly to score (verl's ``timeout_score`` of its
math-verify scorer), so the sample gets that score and ``timeout: True`` in its extra info.

Children are plain ``python -m stream_reward.scoring.procpool_child SPEC`` processes, so
they import the user's function themselves (no pickling of functions loaded
from a file path) and start without copying the parent's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import struct
import sys
from typing import Any

import msgpack

from stream_reward.errors import ScorerCrashedError, ScorerTimeoutError, ScoringError
from stream_reward.scoring.scorer import Scored
from stream_reward.wire.trajectory import Trajectory

__all__ = ["ProcessPool"]

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">I")


def traj_call_args(traj: Trajectory) -> list[Any]:
    """verl's positional arguments for one sample: data_source, solution_str, ground_truth, extra_info."""
    return [traj.data_source, traj.response, traj.ground_truth, traj.extra_info]


class _Child:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def request(self, message: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        data = msgpack.packb(message, use_bin_type=True)
        self.proc.stdin.write(_HEADER.pack(len(data)) + data)
        await self.proc.stdin.drain()
        header = await self.proc.stdout.readexactly(_HEADER.size)
        (size,) = _HEADER.unpack(header)
        return msgpack.unpackb(await self.proc.stdout.readexactly(size), raw=False, strict_map_key=False)

    def kill(self) -> None:
        # The child runs in its own session: killing the group also takes any
        # helper processes the scorer started.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


class ProcessPool:
    """``size`` scorer processes running ``spec`` (see ``scoring.load_function``).

    ``timeout_s`` bounds each call; ``reward_kwargs`` are passed to every call,
    as verl's ``reward_kwargs`` are. ``timeout_score``, when set, is what a sample whose
    call ran past ``timeout_s`` scores (status ok) instead of failing.
    """

    def __init__(
        self,
        spec: str,
        *,
        size: int | None = None,
        timeout_s: float = 30.0,
        reward_kwargs: dict[str, Any] | None = None,
        start_timeout_s: float = 60.0,
        timeout_score: float | None = None,
    ) -> None:
        self.spec = spec
        self.size = size or os.cpu_count() or 1
        self.timeout_s = timeout_s
        self.reward_kwargs = reward_kwargs or {}
        self.start_timeout_s = start_timeout_s
        self.timeout_score = timeout_score
        self.kills = 0
        self._idle: list[_Child] = []
        self._slots: asyncio.Semaphore | None = None  # created inside the running loop
        self._all: set[_Child] = set()

    async def _spawn(self) -> _Child:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "stream_reward.scoring.procpool_child",
            self.spec,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=None,
            start_new_session=True,
            limit=2**26,
        )
        child = _Child(proc)
        self._all.add(child)
        try:
            ready = await asyncio.wait_for(child.request(["ping"]), self.start_timeout_s)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, BrokenPipeError, ConnectionResetError) as exc:
            self._discard(child)
            raise ScorerCrashedError(
                f"scorer process for {self.spec!r} failed to start ({type(exc).__name__})", reason="scorer_start"
            ) from None
        if not ready[0]:
            self._discard(child)
            raise ScoringError(f"scorer {self.spec!r} failed to load: {ready[2]}", reason="scorer_load")
        return child

    def _discard(self, child: _Child) -> None:
        child.kill()
        self._all.discard(child)
        with contextlib.suppress(Exception):
            child.proc._transport.close()  # type: ignore[attr-defined]

    async def _call(self, message: list[Any], timeout_s: float) -> Any:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.size)
        async with self._slots:
            child = self._idle.pop() if self._idle else await self._spawn()
            try:
                reply = await asyncio.wait_for(child.request(message), timeout_s)
            except asyncio.TimeoutError:  # TimeoutError from 3.11 on; not yet on 3.10
                self.kills += 1
                child.kill()
                await _exit_code(child)  # reaped by asyncio's watcher first: see aclose
                self._discard(child)
                raise ScorerTimeoutError(f"scorer ran past its {timeout_s:g}s timeout and was killed") from None
            except (asyncio.IncompleteReadError, BrokenPipeError, ConnectionResetError):
                code = await _exit_code(child)
                self._discard(child)
                raise ScorerCrashedError(f"scorer process died (exit code {code})") from None
            except BaseException:
                # Cancelled mid-call: the child's state is unknown, do not reuse it.
                self._discard(child)
                raise
            self._idle.append(child)
        if not reply[0]:
            reason = reply[3] if len(reply) > 3 and isinstance(reply[3], str) and reply[3] else "scorer_error"
            raise ScoringError(f"{reply[1]}: {reply[2]}", reason=reason)
        return reply[1]

    async def score(self, traj: Trajectory) -> Scored:
        try:
            score, extra = await self._call(["one", traj_call_args(traj), self.reward_kwargs], self.timeout_s)
        except ScorerTimeoutError:
            if self.timeout_score is None:
                raise
            return Scored(self.timeout_score, {"timeout": True})
        return Scored(score, extra)

    async def score_batch(self, trajs: list[Trajectory]) -> list[Scored | ScoringError]:
        """One batched ``compute_score(data_sources=..., ...)`` call for all of ``trajs``."""
        args = [traj_call_args(t) for t in trajs]
        rows = await self._call(["batch", args, self.reward_kwargs], self.timeout_s)
        out: list[Scored | ScoringError] = []
        for row in rows:
            if row[0]:
                out.append(Scored(row[1], row[2]))
            else:
                out.append(ScoringError(row[1], reason=row[2] if len(row) > 2 else "scorer_error"))
        return out

    async def aclose(self) -> None:
        for child in list(self._all):
            if child.proc.stdin is not None:
                with contextlib.suppress(Exception):
                    child.proc.stdin.close()
            child.kill()
            # Waited for before its transport closes: closing first would reap the killed child
            # behind the back of asyncio's watcher, which logs "Unknown child process pid".
            with contextlib.suppress(Exception):
                await asyncio.wait_for(child.proc.wait(), 2)
            self._discard(child)
        self._idle.clear()


async def _exit_code(child: _Child) -> int | None:
    with contextlib.suppress(asyncio.TimeoutError):  # not yet TimeoutError on 3.10
        return await asyncio.wait_for(child.proc.wait(), 1.0)
    return None
