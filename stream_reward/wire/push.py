"""The push script: claim each sample's index and uid in its batch, then queue it.

One call per (stream, chunk) does, for every sample: look up what the batch
already holds for the entry's index and uid (one HMGET per batch, not one
command per entry), and then

* nothing there: record the claim (index -> "digest uid", uid -> index), the
  response length, and queue the sample: status ``FRESH``. A sample with its
  default uid (``batch/index``) needs no uid record: its uid names its index,
  and the producer refuses a custom uid that names another index. Half the
  fields for the common case: each costs the server on every push;
* the same uid at the same index with the same content: already queued (a
  retried push, or a second producer pushing the same sample), nothing is
  added: status ``DUPLICATE``;
* anything else: refused, nothing is added: ``INDEX_TAKEN`` (another uid has
  this index), ``UID_ELSEWHERE`` (this uid has another index), ``CONTENT_DIFFERS``.

The check and the XADD run in one script, so two producers racing on one
index cannot both win, and the verdict comes back in the push's own round trip.

The common call is all fresh: no index or uid twice in the call (the client
checks) and none of them in the batch yet (one HMGET per batch checks). It
takes a fast path that runs no Lua per sample: the client lays out the fields
to look up, the claims and the lengths as ready argument ranges, which the
script hands to HMGET / HSET whole, and the samples as ready entries of up to
``per_entry`` samples each (``wire.entries``), which it XADDs as they are; the
answer is a number (every sample ``FRESH``). Anything else takes the
slow path, sample by sample, from a msgpack list of the rows, and queues each
fresh sample as an entry of its own (cut out of its prepared entry); the answer
is the list of verdicts, then that number. The number is the stream's count of
samples queued, once the call's are: it places the call before or after a
backlog reading of the same count (trainer/backlog.py: _place). Below 0 (-1 less
the count) when the call found the count missing and started it again: a count
on a new base, which cannot be compared with a reading's.

The push's server time is on the producer's critical path (it waits for the
verdict): measured here, a call of 256 entries of 2 KB went from 8.5 to 6.3 us
of server CPU an entry (2.5 ms -> 1.7 ms a call in ``bench throughput``). Payloads travel as arguments of their
own: inside a msgpack blob the script had to copy each out with ``unpack``.
The digest is of the encoded trajectory, which is deterministic for equal
trajectories.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from xxhash import xxh3_64_hexdigest

from stream_reward.wire.codec import packb

__all__ = [
    "PUSH_SCRIPT",
    "FRESH",
    "DUPLICATE",
    "INDEX_TAKEN",
    "UID_ELSEWHERE",
    "CONTENT_DIFFERS",
    "CONFLICT_REASONS",
    "digest",
    "push_args",
    "ENTRY_MAX_BYTES",
    "FIELD_STAMP",
    "REQUEUE_SCRIPT",
    "requeue_args",
]

FRESH, DUPLICATE, INDEX_TAKEN, UID_ELSEWHERE, CONTENT_DIFFERS = 0, 1, 2, 3, 4

# Every entry queued by a script of this module: the samples queued on its stream before
# it (a decimal string). The samples not yet delivered to a group are the stream's pushed
# count less the stamp of the first entry past the group's last delivered one.
FIELD_STAMP = b"n"
CONFLICT_REASONS = {
    INDEX_TAKEN: "its index was already pushed under another uid",
    # (UID_ELSEWHERE also when a custom uid is the default uid of another index: refused by the producer)
    UID_ELSEWHERE: "its uid was already pushed at another index",
    CONTENT_DIFFERS: "its uid was already pushed with other content",
}

# The samples queued on a stream so far (KEYS[1] the stream, KEYS[2] its counts): what
# the next entry is stamped with. Without counts (a new stream, or the hash deleted or
# evicted while the stream stayed), they go on from the newest entry's stamp and sample
# count, so stamps never run backwards and a backlog is never read too low.
_QUEUED_BEFORE = """
local rebuilt = false  -- the counts were missing: this call started them again
local function queued_before()
  local n = redis.call('HGET', KEYS[2], 'samples')
  if n then
    return tonumber(n)
  end
  rebuilt = true
  local base = 0
  local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
  if #last > 0 then
    local f = last[1][2]
    local stamp, heads
    for i = 1, #f, 2 do
      if f[i] == 'n' then stamp = tonumber(f[i + 1]) elseif f[i] == 'h' then heads = f[i + 1] end
    end
    if stamp then
      local ok, count = pcall(function() return select('#', cmsgpack.unpack(heads)) end)
      base = stamp + ((ok and count > 0) and count or 1)
    end
  end
  redis.call('HSET', KEYS[2], 'samples', string.format('%d', base))
  return base
end
"""

PUSH_SCRIPT = (
    _QUEUED_BEFORE
    + """
-- KEYS[1]: the stream; KEYS[2]: its counts of samples and entries pushed; KEYS[k],
-- KEYS[k + 1]: a batch's claims and lengths hashes.
-- ARGV: ttl, '1' to write lengths, the plan, the rows (read on the slow path
-- only), then each prepared entry's payloads and headers.
-- The plan: {quick (1: no index or uid twice in the call), rows, each entry's sample count,
--            {k, claim fields to look up, claims (field, value, ...), lengths (index, length, ...)}, ...}.
local ttl = tonumber(ARGV[1])
local write_lens = ARGV[2] == '1'
local plan = cmsgpack.unpack(ARGV[3])
local nrows = plan[2]
local P = 4  -- entry j's payloads are ARGV[P + 2j - 1], its headers ARGV[P + 2j]
local SLICE = 1000  -- unpack() is bounded by the Lua stack; even, so pairs stay whole
local function sliced(cmd, key, list)
  local out = {}
  for a = 1, #list, SLICE do
    out[#out + 1] = redis.call(cmd, key, unpack(list, a, math.min(a + SLICE - 1, #list)))
  end
  return out
end
local sizes = plan[3]
-- Each entry is stamped 'n' with the samples queued on its stream before it: the samples
-- a group has not been delivered are then the pushed count less the first undelivered
-- entry's stamp (trainer/backlog.py). As a decimal string, like indices.
local queued = queued_before()

-- The fast path: nothing of the call is in its batches yet.
local quick = plan[1] == 1
for b = 4, #plan do
  if not quick then break end
  for _, got in ipairs(sliced('HMGET', KEYS[plan[b][1]], plan[b][2])) do
    for j = 1, #got do
      if got[j] then
        quick = false
        break
      end
    end
  end
end
if quick then
  for b = 4, #plan do
    local p = plan[b]
    sliced('HSET', KEYS[p[1]], p[3])
    redis.call('EXPIRE', KEYS[p[1]], ttl, 'NX')
    if write_lens then
      sliced('HSET', KEYS[p[1] + 1], p[4])
    end
  end
  for j = 1, #sizes do
    redis.call('XADD', KEYS[1], '*', 'd', ARGV[P + 2 * j - 1], 'h', ARGV[P + 2 * j], 'n', string.format('%d', queued))
    queued = queued + sizes[j]
  end
  redis.call('HINCRBY', KEYS[2], 'samples', nrows)
  redis.call('HINCRBY', KEYS[2], 'entries', #sizes)
  return rebuilt and -1 - queued or queued
end

-- The slow path, sample by sample. A row: {k, index, uid, digest, length, implied,
-- entry j, offset and size of its payload there, its header}.
-- Indices and lengths come as decimal strings, as the fast path writes them: Lua
-- would print a number of 15 digits or more as 1e+14, and miss or refuse its claim.
local rows = cmsgpack.unpack(ARGV[4])
local status = {}
local by_batch, order = {}, {}
for n, row in ipairs(rows) do
  local k = row[1]
  local list = by_batch[k]
  if not list then
    list = {}
    by_batch[k] = list
    order[#order + 1] = k
  end
  list[#list + 1] = n
end
for _, k in ipairs(order) do
  local list = by_batch[k]
  local known = {}
  for lo = 1, #list, SLICE do
    local fields = {}
    for i = lo, math.min(lo + SLICE - 1, #list) do
      local row = rows[list[i]]
      fields[#fields + 1] = 'i' .. row[2]
      if row[6] == 0 then fields[#fields + 1] = 'u' .. row[3] end
    end
    local got = redis.call('HMGET', KEYS[k], unpack(fields))
    for j = 1, #fields do
      if got[j] then known[fields[j]] = got[j] end
    end
  end
  local claims, lens = {}, {}
  for _, n in ipairs(list) do
    local row = rows[n]
    local at, uid, implied = row[2], row[3], row[6] == 1
    local fi, fu = 'i' .. at, 'u' .. uid
    local mine = row[4] .. ' ' .. uid
    local ci = known[fi]
    local cu = nil
    if not implied then cu = known[fu] end
    if not ci and not cu then
      known[fi] = mine
      claims[#claims + 1] = fi
      claims[#claims + 1] = mine
      if not implied then
        known[fu] = at
        claims[#claims + 1] = fu
        claims[#claims + 1] = at
      end
      if row[5] ~= '' then
        lens[#lens + 1] = at
        lens[#lens + 1] = row[5]
      end
      status[n] = 0
    elseif ci == mine and (implied or cu == at) then
      status[n] = 1
    elseif ci and string.sub(ci, #row[4] + 2) ~= uid then
      status[n] = 2
    elseif cu and cu ~= at then
      status[n] = 3
    else
      status[n] = 4
    end
  end
  for lo = 1, #claims, SLICE do
    redis.call('HSET', KEYS[k], unpack(claims, lo, math.min(lo + SLICE - 1, #claims)))
  end
  if #claims > 0 then
    redis.call('EXPIRE', KEYS[k], ttl, 'NX')
  end
  if write_lens then
    for lo = 1, #lens, SLICE do
      redis.call('HSET', KEYS[k + 1], unpack(lens, lo, math.min(lo + SLICE - 1, #lens)))
    end
  end
end
local fresh = 0
for n = 1, nrows do
  if status[n] == 0 then
    fresh = fresh + 1
    local row = rows[n]
    local payloads = ARGV[P + 2 * row[7] - 1]
    redis.call('XADD', KEYS[1], '*', 'd', string.sub(payloads, row[8] + 1, row[8] + row[9]), 'h', row[10],
               'n', string.format('%d', queued))
    queued = queued + 1
  end
end
if fresh > 0 then
  redis.call('HINCRBY', KEYS[2], 'samples', fresh)
  redis.call('HINCRBY', KEYS[2], 'entries', fresh)
end
status[nrows + 1] = rebuilt and -1 - queued or queued
return status
"""
)


# Queue entries of one sample each on a stream, stamped and counted as the push script
# does, outside a push: a worker's hand-back (stream_reward.worker.opening: EntryOpening._spill) and a dead
# letter's redrive (ops/deadletters.py), which also deletes the letter in the same call.
REQUEUE_SCRIPT = (
    _QUEUED_BEFORE
    + """
-- KEYS[1]: the stream; KEYS[2]: its counts of samples and entries pushed; KEYS[3]: a
-- dead-letter stream, when ARGV[1] names a letter of it to delete ('' for none); KEYS[4]:
-- when ARGV[3] > 0, the names of the samples handed back from an entry (a set, kept
-- ARGV[2] seconds). ARGV[4...]: ARGV[3] names, then each entry as its field count k,
-- then k fields and values.
if ARGV[1] ~= '' and redis.call('XDEL', KEYS[3], ARGV[1]) == 0 then
  return 0  -- the letter is gone: another redrive queued it already
end
local handed = tonumber(ARGV[3])
if handed > 0 then
  redis.call('SADD', KEYS[4], unpack(ARGV, 4, 3 + handed))
  redis.call('EXPIRE', KEYS[4], ARGV[2])
end
local queued = queued_before()
local added = 0
local i = 4 + handed
while i <= #ARGV do
  local k = tonumber(ARGV[i])
  local call = {'XADD', KEYS[1], '*'}
  for j = 1, 2 * k do
    call[#call + 1] = ARGV[i + j]
  end
  call[#call + 1] = 'n'
  call[#call + 1] = string.format('%d', queued)
  redis.call(unpack(call))
  queued = queued + 1
  added = added + 1
  i = i + 2 * k + 1
end
if added > 0 then
  redis.call('HINCRBY', KEYS[2], 'samples', added)
  redis.call('HINCRBY', KEYS[2], 'entries', added)
  redis.call('HINCRBY', KEYS[2], 'requeued', added)  -- of those, not a producer's
end
return added
"""
)


def requeue_args(
    entries: list[dict[Any, Any]], *, delete_letter: str = "", handed: Sequence[str] = (), handed_ttl_s: int = 0
) -> list[Any]:
    """ARGV for REQUEUE_SCRIPT: each entry's fields, less any old stamp; ``handed``, the
    names of the samples to record as handed back from their entry (KEYS[4]) for
    ``handed_ttl_s``."""
    args: list[Any] = [delete_letter, handed_ttl_s, len(handed), *handed]
    for fields in entries:
        kept = [(k, v) for k, v in fields.items() if k not in (FIELD_STAMP, FIELD_STAMP.decode())]
        args.append(len(kept))
        for k, v in kept:
            args += (k, v)
    return args


# An entry takes no more samples once its payloads pass this: large samples go one or a
# few to an entry, so an entry stays a small read for a worker and for the server.
ENTRY_MAX_BYTES = 256 * 1024


def digest(payload: bytes) -> str:
    # 64 bits of xxh3: this tells a changed sample from a retried one, it is not a
    # defence against a forger. It runs on the trainer's critical path for every sample:
    # 0.06 us for 2 KB, against 1.2 for zlib's crc32 + adler32 and 3 for blake2b.
    return xxh3_64_hexdigest(payload)


def push_args(
    stream: str,
    pushed_key: str,
    rows: list[tuple[str, int, str, str, int, bytes, bytes, int]],
    claims_key: Any,
    lengths_key: Any,
    *,
    ttl_s: int,
    write_lengths: bool,
    per_entry: int,
) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV for PUSH_SCRIPT.
    ``rows``: (batch, index, uid, digest, length or -1, payload, header, 1 if uid is the
    default uid of its index else 0); consecutive rows share an entry, ``per_entry`` at most.
    ``pushed_key`` counts the stream's samples and entries; ``claims_key(batch)`` / ``lengths_key(batch)``
    name the batch's hashes."""
    keys = [stream, pushed_key]
    slot: dict[str, int] = {}
    layout: dict[int, tuple[list[Any], list[Any], list[Any]]] = {}
    packed = []
    blobs: list[bytes] = []
    named = 0
    parts: list[bytes] = []
    heads: list[bytes] = []
    sizes: list[int] = []
    offset = 0
    for batch, index, uid, dig, length, payload, header, implied in rows:
        k = slot.get(batch)
        if k is None:
            k = slot[batch] = len(keys) + 1  # Lua is 1-based
            keys.append(claims_key(batch))
            keys.append(lengths_key(batch))
            layout[k] = ([], [], [])
        fields, claims, lengths = layout[k]
        at = str(index)  # numbers as strings: the script never formats one (see the slow path)
        size = str(length) if length >= 0 else ""
        field = "i" + at
        fields.append(field)
        claims += (field, f"{dig} {uid}")
        if not implied:
            field = f"u{uid}"
            fields.append(field)
            claims += (field, at)
        if size:
            lengths += (at, size)
        if parts and (len(parts) == per_entry or offset + len(payload) > ENTRY_MAX_BYTES):
            blobs += (b"".join(parts), b"".join(heads))
            sizes.append(len(parts))
            parts, heads, offset = [], [], 0
        packed.append((k, at, uid, dig, size, implied, len(blobs) // 2 + 1, offset, len(payload), header))
        parts.append(payload)
        heads.append(header)
        offset += len(payload)
    if parts:
        blobs += (b"".join(parts), b"".join(heads))
        sizes.append(len(parts))
    plan: list[Any] = [0, len(rows), sizes]
    for k, (fields, claims, lengths) in layout.items():
        named += len(set(fields))
        plan.append((k, fields, claims, lengths))
    # The fast path needs every claim field once in the call (a batch's fields are told apart by it).
    plan[0] = 1 if named == sum(len(f) for f, _, _ in layout.values()) else 0
    args = [ttl_s, "1" if write_lengths else "0", packb(plan, bin_type=False), packb(packed, bin_type=False), *blobs]
    return keys, args
