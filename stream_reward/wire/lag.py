"""A consumer group's lag, in stream entries and in samples: what autoscalers read.

Redis counts a group's lag (XINFO GROUPS ``lag``, Redis >= 7) in stream entries, and an
entry carries up to ``samples_per_entry`` samples (16 by default): KEDA's ``redis-streams``
scaler, which reads that number, sees a sixteenth of the work at full entries. The samples
are known exactly without reading the entries' payloads: every entry a push script queues
is stamped with the samples queued on its stream before it (``wire.push.FIELD_STAMP``) and
the stream's ``pushed`` hash counts the samples queued ever, so the samples not yet
delivered to a group are that count less the stamp of the first entry past the group's
last delivered one. Two round trips per stream, whatever the backlog.

Only the samples queued by our scripts are counted: an entry XADDed by hand carries no
stamp and is in no count. Where the count cannot be read that way (such an entry is the
first undelivered one; the ``pushed`` hash deleted while its stream stayed), the samples
are an estimate: the lag in entries at the mean samples an entry, and where Redis knows no
lag (after an AOF reload, or entries deleted mid-stream) the stream's length less the
group's pending entries, which errs high. ``GroupLag.exact`` says which.

Samples *pending* (delivered, not acked) are not counted here: no counter follows them
per group, and reading the pending entries costs what this avoids. Each worker counts the
samples it holds (``stream_reward_in_flight``); their sum across workers is that number.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError

from stream_reward.config import SAMPLES_PER_ENTRY
from stream_reward.wire.entries import group_state
from stream_reward.wire.keys import Keys
from stream_reward.wire.push import FIELD_STAMP

__all__ = ["GroupLag", "samples_behind", "read_group_lags", "read_partition_lags"]


@dataclass(frozen=True, slots=True)
class GroupLag:
    """One consumer group on one partition's stream."""

    partition: int
    stream: str
    group: str
    lag_entries: int | None  # Redis's count of entries not yet delivered (None: it cannot tell)
    lag_samples: int  # samples in those entries
    exact: bool  # lag_samples from the stamps; False: an estimate (see the module doc)
    pending_entries: int  # delivered, not yet acked
    consumers: int


def samples_behind(
    *,
    pushed_samples: Any,
    pushed_entries: Any,
    first_undelivered: Mapping[Any, Any] | None,
    lag_entries: int | None,
    length: int,
    pending_entries: int,
    samples_per_entry: int = SAMPLES_PER_ENTRY,
) -> tuple[int, bool]:
    """Samples not yet delivered to a group, and whether the count is exact.

    ``pushed_samples``/``pushed_entries``: the stream's ``pushed`` hash fields as read
    (None where missing); ``first_undelivered``: the fields of the first entry past the
    group's last delivered one (None: every entry was delivered)."""
    if first_undelivered is None:
        return 0, True
    stamp = first_undelivered.get(FIELD_STAMP, first_undelivered.get(FIELD_STAMP.decode()))
    pushed = int(pushed_samples or 0)
    if stamp is not None and pushed_samples is not None and int(stamp) <= pushed:
        return pushed - int(stamp), True
    lag = lag_entries if lag_entries is not None else max(0, length - pending_entries)
    entries = int(pushed_entries or 0)
    mean = pushed / entries if entries else samples_per_entry
    return math.ceil(lag * mean), False


async def read_group_lags(
    client: Any, keys: Keys, group: str | None = None, *, samples_per_entry: int = SAMPLES_PER_ENTRY
) -> list[GroupLag]:
    """Every group (or ``group`` alone) of every partition's stream, partition by partition."""
    out: list[GroupLag] = []
    for p in range(keys.partitions):
        out += await read_partition_lags(client, keys, p, group, samples_per_entry=samples_per_entry)
    return out


async def read_partition_lags(
    client: Any, keys: Keys, partition: int, group: str | None = None, *, samples_per_entry: int = SAMPLES_PER_ENTRY
) -> list[GroupLag]:
    """Every group (or ``group`` alone) of one partition's stream; none for a stream never
    created. Two round trips; the partition's keys share a hash tag, so each pipeline stays
    on one cluster node. The pushed count is read before the first undelivered entry: a push
    landing between is in neither (its stamp is the count read)."""
    stream = keys.stream(partition)
    async with client.pipeline(transaction=False) as pipe:
        pipe.xinfo_groups(stream)
        pipe.hmget(keys.pushed(partition), "samples", "entries")
        pipe.xlen(stream)
        groups, counts, length = await pipe.execute(raise_on_error=False)
    if isinstance(groups, ResponseError) and "no such key" in str(groups):
        return []
    for reply in (groups, counts, length):
        if isinstance(reply, Exception):
            raise reply
    samples, entries = counts
    rows = [g for g in map(group_state, groups) if group is None or g["name"] == group]
    if not rows:
        return []
    async with client.pipeline(transaction=False) as pipe:
        for g in rows:
            last = g["last_delivered_id"] or "0-0"
            pipe.xrange(stream, min="-" if last == "0-0" else f"({last}", count=1)
        firsts = await pipe.execute()
    out = []
    for g, first in zip(rows, firsts):
        behind, exact = samples_behind(
            pushed_samples=samples,
            pushed_entries=entries,
            first_undelivered=first[0][1] if first else None,
            lag_entries=g["lag"],
            length=int(length),
            pending_entries=g["pending"],
            samples_per_entry=samples_per_entry,
        )
        out.append(GroupLag(partition, stream, g["name"], g["lag"], behind, exact, g["pending"], g["consumers"]))
    return out
