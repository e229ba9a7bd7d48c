"""Rollout dumps as JSONL: ``produce`` pushes one, ``score`` runs one end to end.

A line's position in the file (0-based, counting every line) is the sample's
index in the batch. A malformed line is reported with its line number and
resolved as `failed` (reason ``bad_input``); the other lines are still scored.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stream_reward.config import BatchPolicy, ProducerConfig
from stream_reward.trainer.aggregator import BatchRewards
from stream_reward.trainer.producer import RolloutProducer
from stream_reward.wire.trajectory import Trajectory, trajectory_from_json

__all__ = ["Rollouts", "read_rollouts", "produce_rollouts", "result_rows"]

log = logging.getLogger(__name__)


@dataclass
class Rollouts:
    batch_id: str
    trajectories: list[Trajectory]
    bad_lines: dict[int, str]  # index -> error message (with the line number)

    @property
    def size(self) -> int:
        return len(self.trajectories) + len(self.bad_lines)


def read_rollouts(path: str | Path, batch_id: str) -> Rollouts:
    trajectories: list[Trajectory] = []
    bad: dict[int, str] = {}
    with open(path, encoding="utf-8") as handle:
        for index, line in enumerate(handle):
            line_no = index + 1
            try:
                obj = json.loads(line)
                trajectories.append(trajectory_from_json(obj, batch_id, index))
            except (json.JSONDecodeError, ValueError) as exc:
                bad[index] = f"line {line_no}: {exc}"
    return Rollouts(batch_id, trajectories, bad)


async def produce_rollouts(
    redis_url: str,
    rollouts: Rollouts,
    response_len: int,
    config: ProducerConfig | None = None,
    policy: BatchPolicy | None = None,
) -> None:
    """Open the batch, resolve bad lines as failed, push the rest."""
    async with RolloutProducer(redis_url, config) as producer:
        await producer.open_batch(rollouts.batch_id, rollouts.size, response_len, policy=policy)
        for index, error in rollouts.bad_lines.items():
            log.warning("%s", error)
            await producer.fail(rollouts.batch_id, index, reason="bad_input", error=error)
        for start in range(0, len(rollouts.trajectories), 512):
            await producer.push_many(rollouts.trajectories[start : start + 512])


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
