"""The state every concern of a worker shares, and the helpers more than one of them uses.

``Worker`` (``consumer``) is put together from one class per concern (reading, opening
entries, starting samples, writing results, reclaiming, stopping, housekeeping), each in
a module of its own; they all work on the one worker's fields, which are set up here, in
one place, with what each field is for. The concerns import downward only: this module
imports none of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import time
from collections import defaultdict, deque
from collections.abc import Iterator
from typing import Any

from stream_reward.config import SAMPLES_PER_ENTRY, ConsumerConfig
from stream_reward.scoring.scorer import Scorer
from stream_reward.wire.keys import Keys
from stream_reward.wire.ledger import LedgerItem, LedgerWriter
from stream_reward.worker.members import Member

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

__all__ = ["WorkerState", "WorkerStats", "sleep_unless", "sole_error"]


class WorkerStats:
    """Counters a worker keeps; heartbeats and metrics read them."""

    __slots__ = ("scored", "failed", "duplicates", "dead_letters", "reclaimed", "spilled", "in_flight")

    def __init__(self) -> None:
        self.scored = self.failed = self.duplicates = self.dead_letters = self.reclaimed = self.in_flight = 0
        self.spilled = 0  # samples handed back to the stream (Worker._hand_back: no room here, or at a stop)

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


class WorkerState:
    """A worker's fields: its configuration, its client, and what it holds in flight."""

    # Set by Worker.run once connected.
    _ledger: LedgerWriter
    _requeue: Any  # REQUEUE_SCRIPT (a hand-back)
    _release_script: Any  # RELEASE_SCRIPT (a stop's release)
    _uncount: Any  # UNCOUNT_SCRIPT (a sweep's claim of entries this worker holds)

    def __init__(
        self,
        redis_url: str,
        scorer: Scorer,
        config: ConsumerConfig | None = None,
        *,
        client: Any = None,
        hooks: Any = None,
    ) -> None:
        self.config = config or ConsumerConfig()
        self.keys = Keys(self.config.namespace, self.config.partitions)
        self.scorer = scorer
        self.stats = WorkerStats()
        self.hooks = hooks  # optional observer (metrics); see stream_reward.worker.metrics
        self._url = redis_url
        self._client = client
        self._inline = bool(getattr(scorer, "inline", False))
        self._scorer_name = str(getattr(scorer, "name", None) or type(scorer).__name__)
        self._pending: dict[int, list[LedgerItem]] = defaultdict(list)
        self._reserved = 0  # room taken by reads in flight (several when partitions are read apart)
        self._have_pending = asyncio.Event()
        self._room = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        # Entries this worker is scoring or writing: never reclaimed from itself. An entry
        # held longer than reclaim_idle_ms (a slow scorer) would otherwise come back to its
        # own worker, be scored twice, and its delivery count would make it a suspect.
        # The housekeeper also renews them (XCLAIM JUSTID: idle reset, delivery count kept),
        # so that no other worker takes a slow sample from a live one.
        # (partition, entry id): two partitions' streams (on two nodes) can make the same id.
        self._held: set[tuple[int, bytes]] = set()
        # Held by a renewal. A stop's release ends renewals and waits for this first: a
        # renewal already under way would land after the release and make the released
        # entries fresh again (a peer would then wait out reclaim_idle_ms for them).
        self._renewing = asyncio.Lock()
        self._renewals_over = False
        # One reclaim sweep at a time: two (the background one and a burst's last pass)
        # could claim the same entry between XAUTOCLAIM and _process, both count it a
        # delivery, both quarantine it, and the second quarantine would find the first's
        # note and dead-letter an innocent sample as poison.
        self._sweeping = asyncio.Lock()
        self._task_entries: dict[asyncio.Task[None], tuple[int, bytes]] = {}
        # Entries with samples not yet settled, and how many. The sample of an entry that
        # settles last carries the entry's ack, so an entry is acked only once every one
        # of its samples has its result (flushes go out in order).
        # By (partition, entry id): two partitions' streams (on two nodes) can make the same id.
        self._open: dict[tuple[int, bytes], int] = {}
        # Open entries that handed samples back: the samples started here (see _finish_handed).
        self._handed: dict[tuple[int, bytes], list[Member]] = {}
        # The quarantine note of the sample being hunted: a stop drops it before it releases
        # the entry, or a peer could claim the entry and find it there (see _drain).
        self._hunting: tuple[str, bytes] | None = None
        # Notes this worker may have left after a Redis error (a lost reply, then a failed
        # HDEL): an innocent sample's, since nothing crashed. Dropped as soon as Redis
        # answers (the housekeeper, or this worker's next hunt of that sample), before a
        # hunt would find one and dead-letter its sample as poison.
        self._stale_notes: set[tuple[str, bytes]] = set()
        # Entries a flush failed to settle (past the drain deadline): no later flush acks
        # them, since some of their samples have no result.
        self._unsettled: set[tuple[int, bytes]] = set()
        # Samples an entry held in the last read: a read asks for as many entries as
        # leave room for that many samples each.
        self._per_entry = SAMPLES_PER_ENTRY
        self._group_name = self.config.group.encode()
        self._stopping = False
        self._fatal: BaseException | None = None  # what ends run() as a crash would (see _die)
        self._fatal_set = asyncio.Event()
        self._reader_active = False  # while the reader reads new entries: what _spill adds gets read
        self._burst = False  # this run is a burst: its reader ends once it reads nothing
        self._writer_idle = asyncio.Event()
        self._reading = asyncio.Event()  # cleared while suspects are scored alone
        self._stopped = asyncio.Event()  # set with _stopping, for waits that end on a stop
        self._reading.set()
        self._started = time.time()
        self._drain_deadline: float | None = None  # loop time; set when the stop is noticed
        self._give_up = asyncio.Event()  # set past the drain deadline: unwritten results stay pending
        self._beats: deque[tuple[float, int]] = deque()
        self._epoch: str | None = None  # the namespace epoch this worker joined
        self._host = socket.gethostname()


@contextlib.contextmanager
def sole_error() -> Iterator[None]:
    """Raise a task group's only error as itself, as asyncio.TaskGroup did for an error of its
    body, so that callers keep catching BrokerError & co; through nested groups too (the
    background loops run in a group of their own). Several errors stay a group."""
    try:
        yield
    except BaseExceptionGroup as group:
        sole: BaseException = group
        while isinstance(sole, BaseExceptionGroup) and len(sole.exceptions) == 1:
            sole = sole.exceptions[0]
        if sole is group:
            raise
        raise sole from None


async def sleep_unless(event: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds``, or less if ``event`` is set meanwhile."""
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except asyncio.TimeoutError:  # TimeoutError from 3.11 on; not yet on 3.10
        pass
