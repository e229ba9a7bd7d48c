"""One sample on its way from a producer call to the push script's verdict.

``_Entry`` is a trajectory checked and encoded for the push script; ``_Sent`` is a
``push_many`` handed to the coalescer; ``_ScoreCall`` is one ``score()`` call's sample,
applying its verdict the moment the coalescer sets it. They live apart from the producer
because they are what the per-sample path allocates: one object per sample, its fields
read directly, so that this module is where the per-sample cost is read and kept down.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

from stream_reward.config import ProducerConfig
from stream_reward.errors import PushConflictError
from stream_reward.trainer.coalescer import _CANCELLED, _DONE, _PENDING, Verdict
from stream_reward.trainer.listener import ResultListener
from stream_reward.wire.keys import Keys
from stream_reward.wire.push import DUPLICATE
from stream_reward.wire.trajectory import ScoreResult


def _default_index(batch_id: str, uid: str) -> int | None:
    """The index whose default uid ``uid`` is, in this batch; None if it is no default uid."""
    prefix = f"{batch_id}/"
    if uid.startswith(prefix):
        rest = uid[len(prefix) :]
        # ASCII digits only: str.isdigit() also takes "²" and "٣", which int() reads or refuses.
        if rest.isascii() and rest.isdigit() and (rest == "0" or not rest.startswith("0")):
            return int(rest)
    return None


@dataclass(slots=True)
class _Entry:
    """One trajectory on its way to the push script."""

    partition: int
    batch: str
    index: int
    uid: str
    digest: str
    length: int  # valid response tokens, -1 unknown
    payload: bytes
    header: bytes
    implied: int  # 1: the uid is the default uid of its index (no uid claim needed)

    def row(self) -> tuple[str, int, str, str, int, bytes, bytes, int]:
        return (self.batch, self.index, self.uid, self.digest, self.length, self.payload, self.header, self.implied)


@dataclass(slots=True)
class _Sent:
    """A push_many handed to the coalescer: its entries, the uids it reserved, and the
    future of its verdicts."""

    entries: list[_Entry]
    reserved: list[tuple[set[str], str]]
    verdicts: asyncio.Future[list[int]] | None = None


class _Settles(Protocol):
    """What a score() call needs of its producer to apply its verdict."""

    keys: Keys
    config: ProducerConfig

    def _apply_verdict(self, entry: _Entry, verdict: int, seen: set[str]) -> PushConflictError | None: ...

    def _release(self, reserved: list[tuple[set[str], str]], counted: int) -> None: ...


class _ScoreCall(Verdict[list[int]]):
    """One score() call's sample from its push to its result: the verdict slot the
    coalescer sets, and what that verdict decides, applied the moment it is set
    (release the uid or keep it, correct the backlog count, fail the result wait or
    arm its timeout).

    One object per sample where there were four (a Verdict, its callback's argument, a
    push record and a tuple of what the callback needed): on the per-sample path the
    trainer's cost is mostly such per-sample objects and the calls between them.
    """

    __slots__ = (
        "producer",
        "entry",
        "seen",
        "listener",
        "fut",
        "followed",
        "timeout_s",
        "tick",
        "applied",
        "error",
    )

    def __init__(
        self,
        producer: _Settles,
        entry: _Entry,
        seen: set[str],
        listener: ResultListener,
        fut: asyncio.Future[ScoreResult],
        followed: Any,
        timeout_s: float | None,
    ) -> None:
        # Verdict's own state, set here rather than by a second __init__ call per sample;
        # _settled below replaces its then/arg callback.
        self._state = _PENDING
        self._value = None
        self._waiter = None
        self.producer = producer
        self.entry = entry
        self.seen = seen
        self.listener = listener
        self.fut: asyncio.Future[ScoreResult] | None = fut
        self.followed = followed
        self.timeout_s = timeout_s
        self.tick = -1
        self.applied = False
        self.error: BaseException | None = None

    def apply(self) -> BaseException | None:
        """Apply the verdict (it is set), once; what the push raised or was refused with."""
        if self.applied:
            return self.error
        self.applied = True
        state = self._state
        if state == _DONE:
            # Made, not raised, here: a refusal carries no traceback, which from this callback
            # would reach the flush (every payload of it) for as long as a caller keeps it.
            self.error = self.producer._apply_verdict(self.entry, self._value[0], self.seen)
        else:
            # Given up (by score(), or a closing loop) or failed: as push_many's _unreserve.
            given_up = state == _CANCELLED
            self.producer._release([(self.seen, self.entry.uid)], 0)
            self.error = asyncio.CancelledError() if given_up else self._value
        return self.error

    def _settled(self) -> None:
        """The push's verdict is in (from the flush, a closing runner, or score() giving up)."""
        error = self.apply()
        fut = self.fut
        if fut is None or fut.done():
            return
        if self._state == _CANCELLED:
            # Not by score() (it ends its own wait first): the coalescer's runner or flush was
            # cancelled (its loop closing). The sample may never have been queued, and no
            # result or timeout would end the wait.
            fut.cancel()
            return
        if error is not None:
            fut.set_exception(error)
            return
        entry = self.entry
        producer = self.producer
        if self._value[0] == DUPLICATE:
            # Queued before, unchanged: its result may have been read past already. Read the
            # done stream again from its start, keeping what lands.
            self.listener.reread(entry.batch, [entry.partition], producer.keys, group=producer.config.group)
        if self.timeout_s is not None:
            self.tick = self.listener.arm(fut, entry.batch, entry.uid, self.timeout_s)
