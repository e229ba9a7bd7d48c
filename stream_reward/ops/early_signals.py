"""Signals from a program's first instant, kept until the program can act on them.

Python's own Ctrl-C handler raises KeyboardInterrupt wherever the main thread stands. In
a program's first quarter second that is inside its imports (the redis client's alone
takes 0.14 s), and the Ctrl-C came out as a traceback, or a SIGTERM as a death without a
word. An entry point calls ``keep()`` before its imports and ``release()`` once its own
handlers are in: ``release()`` gives back what came meanwhile, for those handlers to act
on, and puts Python's back where nothing replaced them.
"""

from __future__ import annotations

import signal
from typing import Any

__all__ = ["keep", "pending", "release"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_kept: list[int] = []
_before: dict[int, Any] = {}


def _keep(signum: int, frame: object) -> None:
    _kept.append(signum)


def keep() -> None:
    """From now until ``release()``, SIGINT and SIGTERM are kept, not acted on. One the
    program was started with ignored (``nohup``, a shell's ``&``) stays ignored."""
    for signum in _SIGNALS:
        if signal.getsignal(signum) not in (signal.SIG_IGN, _keep):
            _before[signum] = signal.signal(signum, _keep)
    # A program that execs this one (`stream-reward worker`) blocks them over its exec, so
    # that one sent in between waits here instead of being lost: it is taken now.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)


def pending() -> bool:
    """Whether a signal has been kept (and not yet released)."""
    return bool(_kept)


def release() -> list[int]:
    """The signals kept since ``keep()``, first first (none if it was never called).

    Where ``keep``'s handler is still in place, the one before it goes back; a handler the
    program has installed since stays."""
    for signum, before in list(_before.items()):
        if signal.getsignal(signum) is _keep:
            signal.signal(signum, before)
        del _before[signum]
    kept, _kept[:] = list(_kept), []
    return kept
