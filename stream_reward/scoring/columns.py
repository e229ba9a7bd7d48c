"""Declared extra-info columns: which keys a scorer's results carry, known before the first sample.

verl's RewardLoopManager builds its ``reward_extra_info`` columns from the first sample's
keys, gathered from several ``RewardLoopWorker`` actors that never see each other's
samples: a column must not depend on which samples an actor happened to score. So the
columns are declared, not discovered: a composite component's ``columns``, the plain
custom function's ``extra_keys``, and for the built-in scorers the keys they always
emit (``default_columns``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from stream_reward.errors import ConfigError

__all__ = ["default_columns", "parse_columns"]

_COLUMN = re.compile(r"[A-Za-z0-9_.-]+")

# What each built-in scorer puts in a result's extra info, besides its score.
# rules: verl's math_dapo rule returns {"score", "acc", "pred"}, the others a bare number.
# math-verify: "timeout" (the answer was too costly to compare; the sample scored 0.0).
# sandbox, sandbox-fusion: "passed", "total", "error"; their "cases" (a list per sample) is
# left out: verl stacks each column with np.array, which fails on lists of unequal length.
_BUILT_IN: dict[str, tuple[str, ...]] = {
    "rules": ("acc", "pred"),
    "math-verify": ("timeout",),
    "sandbox": ("passed", "total", "error"),
    "sandbox-fusion": ("passed", "total", "error"),
}


def default_columns(spec: str, reward_kwargs: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """The extra keys scorer ``spec`` emits whatever the sample; () when unknown (a user's
    function, an ``http:`` verifier whose server decides its keys)."""
    head = spec if spec in _BUILT_IN else spec.partition(":")[0]
    if head in _BUILT_IN:
        return _BUILT_IN[head]
    if head == "genrm" and (reward_kwargs or {}).get("keep_verdict"):
        return ("genrm_verdict",)
    return ()


def parse_columns(value: Any, where: str) -> tuple[str, ...]:
    """``value`` as a tuple of column names; anything else is a one-line ConfigError at ``where``."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ConfigError(where, f"must be a list of column names, got {value!r}")
    out: list[str] = []
    for name in value:
        if not isinstance(name, str) or not _COLUMN.fullmatch(name):
            raise ConfigError(where, f"column names are letters, digits, '_', '.' or '-', got {name!r}")
        if name in out:
            raise ConfigError(where, f"column {name!r} is listed twice")
        out.append(name)
    return tuple(out)
