"""Rollout dumps as JSONL: ``produce`` pushes one, ``score`` runs one end to end.

Blank lines are skipped; the sample's index in the batch counts the other
lines, in file order. A malformed line, or one whose payload is over the message
limit, is reported with its line number and resolved as `failed` (reason
``bad_input``); the other lines are still scored. A push that fails half way
resolves what was not pushed as failed, so the batch never stays open for good.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncio_throttle import Throttler

from stream_reward.config import BatchPolicy, ProducerConfig
from stream_reward.errors import ConfigError, PayloadTooLargeError
from stream_reward.trainer.producer import RolloutProducer
from stream_reward.trainer.rewards import BatchRewards
from stream_reward.wire.trajectory import Trajectory, trajectory_from_json

__all__ = ["Rollouts", "read_rollouts", "produce_rollouts", "result_rows"]

log = logging.getLogger(__name__)

# A paced replay pushes one chunk per tick: steady at this granularity, yet one XADD round
# trip per chunk rather than per trajectory, so rates in the thousands per second hold.
PACE_TICK_S = 0.05
_CHUNK = 512


@dataclass
class Rollouts:
    batch_id: str
    trajectories: list[Trajectory]
    bad_lines: dict[int, str]  # index -> error message (with the line number)
    line_of: dict[int, int] = field(default_factory=dict)  # index -> line number in the file

    @property
    def size(self) -> int:
        return len(self.trajectories) + len(self.bad_lines)


def read_rollouts(path: str | Path, batch_id: str) -> Rollouts:
    trajectories: list[Trajectory] = []
    bad: dict[int, str] = {}
    line_of: dict[int, int] = {}
    index = 0
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue  # a blank line (a trailing one, most often) is not a sample
            line_of[index] = line_no
            try:
                obj = json.loads(line)
                trajectories.append(trajectory_from_json(obj, batch_id, index))
            except (json.JSONDecodeError, ValueError) as exc:
                bad[index] = f"line {line_no}: {exc}"
            index += 1
    return Rollouts(batch_id, trajectories, bad, line_of)


async def produce_rollouts(
    redis_url: str,
    rollouts: Rollouts,
    response_len: int,
    config: ProducerConfig | None = None,
    policy: BatchPolicy | None = None,
    *,
    rate_per_s: float | None = None,
) -> None:
    """Open the batch, resolve bad lines as failed, push the rest: as fast as the producer's
    backpressure lets it, or at a steady ``rate_per_s`` trajectories per second (a replay of
    real traffic for load tests and the latency bench)."""
    if rate_per_s is not None and not (rate_per_s > 0 and math.isfinite(rate_per_s)):
        raise ConfigError("produce.rate", f"must be a positive number of trajectories per second, got {rate_per_s}")
    chunk_size = _CHUNK if rate_per_s is None else max(1, min(_CHUNK, round(rate_per_s * PACE_TICK_S)))
    # One chunk per chunk/rate seconds, the first at once: this process's pace, not a global limit.
    throttler = (
        None
        if rate_per_s is None
        else Throttler(
            rate_limit=1, period=chunk_size / rate_per_s, retry_interval=min(0.01, chunk_size / rate_per_s / 10)
        )
    )
    config = config or ProducerConfig()
    async with RolloutProducer(redis_url, config) as producer:
        await producer.open_batch(rollouts.batch_id, rollouts.size, response_len, policy=policy)
        settled: set[int] = set()
        try:
            for index, error in rollouts.bad_lines.items():
                log.warning("%s", error)
                await producer.fail(rollouts.batch_id, index, reason="bad_input", error=error)
                settled.add(index)
            for start in range(0, len(rollouts.trajectories), chunk_size):
                chunk = rollouts.trajectories[start : start + chunk_size]
                if throttler is not None:
                    await throttler.acquire()
                try:
                    await producer.push_many(chunk)
                except PayloadTooLargeError:
                    # push_many checks every payload before sending any: push the chunk
                    # one by one, so that only the oversized lines fail.
                    for traj in chunk:
                        try:
                            await producer.push(traj)
                        except PayloadTooLargeError as exc:
                            error = (
                                f"line {rollouts.line_of.get(traj.index, traj.index + 1)}: {exc} "
                                f"(raise it with consumer.max_message_bytes / {_MAX_BYTES_ENV}, for workers too)"
                            )
                            log.warning("%s", error)
                            await producer.fail(
                                rollouts.batch_id,
                                traj.index,
                                reason="bad_input",
                                error=error,
                                uid=traj.uid,
                                group=traj.group,
                            )
                        settled.add(traj.index)
                    continue
                settled.update(traj.index for traj in chunk)
        except BaseException as exc:
            await _fail_unsettled(producer, rollouts, settled, exc)
            raise


# The setting that bounds a message, on both sides of the stream.
_MAX_BYTES_ENV = "STREAM_REWARD_CONSUMER_MAX_MESSAGE_BYTES"


async def _fail_unsettled(producer: RolloutProducer, rollouts: Rollouts, settled: set[int], exc: BaseException) -> None:
    """A push failed half way: resolve every sample not yet pushed or failed as
    `failed`, so that the batch completes instead of staying open for good."""
    error = f"produce failed before this sample was pushed: {type(exc).__name__}: {exc}"
    trajs = {traj.index: traj for traj in rollouts.trajectories}
    try:
        for index in range(rollouts.size):
            if index not in settled:
                traj = trajs.get(index)
                await producer.fail(
                    rollouts.batch_id,
                    index,
                    reason="produce_failed",
                    error=error,
                    uid=traj.uid if traj else None,
                    group=traj.group if traj else None,
                )
    except Exception as second:  # Redis gone too: nothing more can be recorded from here
        log.warning("could not resolve the unpushed samples of %r: %s", rollouts.batch_id, second)


def result_rows(rewards: BatchRewards) -> list[dict[str, Any]]:
    """One JSON-able row per sample, in index order (the ``score`` command's output)."""
    rows = []
    for pos, result in enumerate(rewards.results):
        assert result is not None
        row: dict[str, Any] = {
            "uid": result.uid,
            "index": result.index,
            # A failed sample has no score: null, never a silent 0.
            "score": rewards.scores[pos] if result.status == "ok" else None,
            "status": result.status,
            "reward_extra_info": {k: v[pos] for k, v in rewards.reward_extra_info.items()},
        }
        if result.status == "failed":
            row["error"] = result.error
            row["reason"] = result.reason
        rows.append(row)
    return rows
