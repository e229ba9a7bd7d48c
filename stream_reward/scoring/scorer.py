"""The scorer extension point and verl-style function loading.

A scorer is anything with one async method, ``score(traj) -> Scored``. It fails a
sample by raising a ``ScoringError`` (the worker records ``failed`` with the
error's reason); any other exception is a bug in the scorer and is recorded the
same way, so one bad sample never takes the pool down.

verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None,
**kwargs) -> float | dict`` functions are adapted by ``normalize``.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from stream_reward.errors import BadReplyError, ConfigError
from stream_reward.wire.trajectory import Trajectory

__all__ = ["Scored", "Scorer", "normalize", "load_function"]


@dataclass(slots=True)
class Scored:
    """What a scorer returns for one sample: the scalar, any extra columns, and how
    many attempts it took (a remote verifier retried after faults says so)."""

    score: float
    extra: dict[str, Any] = field(default_factory=dict)
    attempts: int = 1


@runtime_checkable
class Scorer(Protocol):
    async def score(self, traj: Trajectory) -> Scored: ...


def normalize(value: Any) -> Scored:
    """Turn a verl-style return value (float, int, bool or dict with "score") into Scored."""
    if type(value) is float and math.isfinite(value):  # the common case, once per sample
        return Scored(value)
    if isinstance(value, Scored):
        return value
    if isinstance(value, dict):
        if "score" not in value:
            raise BadReplyError(
                f"scorer returned a dict without a 'score' key (keys: {sorted(map(str, value))})", reason="no_score"
            )
        extra = {str(k): v for k, v in value.items() if k != "score"}
        return Scored(_as_float(value["score"]), extra)
    return Scored(_as_float(value))


def _as_float(value: Any) -> float:
    item = getattr(value, "item", None)  # 0-d numpy arrays and tensors
    if callable(item) and not isinstance(value, (int, float)):
        value = item()
    try:
        score = float(value)
    except (TypeError, ValueError) as exc:
        raise BadReplyError(f"score {value!r} is not a number", reason="bad_score") from exc
    if not math.isfinite(score):
        raise BadReplyError(f"score {score} is not finite", reason="bad_score")
    return score


def load_function(spec: str) -> Callable[..., Any]:
    """Load ``python:FILE.py:FUNC``, ``FILE.py:FUNC`` or ``module.path:FUNC``."""
    target = spec.removeprefix("python:")
    path_part, sep, func_name = target.rpartition(":")
    if not sep or not path_part or not func_name:
        raise ConfigError("scorer", f"{spec!r} is not FILE.py:FUNC or module.path:FUNC")
    if path_part.endswith(".py") or "/" in path_part:
        path = Path(path_part).expanduser().resolve()
        if not path.is_file():
            raise ConfigError("scorer", f"no such file {str(path)!r}")
        module_name = f"_stream_reward_user_{abs(hash(str(path)))}"
        module = sys.modules.get(module_name)
        if module is None:
            file_spec = importlib.util.spec_from_file_location(module_name, path)
            if file_spec is None or file_spec.loader is None:
                raise ConfigError("scorer", f"cannot import {str(path)!r}")
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[module_name] = module
            try:
                file_spec.loader.exec_module(module)
            except Exception as exc:
                del sys.modules[module_name]
                raise ConfigError("scorer", f"importing {str(path)!r} failed: {exc!r}") from exc
    else:
        try:
            module = importlib.import_module(path_part)
        except ImportError as exc:
            raise ConfigError("scorer", f"cannot import module {path_part!r}: {exc}") from exc
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise ConfigError("scorer", f"{path_part!r} has no callable {func_name!r}")
    return fn
