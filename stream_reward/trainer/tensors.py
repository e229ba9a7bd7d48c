"""The trainer side's optional tensor libraries, imported on first use.

torch and numpy come with the ``[trainer]`` extra: worker hosts never build tensors and
install without them, so nothing below ``trainer`` imports them at module level, and a
missing one is a ``MissingExtraError`` that names the extra instead of a bare ImportError.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from stream_reward.errors import MissingExtraError

__all__ = ["import_torch", "import_numpy"]


def _import(module: str, feature: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:  # the library is there but one of its own imports is broken: show that
            raise
        raise MissingExtraError(module, "trainer", feature) from exc


def import_torch(feature: str = "building reward tensors") -> ModuleType:
    return _import("torch", feature)


def import_numpy(feature: str = "verl's non-tensor batch") -> ModuleType:
    return _import("numpy", feature)
