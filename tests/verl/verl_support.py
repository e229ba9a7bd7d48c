"""What the verl suite shares: the availability check, the rows, the batch builder."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

VERL_VERSION = "0.9.1"
REQUIRED = os.environ.get("STREAM_REWARD_REQUIRE_VERL") == "1"


def _missing() -> str | None:
    # By distribution metadata, not find_spec: this very directory is named verl, and
    # without the real package it would be found as a namespace package.
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("verl")
    except PackageNotFoundError:
        return "verl is not installed"
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    if found != VERL_VERSION:
        return f"verl {found} is installed, this suite checks {VERL_VERSION}"
    return None


MISSING = _missing()
if MISSING and REQUIRED:
    raise RuntimeError(f"STREAM_REWARD_REQUIRE_VERL=1 but {MISSING}: the verl suite must run here")
SKIP_REASON = f"{MISSING}; the verl suite runs in CI's verl environment (.ci/verl.sh)" if MISSING else None


STREAM_OVERRIDES = (
    "reward.reward_manager.source=importlib",
    "reward.reward_manager.module.path=pkg://stream_reward.verl",
    "reward.reward_manager.name=StreamRewardLoopManager",
)

# (data_source, ground_truth, response text, response length override)
# length override: None = the encoded text (right-padded), 0 = zero-length row,
# "full" = truncated at the row width.
ROWS: list[tuple[str, str, str, Any]] = [
    ("openai/gsm8k", "42", "The answer is #### 42", None),
    ("openai/gsm8k", "42", "The answer is #### 41", None),
    ("openai/gsm8k", "7", "Let x = 3. Then 2x + 1 = 7. #### 7", "full"),  # truncated: the #### is cut off
    ("lighteval/MATH", "\\frac{1}{2}", "so the total is \\boxed{\\frac{1}{2}}", None),
    ("lighteval/MATH", "10", "\\boxed{3\\sqrt{2}}", None),
    ("math_dapo", "7", "Answer: 7", None),
    ("math_dapo", "-12", "Answer: -12 because 3 * -4 = -12", None),
    ("math_dapo", "5", "Answer: 7", None),
    ("openai/gsm8k", "42", "", 0),  # zero-length response
    ("math_dapo", "3", "", 0),  # zero-length response (math_dapo scores -1 on it)
]


def make_batch(tokenizer: Any, rows: list[tuple[str, str, str, Any]], *, width: int = 16, prompt_len: int = 6) -> Any:
    """A DataProto as verl's rollout hands it to the reward loop: left-padded prompts,
    right-padded responses, attention_mask over both."""
    import numpy as np
    import torch
    from verl import DataProto

    pad = tokenizer.pad_token_id
    prompts, responses, masks = [], [], []
    for i, (_source, _gt, text, length) in enumerate(rows):
        prompt_ids = tokenizer.encode(f"question {i}")[:prompt_len]
        ids = tokenizer.encode(text) if text else []
        if length == "full":
            ids = (ids * 4)[:width] if ids else [pad] * width
        elif length == 0:
            ids = []
        ids = ids[:width]
        prompt_row = [pad] * (prompt_len - len(prompt_ids)) + prompt_ids
        response_row = ids + [pad] * (width - len(ids))
        mask = [0] * (prompt_len - len(prompt_ids)) + [1] * len(prompt_ids) + [1] * len(ids) + [0] * (width - len(ids))
        prompts.append(prompt_row)
        responses.append(response_row)
        masks.append(mask)
    prompts_t = torch.tensor(prompts)
    responses_t = torch.tensor(responses)
    tensors = {
        "prompts": prompts_t,
        "responses": responses_t,
        "input_ids": torch.cat([prompts_t, responses_t], dim=1),
        "attention_mask": torch.tensor(masks),
    }
    non_tensors = {
        "data_source": np.array([r[0] for r in rows], dtype=object),
        "reward_model": np.array([{"ground_truth": r[1], "style": "rule"} for r in rows], dtype=object),
        "extra_info": np.array([{"index": i} for i in range(len(rows))], dtype=object),
    }
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)
