"""Write-once results: the exactly-once half of "at-least-once delivery, exactly-once results".

One Lua call per flush does, for every scored sample: mark the sample's uid in
the batch's ledger of this consumer group unless it is marked already (results
are kept per (group, uid), see ``Keys.results``); only if it was the first
write, add the result to the batch's ``done`` stream, which the aggregator and
the result listener read, and dead-letter it if asked; and XACK the entries
whose last sample this is. Running it
as one script makes "result durable, then ack" atomic, and makes a redelivered
sample (a reclaimed entry whose first worker died after writing) a no-op
instead of a second count.

Each result is stored once, in the done stream: the ledger hash holds a mark
per uid (all the write-once check needs; status counts read its length), not a
second copy of the record. A done-stream entry is one flush of one batch: a
single field, ``r``, holding that flush's result records back to back (each a
msgpack array, ``wire.codec.encode_result``), which a reader unpacks in one
pass (``done_rows``). Field pairs uid -> record cost the server a field each
and every reader a bytes object and a dict slot each.

Every key one call touches belongs to one partition (its stream, dead-letter
stream, and the batches' ledgers and done streams under that partition's tag),
so a call never spans two Redis Cluster slots. Entries of several partitions
settle in one pipelined round trip on a single node; in a cluster (which runs
no scripts in pipelines) as one concurrent call per partition.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from redis.exceptions import NoScriptError

from stream_reward.wire.codec import packb, result_rows
from stream_reward.wire.connection import is_cluster
from stream_reward.wire.keys import Keys
from stream_reward.wire.packed import pack_command

if TYPE_CHECKING:
    from stream_reward.wire.lane import Lane

__all__ = ["LedgerItem", "LedgerWriter", "DLQ_MAXLEN", "DONE_FIELD", "done_rows"]

# Dead letters are kept for inspection and redrive, but not without bound.
DLQ_MAXLEN = 100_000

# The one field of a done-stream entry: the flush's result records, back to back.
DONE_FIELD = b"r"


def done_rows(fields: dict[Any, Any]) -> tuple[list[Any], str | None]:
    """The unpacked result records of one done-stream entry, in order; and, when
    the entry holds bytes that are not records, what stopped the reading there."""
    data = fields.get(DONE_FIELD, fields.get("r"))
    if not isinstance(data, (bytes, bytearray)):
        return [], "no results field"
    return result_rows(bytes(data))


_WRITE_SCRIPT = """
local group = ARGV[1]
local ttl = tonumber(ARGV[2])
local dlq_maxlen = ARGV[3]
-- The items come as one msgpack blob: packing one argument per field costs the
-- client more than everything else the worker does for a sample.
local items = cmsgpack.unpack(ARGV[4])
local SLICE = 1000  -- unpack() is bounded by the Lua stack
local by_batch = {}
local acks = {}
for _, item in ipairs(items) do
  local k = item[2]
  if k > 0 then
    local list = by_batch[k]
    if not list then
      list = {}
      by_batch[k] = list
    end
    list[#list + 1] = item
  end
  if item[5] ~= '' and k == 0 then
    -- A dead letter with no batch has no uid to be written once by. Its entry is acked
    -- here, and the letter written only if that ack took it off the pending list: a call
    -- sent again (its reply lost after it ran) finds the entry acked and adds nothing.
    if item[1] == '' or redis.call('XACK', KEYS[1], group, item[1]) == 1 then
      redis.call('XADD', KEYS[2], 'MAXLEN', '~', dlq_maxlen, '*', 'e', item[5])
    end
  elseif item[1] ~= '' then
    acks[#acks + 1] = item[1]
  end
end
-- Write-once per uid, a few commands per batch rather than one per sample (each
-- redis.call costs more than the work it does): HMGET which uids are marked
-- already, mark the others, and add their results to the done stream as one
-- entry, the records back to back.
local written = 0
for k, list in pairs(by_batch) do
  local marks = {}
  local records = {}
  local taken = {}
  for lo = 1, #list, SLICE do
    local hi = math.min(lo + SLICE - 1, #list)
    local uids = {}
    for i = lo, hi do
      uids[#uids + 1] = list[i][3]
    end
    local existing = redis.call('HMGET', KEYS[k], unpack(uids))
    for i = lo, hi do
      local uid = list[i][3]
      if not existing[i - lo + 1] and not taken[uid] then
        taken[uid] = true
        marks[#marks + 1] = uid
        marks[#marks + 1] = '1'
        records[#records + 1] = list[i][4]
        -- A dead letter only with its sample's first result: a sample already scored
        -- (another sample of its entry failed the entry, or a slow worker) is not dead.
        if list[i][5] ~= '' then
          redis.call('XADD', KEYS[2], 'MAXLEN', '~', dlq_maxlen, '*', 'e', list[i][5])
        end
      end
    end
  end
  for lo = 1, #marks, 2 * SLICE do
    redis.call('HSET', KEYS[k], unpack(marks, lo, math.min(lo + 2 * SLICE - 1, #marks)))
  end
  if #records > 0 then
    redis.call('XADD', KEYS[k + 1], '*', 'r', table.concat(records))
  end
  written = written + #records
  redis.call('EXPIRE', KEYS[k], ttl, 'NX')
  redis.call('EXPIRE', KEYS[k + 1], ttl, 'NX')
end
for lo = 1, #acks, SLICE do
  redis.call('XACK', KEYS[1], group, unpack(acks, lo, math.min(lo + SLICE - 1, #acks)))
end
return written
"""


@dataclass(slots=True)
class LedgerItem:
    """One sample to settle. ``result`` None: nothing to record (a dead letter whose
    batch is unknown). ``entry_id`` empty: nothing to ack (a result written by the
    aggregator or a redrive). ``ack`` False: its entry holds other samples not yet
    settled, and is acked with the last of them."""

    entry_id: bytes | str
    batch_id: str | None
    uid: str | None
    result: bytes | None
    dead_letter: bytes | None = None
    ack: bool = True


class LedgerWriter:
    """Settles a worker's flushes: on ``lane`` when given (a single node's connection, see
    wire/lane.py), else through redis-py."""

    def __init__(self, client: Any, keys: Keys, group: str, *, result_ttl_s: int, lane: Lane | None = None) -> None:
        self._client = client
        self._cluster = is_cluster(client)
        self._lane = None if self._cluster else lane
        self._script = client.register_script(_WRITE_SCRIPT)
        self._keys = keys
        self._group = group
        self._ttl = result_ttl_s

    def _call_args(self, partition: int, items: list[LedgerItem]) -> tuple[list[str], list[Any]]:
        keys = [self._keys.stream(partition), self._keys.dead_letters(partition)]
        slot_of: dict[str, int] = {}
        rows = []
        for item in items:
            k = 0
            if item.result is not None and item.batch_id is not None and item.uid is not None:
                k = slot_of.get(item.batch_id, 0)
                if not k:
                    k = len(keys) + 1  # Lua is 1-based
                    keys.append(self._keys.results(item.batch_id, partition, self._group))
                    keys.append(self._keys.done(item.batch_id, partition, self._group))
                    slot_of[item.batch_id] = k
            entry = item.entry_id if item.ack else ""
            rows.append((entry, k, item.uid or "", item.result or b"", item.dead_letter or b""))
        return keys, [self._group, self._ttl, DLQ_MAXLEN, packb(rows, bin_type=False)]

    async def write(self, partition: int, items: list[LedgerItem]) -> int:
        """Settle ``items`` of one partition in one round trip; returns how many results were new."""
        if not items:
            return 0
        keys, args = self._call_args(partition, items)
        if self._lane is not None:
            (new,) = await self._on_lane([(keys, args)])
            return new
        return int(await self._script(keys=keys, args=args))

    async def write_partitions(self, batch: dict[int, list[LedgerItem]]) -> int:
        """Settle the items of several partitions; returns how many results were new.

        In a cluster the partitions' calls are independent: when some fail, the
        ones that succeeded are removed from ``batch`` before the error is
        raised, so that a retry of the same dict sends only what is left (a
        dead letter is appended, not written once, and must not be sent twice).
        """
        if len(batch) == 1:
            ((partition, items),) = batch.items()
            return await self.write(partition, items)
        if self._lane is not None:
            calls = [self._call_args(partition, items) for partition, items in batch.items() if items]
            return sum(await self._on_lane(calls))
        if not self._cluster:
            async with self._client.pipeline(transaction=False) as pipe:
                for partition, items in batch.items():
                    if items:
                        keys, args = self._call_args(partition, items)
                        await self._script(keys=keys, args=args, client=pipe)  # queued; the script is loaded first
                replies = await pipe.execute()
            return sum(int(r) for r in replies)
        parts = list(batch)
        replies = await asyncio.gather(*(self.write(p, batch[p]) for p in parts), return_exceptions=True)
        errors = [r for r in replies if isinstance(r, BaseException)]
        if errors:
            for partition, reply in zip(parts, replies):
                if not isinstance(reply, BaseException):
                    del batch[partition]
            raise errors[0]
        return sum(replies)  # type: ignore[arg-type]

    async def _on_lane(self, calls: list[tuple[list[str], list[Any]]]) -> list[int]:
        """The calls in one write on the lane; each one's count of new results. A script
        cache found empty (a restarted server) is loaded again, and only the calls it
        refused go again: a dead letter is appended, and must not be written twice.
        An error reply is raised once every call has run, as a pipeline raises it."""
        assert self._lane is not None
        out = [0] * len(calls)
        todo = list(range(len(calls)))
        for attempt in range(2):
            sha = self._script.sha
            replies = await self._lane.call(
                [pack_command("EVALSHA", sha, len(keys), *keys, *args) for keys, args in (calls[i] for i in todo)]
            )
            refused = [i for i, reply in zip(todo, replies) if isinstance(reply, NoScriptError)]
            for i, reply in zip(todo, replies):
                if not isinstance(reply, BaseException):
                    out[i] = int(reply)
            for reply in replies:
                if isinstance(reply, BaseException) and not isinstance(reply, NoScriptError):
                    raise reply
            if not refused:
                return out
            if attempt == 0:
                (loaded,) = await self._lane.call([pack_command("SCRIPT", "LOAD", self._script.script)])
                if isinstance(loaded, BaseException):
                    raise loaded
            todo = refused
        raise NoScriptError("the result script was refused again right after it was loaded")
