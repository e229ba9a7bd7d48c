"""Where ``bench verl_loop`` runs its RewardLoopWorkers: one per side in the bench's
process (``in_process``), or ``--loop-workers K`` per side in K processes
(``LoopPool``), as verl's ``RewardLoopManager`` runs ``reward.num_workers`` of them
as Ray actors and the agent loop spreads its samples over them.

Each of the K child processes builds verl's ``RewardLoopWorker`` for both sides once
(verl's naive manager, and StreamRewardLoopManager through the three overrides), then
plays rounds on command: its share of the rows (n/K, the share ``random.choice`` over
K actors gives on average), all in flight, timed as ``one_round`` times them. The
parent releases every child at once; a round's wall is the latest end minus the
earliest start, both ``time.monotonic`` (CLOCK_MONOTONIC, one clock for every
process here).

stream-reward's K managers share ONE pipeline, as on Ray they share the job's actor
(``stream_reward.verl.shared``): one embedded server and ``--processes`` workers
started here, given to every child's manager by ``reward_kwargs.redis_url`` and
``namespace`` (a manager with a URL and no ``num_workers`` starts no workers of its
own). The workers' flags are ``LoopOptions.worker_args()`` of the children's own
config, as the shared actor's are: the same scorer, function and kwargs.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import time
import traceback
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from stream_reward.bench._common import Workers, quiet_server

__all__ = ["LoopPool", "compose", "in_process", "one_round"]

NAMESPACE = "verl-loop"
# K children (verl's default: 8) importing verl, torch, transformers and Ray at once on a small machine.
_START_S = 300.0
# Longer than a batch's default deadline (600 s): a stuck sample fails in its child,
# with its cause, before the parent gives up on the round.
_ROUND_S = 900.0
_STOP_S = 15.0


def compose(tokenizer_dir: str, *overrides: str) -> Any:
    import verl  # type: ignore[import-not-found]
    from hydra import compose as hydra_compose  # type: ignore[import-not-found]
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra  # type: ignore[import-not-found]
    from omegaconf import OmegaConf  # type: ignore[import-not-found]

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        config = hydra_compose(
            config_name="ppo_trainer", overrides=[f"actor_rollout_ref.model.path={tokenizer_dir}", *overrides]
        )
    OmegaConf.resolve(config)
    return config


async def one_round(worker: Any, rows: list[Any]) -> tuple[float, list[float], list[float]]:
    async def timed(row: Any) -> tuple[float, float]:
        start = time.perf_counter()
        out = await worker.compute_score(row)
        return time.perf_counter() - start, float(out["reward_score"])

    start = time.perf_counter()
    results = await asyncio.gather(*(timed(row) for row in rows))
    elapsed = time.perf_counter() - start
    return elapsed, [r[0] * 1000 for r in results], [r[1] for r in results]


async def in_process(
    stack: contextlib.AsyncExitStack, tokdir: str, rows: list[Any], theirs: list[str], ours: list[str]
) -> Callable[[str], Awaitable[tuple[float, list[float], list[float]]]]:
    """One RewardLoopWorker per side in this process; ``play(side)`` runs one round of it."""
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker  # type: ignore[import-not-found]

    from stream_reward.bench import _verl_verifier_fn

    workers = {"verl": RewardLoopWorker(compose(tokdir, *theirs))}
    stack.push_async_callback(_verl_verifier_fn.close_sessions)
    workers["stream_reward"] = RewardLoopWorker(compose(tokdir, *ours))
    stack.callback(workers["stream_reward"].reward_manager.close)

    async def play(side: str) -> tuple[float, list[float], list[float]]:
        return await one_round(workers[side], rows)

    return play


def split(rows: list[Any], k: int) -> list[list[Any]]:
    """``rows`` in ``k`` contiguous shares as even as possible (concatenated, the rows in order)."""
    size, extra = divmod(len(rows), k)
    out, start = [], 0
    for i in range(k):
        end = start + size + (i < extra)
        out.append(rows[start:end])
        start = end
    return out


class LoopPool:
    """``async with LoopPool(k, tokdir, rows, theirs, ours, processes) as pool:
    await pool.round("verl")``. ``theirs`` / ``ours`` are each side's Hydra overrides;
    the pool adds the shared pipeline's URL and namespace to ``ours``. The children,
    the workers and the server are gone when the block ends, however it ends."""

    def __init__(
        self, k: int, tokdir: str, rows: list[Any], theirs: list[str], ours: list[str], processes: int
    ) -> None:
        self._k, self._tokdir, self._rows = k, tokdir, rows
        self._theirs, self._ours, self._processes = theirs, ours, processes
        self._stack = contextlib.ExitStack()
        self._children: list[tuple[Any, Connection]] = []

    async def __aenter__(self) -> LoopPool:
        try:
            await self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stack.close()  # children first, then the workers, then the server

    async def _start(self) -> None:
        from stream_reward.verl.options import LoopOptions

        server = self._stack.enter_context(quiet_server())
        ours = [
            *self._ours,
            f"+reward.reward_kwargs.redis_url='{server.url}'",
            f"+reward.reward_kwargs.namespace={NAMESPACE}",
        ]
        options = LoopOptions.from_verl(compose(self._tokdir, *ours))
        # The server goes with the bench: a drain would hand samples back to nobody.
        worker_args = [*options.worker_args(), "--drain-timeout-s", "0"]
        workers = self._stack.enter_context(Workers(server.url, NAMESPACE, self._processes, *worker_args))
        await workers.ready()
        self._stack.callback(self._stop_children)
        context = multiprocessing.get_context("spawn")  # a fork would copy this process's threads and loop
        for share in split(self._rows, self._k):
            mine, theirs_end = context.Pipe()
            proc = context.Process(
                target=_child,
                args=(theirs_end, os.getpid(), self._tokdir, self._theirs, ours, share),
                name=f"verl-loop-worker-{len(self._children)}",
                daemon=True,
            )
            proc.start()
            theirs_end.close()  # the child's end lives in the child: its death is our EOF
            self._children.append((proc, mine))
        await asyncio.to_thread(self._collect, _START_S)

    async def round(self, side: str) -> tuple[float, list[float], list[float]]:
        """One round of ``side`` on every child at once: (wall s, latencies ms, scores in row order)."""
        for _, conn in self._children:
            conn.send(("round", side))
        replies = await asyncio.to_thread(self._collect, _ROUND_S)
        elapsed = max(reply[2] for reply in replies) - min(reply[1] for reply in replies)
        latencies = [ms for reply in replies for ms in reply[3]]
        scores = [score for reply in replies for score in reply[4]]
        return elapsed, latencies, scores

    def _collect(self, timeout_s: float) -> list[tuple[Any, ...]]:
        """Every child's reply, in child order; raises naming a child that failed or died."""
        index = {conn: i for i, (_, conn) in enumerate(self._children)}
        replies: dict[int, tuple[Any, ...]] = {}
        deadline = time.monotonic() + timeout_s
        while len(replies) < len(self._children):
            pending = [conn for conn, i in index.items() if i not in replies]
            ready = wait(pending, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise RuntimeError(f"{len(pending)} of {self._k} loop-worker processes silent for {timeout_s:.0f} s")
            for conn in ready:
                assert isinstance(conn, Connection)
                proc = self._children[index[conn]][0]
                try:
                    reply = conn.recv()
                except EOFError:
                    proc.join(timeout=1.0)
                    raise RuntimeError(f"loop-worker process {proc.pid} exited (code {proc.exitcode})") from None
                if reply[0] == "error":
                    raise RuntimeError(f"loop-worker process {proc.pid} failed:\n{reply[1]}")
                replies[index[conn]] = reply
        return [replies[i] for i in range(len(self._children))]

    def _stop_children(self) -> None:
        for _, conn in self._children:
            with contextlib.suppress(OSError):
                conn.send(("stop",))
        deadline = time.monotonic() + _STOP_S
        for proc, conn in self._children:
            # A child mid-round (the bench failed elsewhere) reads "stop" only after it.
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
            conn.close()
        self._children.clear()


def _child(conn: Connection, parent: int, tokdir: str, theirs: list[str], ours: list[str], rows: list[Any]) -> None:
    from stream_reward.ops.embedded import die_with_parent

    die_with_parent()  # a SIGKILLed bench takes its children along
    if os.getppid() != parent:
        return  # it died before the line above
    # The parent's stdout carries the bench's one JSON object: nothing printed here may land there.
    os.dup2(2, 1)
    try:
        asyncio.run(_serve(conn, tokdir, theirs, ours, rows))
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


async def _serve(conn: Connection, tokdir: str, theirs: list[str], ours: list[str], rows: list[Any]) -> None:
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker  # type: ignore[import-not-found]

    from stream_reward.bench import _verl_verifier_fn

    # Built on the running loop, as in one process: RewardLoopWorker keeps get_event_loop()'s.
    workers = {"verl": RewardLoopWorker(compose(tokdir, *theirs))}
    try:
        workers["stream_reward"] = RewardLoopWorker(compose(tokdir, *ours))
        conn.send(("ready",))
        while True:
            try:
                command = await asyncio.to_thread(conn.recv)
            except EOFError:
                return  # the parent is gone
            if command[0] != "round":
                return
            start = time.monotonic()
            _, latencies, scores = await one_round(workers[command[1]], rows)
            conn.send(("done", start, time.monotonic(), latencies, scores))
    finally:
        if "stream_reward" in workers:
            workers["stream_reward"].reward_manager.close()
        await _verl_verifier_fn.close_sessions()
