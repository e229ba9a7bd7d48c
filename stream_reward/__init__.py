"""stream-reward: an async streaming reward pipeline for LLM reinforcement learning.

Rollout producers push each finished trajectory onto a Redis stream; worker
processes score it as it arrives; the aggregator hands the trainer verl's
``rm_scores`` tensor for the batch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from stream_reward._version import __version__ as __version__

if TYPE_CHECKING:
    from stream_reward.config import BatchPolicy, ProducerConfig
    from stream_reward.errors import StreamRewardError
    from stream_reward.scoring.scorer import Scored
    from stream_reward.trainer.aggregator import RewardAggregator
    from stream_reward.trainer.producer import RolloutProducer
    from stream_reward.trainer.rewards import BatchRewards
    from stream_reward.trainer.sync_producer import SyncRolloutProducer
    from stream_reward.wire.trajectory import ScoreResult, Trajectory

__all__ = [
    "Trajectory",
    "ScoreResult",
    "RolloutProducer",
    "SyncRolloutProducer",
    "RewardAggregator",
    "BatchRewards",
    "BatchPolicy",
    "ProducerConfig",
    "Scored",
    "StreamRewardError",
]

# Each name is imported on first use (PEP 562), not with the package: the redis client
# alone takes 0.14 s to import, and every `stream-reward` command imports this package
# before its first line runs. A Ctrl-C in that time could only come out as a traceback;
# the CLI keeps one from its own first lines (see stream_reward.cli).
_HOMES = {
    "Trajectory": "stream_reward.wire.trajectory",
    "ScoreResult": "stream_reward.wire.trajectory",
    "RolloutProducer": "stream_reward.trainer.producer",
    "SyncRolloutProducer": "stream_reward.trainer.sync_producer",
    "RewardAggregator": "stream_reward.trainer.aggregator",
    "BatchRewards": "stream_reward.trainer.rewards",
    "BatchPolicy": "stream_reward.config",
    "ProducerConfig": "stream_reward.config",
    "Scored": "stream_reward.scoring.scorer",
    "StreamRewardError": "stream_reward.errors",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'stream_reward' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # once: later lookups never reach __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
