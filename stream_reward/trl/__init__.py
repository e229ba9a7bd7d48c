"""TRL's front door: ``GRPOTrainer(reward_funcs=[reward_func(scorer="rules")])``.

``reward_func`` returns an ``async def`` reward function of TRL 1.16's form,
``f(prompts, completions, completion_ids, **columns) -> list[float | None]``: one
batch per call, scored by stream-reward workers, ``None`` for a sample we failed to
score. TRL itself is never imported here (see docs/trl.md).
"""

from stream_reward.trl.reward import TRLRewardFunc, reward_func
from stream_reward.trl.shared import shutdown

__all__ = ["reward_func", "TRLRewardFunc", "shutdown"]
