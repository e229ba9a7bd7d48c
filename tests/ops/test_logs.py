"""Logging and progress: ``configure_logging`` installs one handler of ours (text, or JSON
lines with the record's extra fields and its exception), only entry points call it, and
a progress bar draws only on a terminal, never with ``--json``.
"""

from __future__ import annotations

import io
import json
import logging
import sys
from pathlib import Path

import pytest

from stream_reward.ops.logs import JsonFormatter, configure_logging, progress_bar

pytestmark = pytest.mark.usefixtures("restore_logging")


def test_json_log_lines() -> None:
    stream = io.StringIO()
    configure_logging("INFO", "json", stream=stream)
    logging.getLogger("stream_reward.test").info("worker %s joined", "w1", extra={"batch": "b7"})
    logging.getLogger("stream_reward.test").debug("not shown")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["msg"] == "worker w1 joined" and record["level"] == "INFO"
    assert record["logger"] == "stream_reward.test" and record["batch"] == "b7" and "ts" in record


def test_json_formatter_includes_exceptions() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())
    assert "RuntimeError: boom" in json.loads(JsonFormatter().format(record))["exc"]


def test_configure_logging_replaces_its_own_handler() -> None:
    configure_logging("INFO", "text")
    configure_logging("WARNING", "json")
    ours = [h for h in logging.getLogger().handlers if getattr(h, "_stream_reward", False)]
    assert len(ours) == 1 and isinstance(ours[0].formatter, JsonFormatter)


def test_library_modules_do_not_configure_logging() -> None:
    """Only entry points install handlers; library modules just get their logger."""
    import stream_reward

    root = Path(stream_reward.__file__).parent
    offenders = [
        p.name
        for p in root.rglob("*.py")
        if p.name not in ("logs.py", "cli.py") and ("basicConfig(" in p.read_text() or "addHandler(" in p.read_text())
    ]
    assert offenders == []


# ---------------------------------------------------------------------- progress
def test_progress_bar_draws_only_on_a_terminal() -> None:
    from rich.console import Console

    terminal = io.StringIO()
    with progress_bar("scoring", total=3, console=Console(file=terminal, force_terminal=True, width=80)) as bar:
        assert bar.drawn
        bar.advance(2)
        bar()
        with progress_bar("nested", total=1) as inner:  # nests on the bar already on screen
            assert inner.drawn
            inner.advance()
    assert "scoring" in terminal.getvalue() and "3/3" in terminal.getvalue()

    piped = io.StringIO()
    with progress_bar("scoring", total=3, console=Console(file=piped, force_terminal=False)) as bar:
        assert not bar.drawn
        bar.advance(3)
    assert piped.getvalue() == ""
    with progress_bar("scoring", total=3, enabled=False) as bar:  # --json
        assert not bar.drawn
