"""stream-reward inside verl 0.9.1. verl itself is never imported here (only inside the
optional Ray placement, when Ray is installed).

* ``StreamRewardLoopManager`` (``loop.py``): verl's reward loop, chosen by configuration
  alone::

      reward.reward_manager.source=importlib
      reward.reward_manager.module.path=pkg://stream_reward.verl
      reward.reward_manager.name=StreamRewardLoopManager

  Its options come from verl's own keys (``options.py``); where its workers run is
  ``server.py``; ``compute.py`` hands a custom ``compute_score`` what verl hands it.
* ``StreamRewardManager`` (``dropin.py``): the batch drop-in for ``reward_fn(data)``.
"""

from stream_reward.verl.dropin import FINAL_SCORES_KEY, StreamRewardManager, decode_batch, scorer_spec
from stream_reward.verl.loop import StreamRewardLoopManager

__all__ = ["StreamRewardLoopManager", "StreamRewardManager", "scorer_spec", "decode_batch", "FINAL_SCORES_KEY"]
