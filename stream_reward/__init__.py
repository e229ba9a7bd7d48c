"""stream-reward: an async streaming reward pipeline for LLM reinforcement learning.

Rollout producers push each finished trajectory onto a Redis stream; worker
processes score it as it arrives; the aggregator hands the trainer verl's
``rm_scores`` tensor for the batch.
"""

from .aggregator import BatchRewards, RewardAggregator
from .config import BatchPolicy, ProducerConfig
from .errors import StreamRewardError
from .producer import RolloutProducer, SyncRolloutProducer
from .scoring import Scored
from .trajectory import ScoreResult, Trajectory

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

__version__ = "0.1.0"
