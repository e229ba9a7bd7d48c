"""What TRL passes a reward function, as trajectories.

TRL 1.16's ``GRPOTrainer._calculate_rewards`` calls
``f(prompts=, completions=, completion_ids=, **reward_kwargs)``: one entry per
completion in ``prompts`` / ``completions`` / ``completion_ids``, every dataset
column but ``prompt`` repeated per generation in ``reward_kwargs``, and a few
objects of its own there (``trainer_state``, ``log_extra``, ``log_metric``,
``environments``) that are no column.

Completions are strings, or in a conversational dataset lists of
``{"role", "content"}`` messages; prompts likewise. A message's content is a
string, or a list of parts (``{"type": "text", "text": ...}``) in multimodal data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from stream_reward.errors import BadCallError, ConfigError
from stream_reward.wire.codec import to_plain
from stream_reward.wire.trajectory import Trajectory

__all__ = ["TRL_KWARGS", "message_text", "trajectories"]

# reward_kwargs TRL adds that are not dataset columns (TRL 1.16: _calculate_rewards).
TRL_KWARGS = frozenset({"trainer_state", "log_extra", "log_metric", "environments"})


def message_text(content: Any) -> str:
    """A message's text: a string as is, a list of parts as its text parts joined."""
    if content is None:  # an assistant turn that only calls tools
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        texts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                text = part.get("text")
                texts.append(text if isinstance(text, str) else "")  # a null text is no text, not "None"
            elif isinstance(part, str):
                texts.append(part)
        return "".join(texts)
    raise BadCallError(f"a message's content is a {type(content).__name__}, not text or a list of parts")


def _last_of_role(messages: Sequence[Any], role: str, what: str, index: int) -> str | None:
    for message in reversed(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise BadCallError(
                f"{what}[{index}] is a list, but not of {{'role', 'content'}} messages: {_short(message)}"
            )
        if message["role"] == role:
            return message_text(message.get("content"))
    return None


def completion_text(completion: Any, index: int) -> str:
    """The policy's answer: the string, or the last assistant message's text (with tool
    calls, the answer after the last tool result). No assistant message: nothing produced."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence):
        return _last_of_role(completion, "assistant", "completions", index) or ""
    raise BadCallError(
        f"completions[{index}] is a {type(completion).__name__}; TRL passes a string or a list of messages"
    )


def prompt_text(prompt: Any, index: int) -> str | None:
    """The task as the scorer reads it: the string, or the last user message's text."""
    if prompt is None or isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence):
        return _last_of_role(prompt, "user", "prompts", index)
    raise BadCallError(f"prompts[{index}] is a {type(prompt).__name__}; TRL passes a string or a list of messages")


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _column(name: str, values: Any, n: int) -> list[Any]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise BadCallError(f"column {name!r} is a {type(values).__name__}, not a list of one value per completion")
    if len(values) != n:
        raise BadCallError(f"column {name!r} has {len(values)} values for {n} completions")
    return list(values)


def trajectories(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]] | None,
    columns: Mapping[str, Any],
    *,
    ground_truth_key: str | None,
    data_source: str | None,
) -> list[Trajectory]:
    """One trajectory per completion, in TRL's order (``batch_id`` and ``index`` are set
    when the batch is opened). Raises BadCallError / ConfigError naming what is wrong."""
    n = len(completions)
    if len(prompts) != n:
        raise BadCallError(f"TRL passed {len(prompts)} prompts for {n} completions")
    ids = None if completion_ids is None else _column("completion_ids", completion_ids, n)
    for i, one in enumerate(ids or ()):
        if isinstance(one, (str, bytes)) or not hasattr(one, "__len__"):  # a list, or an array / tensor row
            raise BadCallError(f"completion_ids[{i}] is a {type(one).__name__}, not a list of token ids")
    data = {key: value for key, value in columns.items() if key not in TRL_KWARGS}
    if ground_truth_key is None:
        truths: list[Any] = [None] * n
    elif ground_truth_key not in data:
        raise ConfigError(
            "ground_truth_key",
            f"no column {ground_truth_key!r} among the columns TRL passed ({', '.join(sorted(data)) or 'none'}); "
            "name the dataset's answer column, or None for a scorer that needs no ground truth",
        )
    else:
        truths = [to_plain(v) for v in _column(ground_truth_key, data.pop(ground_truth_key), n)]
    sources = _data_sources(data, data_source, n)
    extra_columns = {key: _column(key, values, n) for key, values in data.items()}
    out = []
    for i in range(n):
        out.append(
            Trajectory(
                batch_id="",
                index=i,
                data_source=sources[i],
                response=completion_text(completions[i], i),
                ground_truth=truths[i],
                prompt=prompt_text(prompts[i], i),
                valid_response_length=len(ids[i]) if ids is not None else None,
                extra_info={key: to_plain(values[i]) for key, values in extra_columns.items()},
            )
        )
    return out


def _data_sources(data: dict[str, Any], data_source: str | None, n: int) -> list[str]:
    """The argument for every sample when given (it names the scorer the user chose),
    else the dataset's ``data_source`` column."""
    column = data.pop("data_source", None)
    if data_source is not None:
        return [data_source] * n
    if column is None:
        raise ConfigError(
            "data_source",
            "the dataset has no data_source column; pass reward_func(data_source=...) "
            "(e.g. 'openai/gsm8k', or any name a python: scorer accepts)",
        )
    sources = _column("data_source", column, n)
    for i, source in enumerate(sources):
        if not isinstance(source, str) or not source:
            raise BadCallError(f"column 'data_source'[{i}] is {_short(source)}, not a non-empty string")
    return sources
