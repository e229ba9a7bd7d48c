"""stream-reward: an async streaming reward pipeline for LLM reinforcement learning.

Rollout producers push each finished trajectory onto a Redis stream; worker
processes score it as it arrives; the aggregator hands the trainer verl's
``rm_scores`` tensor for the batch.
"""

from stream_reward._version import __version__ as __version__
from stream_reward.config import BatchPolicy, ProducerConfig
from stream_reward.errors import StreamRewardError
from stream_reward.scoring.scorer import Scored
from stream_reward.trainer.aggregator import BatchRewards, RewardAggregator
from stream_reward.trainer.producer import RolloutProducer, SyncRolloutProducer
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
