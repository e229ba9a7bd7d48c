"""compute_score wrappers that give a user function what verl passes it when a
reward model runs: ``reward_router_address`` and ``reward_model_tokenizer``.

A tokenizer object cannot travel to a worker process; each process loads it once
from the reward model's path (``reward.reward_model.model_path``), with verl's
``hf_tokenizer`` as verl's RewardLoopWorker does.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["call_with_reward_model", "acall_with_reward_model"]


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str | None) -> Any:
    if not path:
        return None
    from verl.utils import hf_tokenizer  # type: ignore[import-not-found]

    return hf_tokenizer(path, trust_remote_code=True)


@functools.lru_cache(maxsize=8)
def _function(spec: str) -> Any:
    from stream_reward.scoring.scorer import load_function

    return load_function(spec)


def _split(kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    fn = _function(kwargs.pop("_sr_function"))
    kwargs["reward_model_tokenizer"] = _tokenizer(kwargs.pop("_sr_tokenizer_path", None))
    return fn, kwargs


def call_with_reward_model(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, **kwargs: Any
) -> Any:
    fn, kwargs = _split(kwargs)
    return fn(
        data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info, **kwargs
    )


async def acall_with_reward_model(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, **kwargs: Any
) -> Any:
    fn, kwargs = _split(kwargs)
    return await fn(
        data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info, **kwargs
    )
