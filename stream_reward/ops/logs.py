"""What an operator sees: log handlers and progress bars.

Library modules only ever call ``logging.getLogger(__name__)``; the entry points
(``stream-reward ...``, ``python -m stream_reward.worker``) call ``configure_logging`` once.
Text lines read well on a terminal; ``--log-format json`` gives one JSON object
per line for log shippers. INFO is for lifecycle events (a worker joined, drained,
reclaimed a sweep's entries), never one line per trajectory.

Progress bars are for people: they are drawn only on an interactive terminal
and never under ``--json``, so logs and machine-read output stay clean.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

__all__ = ["configure_logging", "JsonFormatter", "progress_bar", "Progress", "LOG_FORMATS"]

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"

# Attributes every LogRecord has; anything else came in through ``extra=`` and is
# worth a field of its own in JSON lines.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, pid, msg, extras, exc."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at the time (test capture swaps it)."""

    def __init__(self) -> None:
        super().__init__()

    @property  # type: ignore[override]
    def stream(self) -> IO[str]:
        return sys.stderr

    @stream.setter
    def stream(self, value: IO[str]) -> None:
        pass


def configure_logging(level: str | int = "INFO", fmt: str = "text", stream: IO[str] | None = None) -> logging.Handler:
    """Install one handler on the root logger (replacing one installed earlier by this function)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_stream_reward", False)]:
        root.removeHandler(old)
    handler: logging.Handler = logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler._stream_reward = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    return handler


class Progress:
    """A progress handle: ``advance(n)``, ``update(completed, total=None)``. This one draws nothing."""

    drawn = False  # True when a bar is on screen: callers skip work that only feeds the bar

    def advance(self, n: int = 1) -> None:
        pass

    def update(self, completed: int, total: int | None = None) -> None:
        pass

    def __call__(self) -> None:  # run_demo's ``progress`` callable: one landed result
        self.advance(1)


class _RichProgress(Progress):
    drawn = True

    def __init__(self, bar: Any, task: Any) -> None:
        self._bar = bar
        self._task = task

    def advance(self, n: int = 1) -> None:
        self._bar.advance(self._task, n)

    def update(self, completed: int, total: int | None = None) -> None:
        if total is not None:
            self._bar.update(self._task, completed=completed, total=total)
        else:
            self._bar.update(self._task, completed=completed)


_active: list[Any] = []  # the bar on screen; rich allows one live display at a time


@contextmanager
def progress_bar(
    description: str, total: int | None = None, *, enabled: bool = True, console: Any = None
) -> Iterator[Progress]:
    """A rich progress bar on stderr when ``enabled`` and stderr is a terminal; else a no-op handle.

    Nested calls (a bench's own bars under the CLI's spinner) add a line to the
    bar already on screen instead of starting a second display.
    """
    if not enabled:
        yield Progress()
        return
    if _active:
        bar = _active[-1]
        task = bar.add_task(description, total=total)
        try:
            yield _RichProgress(bar, task)
        finally:
            bar.remove_task(task)
        return
    from rich.console import Console

    console = console or Console(stderr=True)
    if not console.is_terminal:
        yield Progress()
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.progress import Progress as RichProgress

    columns = [
        SpinnerColumn(),
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        TimeElapsedColumn(),
    ]
    with RichProgress(*columns, console=console, transient=False) as bar:
        _active.append(bar)
        try:
            yield _RichProgress(bar, bar.add_task(description, total=total))
        finally:
            _active.remove(bar)
