"""``reward_func(...)``: a TRL reward function whose scoring runs on stream-reward workers.

One call of the returned function is one batch: the completions are pushed as a
batch of their own, the workers score them (quota, retries, timeouts and the DLQ as
on every path), and the answers come back in TRL's order. A sample we failed to
score is ``None``, which TRL 1.16 turns into NaN and leaves out of that function's
reward (``nansum`` over functions, ``nanmean`` in its logs): never a 0 the policy
would learn from.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from stream_reward.config import DEFAULT_NAMESPACE, BatchPolicy, check_namespace
from stream_reward.errors import CodecError, ConfigError
from stream_reward.trl.columns import trajectories
from stream_reward.trl.shared import Pool, PoolKey, pool, run_on_loop
from stream_reward.wire.codec import encode_trajectory
from stream_reward.wire.trajectory import Trajectory, default_uid

__all__ = ["reward_func", "TRLRewardFunc"]

log = logging.getLogger(__name__)

TRLRewardFunc = Callable[..., Awaitable[list[float | None]]]

# The collect outlives the batch deadline by this much: at the deadline the missing
# samples resolve as failed, and collect returns them; this only bounds a Redis stall.
_COLLECT_SLACK_S = 60.0
_ids = itertools.count(1)


def reward_func(
    redis_url: str | None = None,
    *,
    scorer: str | None = None,
    config: str | os.PathLike[str] | None = None,
    ground_truth_key: str | None = "solution",
    data_source: str | None = None,
    name: str | None = None,
    namespace: str = DEFAULT_NAMESPACE,
    timeout_s: float = 600.0,
    processes: int = 2,
) -> TRLRewardFunc:
    """A TRL reward function: ``GRPOTrainer(reward_funcs=[reward_func(scorer="rules")])``.

    ``redis_url`` None: the first call starts (once per process) an embedded server and
    ``processes`` local workers with ``scorer`` / ``config`` (the worker's ``--scorer``
    / ``--config``), stopped at interpreter exit. With a URL the function only pushes
    and collects; workers started elsewhere (``stream-reward worker``) score.

    ``ground_truth_key``: the dataset column with the answer (None: no ground truth).
    ``data_source``: the scorer route for every sample; without it, the dataset's
    ``data_source`` column. Every other column reaches the scorer as ``extra_info``,
    and the prompt (the last user message of a conversational one) as the prompt.
    ``timeout_s``: the batch deadline; samples not scored by then are ``None``.
    ``name``: what TRL logs the rewards under (``rewards/<name>/mean``).
    """
    key = _key(redis_url, scorer, config, namespace, processes)
    if not (timeout_s > 0):
        raise ConfigError("timeout_s", f"must be > 0, got {timeout_s!r}")
    if ground_truth_key is not None and not isinstance(ground_truth_key, str):
        raise ConfigError("ground_truth_key", f"must be a column name or None, got {ground_truth_key!r}")
    if data_source is not None and (not isinstance(data_source, str) or not data_source):
        raise ConfigError("data_source", f"must be a non-empty string or None, got {data_source!r}")
    label = name or "stream_reward"
    policy = BatchPolicy(on_failure="mask", deadline_s=timeout_s)

    async def stream_reward(
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]] | None = None,
        **columns: Any,
    ) -> list[float | None]:
        # Bad input fails here, in the caller, before anything is started or enqueued.
        trajs = trajectories(
            prompts,
            completions,
            completion_ids,
            columns,
            ground_truth_key=ground_truth_key,
            data_source=data_source,
        )
        if not trajs:
            return []
        scores, failed = await run_on_loop(_score(key, trajs, policy, timeout_s))
        if failed:
            reasons: dict[str, int] = {}
            for reason, _ in failed.values():
                reasons[reason] = reasons.get(reason, 0) + 1
            first = next(iter(failed.items()))
            log.warning(
                "%s: %d of %d samples not scored (%s), returned as None; e.g. sample %d: %s",
                label,
                len(failed),
                len(trajs),
                ", ".join(f"{r}: {c}" for r, c in sorted(reasons.items())),
                first[0],
                first[1][1],
            )
        log_metric = columns.get("log_metric")
        if callable(log_metric):  # TRL >= 1.x: averaged per logging step beside its own metrics
            log_metric(f"{label}/failed_frac", len(failed) / len(trajs))
        return scores

    stream_reward.__name__ = label
    stream_reward.__qualname__ = label
    return stream_reward


def _key(
    redis_url: str | None,
    scorer: str | None,
    config: str | os.PathLike[str] | None,
    namespace: str,
    processes: int,
) -> PoolKey:
    check_namespace(namespace)
    config_path = None
    if config is not None:
        path = Path(config).expanduser().resolve()
        if not path.is_file():
            raise ConfigError("config", f"no such file {str(path)!r}")
        config_path = str(path)
    if redis_url is not None:
        if scorer is not None or config_path is not None:
            given = "scorer" if scorer is not None else "config"
            raise ConfigError(
                given,
                "with a redis_url the workers run elsewhere and load their own scorer "
                "(stream-reward worker --redis URL --scorer SPEC); give one or the other",
            )
        return PoolKey(redis_url, namespace, None, None, 0)
    if not isinstance(processes, int) or processes < 1:
        raise ConfigError("processes", f"local workers must be >= 1, got {processes!r}")
    return PoolKey(None, namespace, scorer, config_path, processes)


async def _score(
    key: PoolKey, trajs: list[Trajectory], policy: BatchPolicy, timeout_s: float
) -> tuple[list[float | None], dict[int, tuple[str, str]]]:
    """On the runtime's loop: one batch. Scores in order (None where failed) and the
    failed samples' ``index -> (reason, error)``."""
    # The first call starts the server and workers, here on the runtime's thread: the
    # kernel stops a child when the thread that started it ends (PR_SET_PDEATHSIG), and
    # the caller's thread may be gone long before the trainer is (a thread of its own,
    # asyncio.run's executor).
    target: Pool = pool(key)
    producer, aggregator = target.clients()
    batch_id = f"trl-{os.getpid()}-{uuid.uuid4().hex[:8]}-{next(_ids)}"
    batch = [
        dataclasses.replace(traj, batch_id=batch_id, index=i, uid=default_uid(batch_id, i))
        for i, traj in enumerate(trajs)
    ]
    width = max((traj.valid_response_length or 1 for traj in batch), default=1)

    async def run() -> Any:
        await producer.open_batch(batch_id, len(batch), width, policy=policy)
        try:
            await producer.push_many(batch)
        except CodecError:  # push_many encodes all before it sends any: nothing is queued
            await _push_each(producer, batch)
        return await aggregator.collect(batch_id, timeout_s=timeout_s + _COLLECT_SLACK_S, on_timeout="resolve")

    rewards = await target.guard(run())
    scores: list[float | None] = []
    failed: dict[int, tuple[str, str]] = {}
    for i, (score, status) in enumerate(zip(rewards.scores, rewards.status)):
        if status == "ok":
            scores.append(float(score))
        else:
            scores.append(None)
            failed[i] = (rewards.results[i].reason or "failed", rewards.errors[i] or "")
    return scores, failed


async def _push_each(producer: Any, batch: list[Trajectory]) -> None:
    """Push the samples the stream can carry; fail the others, each on its own (a column
    over the message limit, an integer msgpack cannot hold), as the ``score`` command
    fails an oversized line: the step goes on, those samples are None."""
    good = []
    for traj in batch:
        try:
            encode_trajectory(traj, producer.config.max_message_bytes)
        except CodecError as exc:
            error = f"cannot be queued: {exc}"
            await producer.fail(traj.batch_id, traj.index, reason="bad_input", error=error, uid=traj.uid)
        else:
            good.append(traj)
    await producer.push_many(good)
