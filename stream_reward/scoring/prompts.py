"""The task's prompt as the trusted side reads it: the user's last turn of a chat.

A sample's prompt arrives in several shapes: JSONL's ``prompt`` text; verl's
``raw_prompt``, the dataset's chat messages; a prompt decoded from token ids, with
the chat template still around it (ChatML, Llama-3 headers, Llama-2/Mistral
``[INST]``, Gemma turns, plain ``User:`` lines). ``user_prompt`` gives the text of
the last user turn in each: what the task said, without the template.

Pure and cheap: the verl reward loop calls it once per sample.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["user_prompt", "undo_template"]

# The last user turn of each template; the first template found in a text wins.
_TEMPLATES = (
    re.compile(r"<\|im_start\|>user[ \t]*\n(.*?)(?:<\|im_end\|>|<\|im_start\|>|\Z)", re.S),  # ChatML
    re.compile(
        r"<\|start_header_id\|>user<\|end_header_id\|>[ \t]*\n*(.*?)(?:<\|eot_id\|>|<\|start_header_id\|>|\Z)", re.S
    ),  # Llama-3
    re.compile(r"<start_of_turn>user[ \t]*\n(.*?)(?:<end_of_turn>|<start_of_turn>|\Z)", re.S),  # Gemma
    re.compile(r"<｜User｜>(.*?)(?:<｜Assistant｜>|<｜User｜>|\Z)", re.S),  # DeepSeek
    re.compile(r"\[INST\](.*?)(?:\[/INST\]|\Z)", re.S),  # Llama-2, Mistral
    re.compile(
        r"^(?:User|USER|Human|HUMAN)[ \t]*:[ \t]*(.*?)(?=^(?:Assistant|ASSISTANT|AI|System|SYSTEM)[ \t]*:|\Z)",
        re.S | re.M,
    ),
)
_LLAMA2_SYSTEM = re.compile(r"<<SYS>>.*?<</SYS>>\s*", re.S)


def undo_template(text: str, special_tokens: Iterable[str] = ()) -> str:
    """The last user turn of a chat-templated ``text``; a text in no known template is
    returned as is, less the tokenizer's ``special_tokens`` (a BOS, say)."""
    for template in _TEMPLATES:
        turns = template.findall(text)
        if turns:
            return _LLAMA2_SYSTEM.sub("", turns[-1]).strip("\n")
    for token in special_tokens:
        if token:
            text = text.replace(token, "")
    return text


def user_prompt(value: Any, special_tokens: Iterable[str] = ()) -> str | None:
    """The text of the last user turn in ``value``: a chat message list (verl's
    ``raw_prompt``; a content may be a list of ``{"type": "text", "text": ...}`` parts),
    or a text (chat template undone, see ``undo_template``). None when there is none."""
    if value is None:
        return None
    if isinstance(value, str):
        return undo_template(value, special_tokens)
    if isinstance(value, Mapping):
        return None
    try:
        messages = list(value)
    except TypeError:
        return None
    for message in reversed(messages):
        if isinstance(message, Mapping) and message.get("role") == "user":
            return _content_text(message.get("content"))
    return None


def _content_text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        parts = [p.get("text") for p in content if isinstance(p, Mapping) and p.get("type") == "text"]
        return "".join(p for p in parts if isinstance(p, str))
    return None
