"""The trainer side's optional tensor libraries, imported on first use.

torch and numpy come with the ``[trainer]`` extra: worker hosts never build tensors and
install without them, so nothing below ``trainer`` imports them at module level, and a
missing one is a ``MissingExtraError`` that names the extra instead of a bare ImportError.

torch's first import holds SIGINT and SIGTERM back until it is over: its C extension
calls Python code from C++, and a handler that raises there (Python's own Ctrl-C, the
CLI's SIGTERM) comes back into C++ as an exception nothing catches: the process aborts
(``terminate called after throwing an instance of 'python_error'``, exit -6) without its
clean-up. Or the raise is dropped, and torch comes out half imported.
"""

from __future__ import annotations

import contextlib
import importlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from stream_reward.errors import MissingExtraError

__all__ = ["import_torch", "import_numpy"]


def _import(module: str, feature: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:  # the library is there but one of its own imports is broken: show that
            raise
        raise MissingExtraError(module, "trainer", feature) from exc


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block is over, then go to the handlers that were
    in place, first first, as if they came then. Only Python handlers are held: SIG_DFL
    (a SIGTERM that kills) and SIG_IGN raise nothing, and signals reach Python's handlers
    in the main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []

    def hold(signum: int, frame: object) -> None:
        came.append(signum)

    before: dict[signal.Signals, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        if callable(signal.getsignal(sig)):
            before[sig] = signal.signal(sig, hold)
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        for signum in came:
            signal.raise_signal(signum)


def import_torch(feature: str = "building reward tensors") -> ModuleType:
    if "torch" in sys.modules:
        return _import("torch", feature)
    with _signals_held():
        return _import("torch", feature)


def import_numpy(feature: str = "verl's non-tensor batch") -> ModuleType:
    return _import("numpy", feature)
