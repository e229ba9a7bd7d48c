"""The push script: claim each sample's index and uid in its batch, then queue it.

One call per (stream, chunk) does, for every entry: look up what the batch
already holds for the entry's index and uid (one HMGET per batch, not one
command per entry), and then

* nothing there: record the claim (index -> "digest uid", uid -> index), the
  response length, and XADD the entry: status ``FRESH``. A sample with its
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
Entries travel as one msgpack blob (packing an argument per field costs the
client more than the whole call); the digest is of the encoded trajectory,
which is deterministic for equal trajectories.
"""

from __future__ import annotations

import zlib
from typing import Any

import msgpack

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
]

FRESH, DUPLICATE, INDEX_TAKEN, UID_ELSEWHERE, CONTENT_DIFFERS = 0, 1, 2, 3, 4
CONFLICT_REASONS = {
    INDEX_TAKEN: "its index was already pushed under another uid",
    # (UID_ELSEWHERE also when a custom uid is the default uid of another index: refused by the producer)
    UID_ELSEWHERE: "its uid was already pushed at another index",
    CONTENT_DIFFERS: "its uid was already pushed with other content",
}

PUSH_SCRIPT = """
local ttl = tonumber(ARGV[1])
local write_lens = ARGV[2] == '1'
local rows = cmsgpack.unpack(ARGV[3])
local SLICE = 500  -- unpack() is bounded by the Lua stack
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
      if row[8] == 0 then fields[#fields + 1] = 'u' .. row[3] end
    end
    local got = redis.call('HMGET', KEYS[k], unpack(fields))
    for j = 1, #fields do
      if got[j] then known[fields[j]] = got[j] end
    end
  end
  local claims, lens = {}, {}
  for _, n in ipairs(list) do
    local row = rows[n]
    local index, uid, implied = row[2], row[3], row[8] == 1
    local at = tostring(index)
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
      if row[5] >= 0 then
        lens[#lens + 1] = index
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
  for lo = 1, #claims, 2 * SLICE do
    redis.call('HSET', KEYS[k], unpack(claims, lo, math.min(lo + 2 * SLICE - 1, #claims)))
  end
  if #claims > 0 then
    redis.call('EXPIRE', KEYS[k], ttl, 'NX')
  end
  if write_lens then
    for lo = 1, #lens, 2 * SLICE do
      redis.call('HSET', KEYS[k + 1], unpack(lens, lo, math.min(lo + 2 * SLICE - 1, #lens)))
    end
  end
end
for n, row in ipairs(rows) do
  if status[n] == 0 then
    redis.call('XADD', KEYS[1], '*', 'd', row[6], 'h', row[7])
  end
end
return status
"""


def digest(payload: bytes) -> str:
    # Two fast checksums (64 bits): this tells a changed sample from a retried one, it
    # is not a defence against a forger; blake2b cost ~3 us a 2 KB sample, this ~0.5.
    return f"{zlib.crc32(payload):08x}{zlib.adler32(payload):08x}"


def push_args(
    stream: str,
    rows: list[tuple[str, int, str, str, int, bytes, bytes, int]],
    claims_key: Any,
    lengths_key: Any,
    *,
    ttl_s: int,
    write_lengths: bool,
) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV for PUSH_SCRIPT. ``rows``: (batch, index, uid, digest, length or -1,
    payload, header, 1 if uid is the default uid of its index else 0).
    ``claims_key(batch)`` / ``lengths_key(batch)`` name the batch's hashes."""
    keys = [stream]
    slot: dict[str, int] = {}
    packed = []
    for batch, index, uid, dig, length, payload, header, implied in rows:
        k = slot.get(batch)
        if k is None:
            k = slot[batch] = len(keys) + 1  # Lua is 1-based
            keys.append(claims_key(batch))
            keys.append(lengths_key(batch))
        packed.append((k, index, uid, dig, length, payload, header, implied))
    return keys, [ttl_s, "1" if write_lengths else "0", msgpack.packb(packed, use_bin_type=False)]
