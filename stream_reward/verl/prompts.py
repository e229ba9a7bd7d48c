"""A verl sample's prompt for the scorer: the last user message of the chat the
dataset carries (``raw_prompt``, which verl 0.9.1's agent loop puts on every row),
else the prompt's token ids decoded with their chat template undone.

The sandbox's checker takes a HumanEval test's helpers (``poly``) from this prompt;
a judge reads the question in it. Reading ``raw_prompt`` costs a dict lookup per
sample; the ids are decoded only when the row has no ``raw_prompt`` and the scorer
reads prompts (``reads_prompts``).
"""

from __future__ import annotations

from typing import Any

from stream_reward.config import ManagerConfig
from stream_reward.scoring.prompts import user_prompt

__all__ = ["reads_prompts", "row_prompt"]

# Scorers that read a trajectory's prompt: the remote judges and the sandbox.
_PROMPT_SCORERS = ("http", "disrm", "genrm", "sandbox")


def reads_prompts(config: ManagerConfig) -> bool:
    """Whether ``config``'s scorer (or one of its components) reads the prompt."""
    specs = [config.scorer] if not config.components else [str(c.get("scorer", "")) for c in config.components]
    return any(spec.partition(":")[0] in _PROMPT_SCORERS for spec in specs)


def row_prompt(raw_prompt: Any, prompt_ids: Any, tokenizer: Any, *, decode: bool) -> str | None:
    """The last user message of ``raw_prompt`` (chat messages); without one, and with
    ``decode``, that of ``prompt_ids`` (the valid ids, padding already cut) decoded."""
    if raw_prompt is not None:
        found = user_prompt(raw_prompt)  # a list or numpy column of message dicts
        if found is not None:
            return found
    if not decode:
        return None
    text = tokenizer.decode(prompt_ids, skip_special_tokens=False)
    return user_prompt(text, getattr(tokenizer, "all_special_tokens", None) or ())
