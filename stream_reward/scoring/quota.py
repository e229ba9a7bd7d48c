"""A global quota for one verifier, held in Redis and shared by every worker process.

Three limits, each optional: requests per minute, tokens per minute, requests in
flight; plus a shared pause after a 429.

**RPM and TPM** are GCRA (the generic cell rate algorithm, as in redis-cell):
each limit keeps a *theoretical arrival time* (TAT) — the moment the budget
already handed out is paid off. A request costing ``c`` (``60/rpm`` seconds for
RPM, ``tokens * 60/tpm`` for TPM) may start at ``max(TAT, now) + c - tau``; the
tolerance ``tau`` is the burst. The acquire script *reserves*: it computes the
start time that satisfies every limit, advances both TATs as if the request
starts then, and returns the wait. The caller sleeps that wait and goes — one
round trip per request, no deny-and-poll loop, and reservations are handed out
in the order the script runs, so two processes interleave instead of racing.
All times come from ``redis.call('TIME')`` inside the script: the server's clock
is the only clock, so hosts with skewed clocks still share one schedule.

**TPM** charges an estimate up front (the real count is known only from the
reply) and ``Lease.settle(actual)`` moves the TAT by the difference afterwards.

**Max in flight** is a sorted set of leases scored by expiry: a worker that dies
holding a lease loses it after ``lease_ttl_s``; a live one renews its leases.

**429s**: ``block_for(s)`` writes a shared *blocked-until*, which the acquire
script checks first, so one worker's 429 pauses every worker. With
``adaptive=True`` a 429 that arrives after a pause has already ended (the pause
did not help) lowers the rate by ``rate_decrease``; the rate climbs back
linearly to the configured one over ``recovery_s``.

Every key of a verifier shares the hash tag of ``Keys.quota(name)``, so the
scripts work on Redis Cluster.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

from stream_reward.config import QuotaConfig
from stream_reward.wire.connection import REDIS_ERRORS, connect, with_reconnect
from stream_reward.wire.keys import DEFAULT_NAMESPACE, Keys

__all__ = ["QuotaLimiter", "Lease"]

log = logging.getLogger(__name__)

_US = 1_000_000
# A reservation this far ahead is checked against the shared pause once more
# before the request goes out: a 429 seen by another worker meanwhile wins.
_RECHECK_AFTER_S = 0.2
_RECHECK_LEAD_S = 0.05
# Idle quota state disappears after a day (its counters with it).
_KEY_TTL_MS = 24 * 3600 * 1000

_GRANTED, _BLOCKED, _INFLIGHT = 0, 1, 2

_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local st = redis.call('HMGET', KEYS[1], 'rtat', 'ttat', 'blocked', 'f', 'fat')
local blocked = tonumber(st[3]) or 0
if blocked > now then
  return {0, blocked - now, 1, 0, 0}
end
local max_inflight = tonumber(ARGV[6])
if max_inflight > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= max_inflight then
    local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
    return {0, math.max(0, tonumber(first[2]) - now), 2, 0, 0}
  end
end
local f = 1
if ARGV[9] == '1' and st[4] then
  f = math.min(1, tonumber(st[4]) + (now - (tonumber(st[5]) or now)) / tonumber(ARGV[10]))
end
local rpm_t, rpm_tau = tonumber(ARGV[1]), tonumber(ARGV[2])
local tpm_t, tpm_tau = tonumber(ARGV[3]), tonumber(ARGV[4])
local rtat, ttat = tonumber(st[1]) or 0, tonumber(st[2]) or 0
local start = now
local rcost, tcost = 0, 0
if rpm_t > 0 then
  rcost = rpm_t / f
  start = math.max(start, math.max(rtat, now) + rcost - math.max(rpm_tau, rcost))
end
if tpm_t > 0 then
  tcost = tonumber(ARGV[5]) * tpm_t / f
  start = math.max(start, math.max(ttat, now) + tcost - math.max(tpm_tau, tcost))
end
start = math.ceil(start)
if rpm_t > 0 then
  redis.call('HSET', KEYS[1], 'rtat', math.ceil(math.max(rtat, start) + rcost))
end
if tpm_t > 0 then
  redis.call('HSET', KEYS[1], 'ttat', math.ceil(math.max(ttat, start) + tcost))
end
if max_inflight > 0 then
  redis.call('ZADD', KEYS[2], start + tonumber(ARGV[8]), ARGV[7])
  redis.call('PEXPIRE', KEYS[2], ARGV[11])
end
redis.call('HINCRBY', KEYS[1], 'requests', 1)
redis.call('HINCRBY', KEYS[1], 'tokens', ARGV[5])
redis.call('PEXPIRE', KEYS[1], ARGV[11])
return {1, start - now, 0, start, math.floor(f * 1000000)}
"""

_RELEASE = """
if ARGV[1] ~= '' then
  redis.call('ZREM', KEYS[2], ARGV[1])
end
local delta = tonumber(ARGV[2])
if delta ~= 0 then
  if redis.call('EXISTS', KEYS[1]) == 1 then
    redis.call('HINCRBY', KEYS[1], 'tokens', delta)
    local ttat = tonumber(redis.call('HGET', KEYS[1], 'ttat'))
    local per_token = tonumber(ARGV[3])
    if ttat and per_token > 0 then
      redis.call('HSET', KEYS[1], 'ttat', math.ceil(ttat + delta * per_token))
    end
  end
end
return 1
"""

_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
return redis.call('ZADD', KEYS[2], 'XX', 'CH', now + tonumber(ARGV[2]), ARGV[1])
"""

_BLOCK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local st = redis.call('HMGET', KEYS[1], 'blocked', 'f', 'fat', 'last429')
local blocked = tonumber(st[1]) or 0
local untl = now + tonumber(ARGV[1])
if untl > blocked then
  redis.call('HSET', KEYS[1], 'blocked', untl)
end
redis.call('HINCRBY', KEYS[1], 'http_429', 1)
local f = 1
if st[2] then
  f = math.min(1, tonumber(st[2]) + (now - (tonumber(st[3]) or now)) / tonumber(ARGV[3]))
end
-- A 429 during a pause is a straggler of the same overload: it neither counts
-- as a repeat nor lowers the rate again.
if blocked <= now then
  local last = tonumber(st[4]) or 0
  if ARGV[2] == '1' and now - last <= tonumber(ARGV[6]) then
    f = math.max(tonumber(ARGV[5]), f * tonumber(ARGV[4]))
    redis.call('HSET', KEYS[1], 'f', tostring(f), 'fat', now)
  end
  redis.call('HSET', KEYS[1], 'last429', now)
end
redis.call('PEXPIRE', KEYS[1], ARGV[7])
return {math.max(untl, blocked) - now, math.floor(f * 1000000)}
"""

_PAUSED = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local blocked = tonumber(redis.call('HGET', KEYS[1], 'blocked')) or 0
return math.max(0, blocked - now)
"""

# Read-only (status runs it): expired leases are not counted rather than removed.
_STATE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local st = redis.call('HMGET', KEYS[1], 'rtat', 'ttat', 'blocked', 'f', 'fat', 'requests', 'tokens', 'http_429')
local f = 1
if st[4] then
  f = math.min(1, tonumber(st[4]) + (now - (tonumber(st[5]) or now)) / tonumber(ARGV[1]))
end
return {now, tonumber(st[1]) or 0, tonumber(st[2]) or 0, tonumber(st[3]) or 0, math.floor(f * 1000000),
        tonumber(st[6]) or 0, tonumber(st[7]) or 0, tonumber(st[8]) or 0, redis.call('ZCOUNT', KEYS[2], now + 1, '+inf')}
"""


class _Done:
    """An awaitable that is already done: ``settle`` works with and without ``await``
    (a coroutine left un-awaited would warn)."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, None]:
        yield from ()


_DONE = _Done()


@dataclass
class Lease:
    """A granted request slot. ``waited_s``: how long the caller was held back;
    ``start_at``: the reserved start, server epoch seconds."""

    id: str
    tokens: int
    waited_s: float = 0.0
    start_at: float = 0.0
    rate_factor: float = 1.0
    actual_tokens: int | None = None
    _limiter: QuotaLimiter | None = field(default=None, repr=False)
    _released: bool = field(default=False, repr=False)

    def settle(self, actual_tokens: int) -> _Done:
        """Record the tokens the call really used; TPM is corrected when the lease ends
        (at once if it already has). Works with or without ``await``."""
        self.actual_tokens = max(0, int(actual_tokens))
        if self._released and self._limiter is not None:
            delta = self.actual_tokens - self.tokens
            self.tokens = self.actual_tokens
            if delta:
                self._limiter._background(self._limiter._release_call("", delta, self.rate_factor))
        return _DONE


class _LeaseContext:
    def __init__(self, limiter: QuotaLimiter, tokens: int | None) -> None:
        self._limiter = limiter
        self._tokens = tokens
        self._lease: Lease | None = None
        self._renewer: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Lease:
        self._lease = await self._limiter.acquire(self._tokens)
        if self._limiter.config.max_concurrent:
            self._renewer = asyncio.create_task(self._limiter._renew_forever(self._lease))
        return self._lease

    async def __aexit__(self, *exc: object) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            self._renewer = None
        if self._lease is not None:
            await self._limiter.release(self._lease)


class QuotaLimiter:
    """``async with limiter.lease(tokens) as lease: ...; lease.settle(used)``.

    Never touches the event loop in ``__init__``: the Redis client (when given a
    URL) and the scripts are set up on first use, inside the running loop.
    """

    def __init__(self, redis_url_or_client: Any, config: QuotaConfig, *, namespace: str = DEFAULT_NAMESPACE) -> None:
        self.config = config
        self.namespace = namespace
        if isinstance(redis_url_or_client, str):
            self._url: str | None = redis_url_or_client
            self._client: Any = None
            self._owns_client = True
        else:
            self._url = None
            self._client = redis_url_or_client
            self._owns_client = False
        prefix = Keys(namespace).quota(config.name)
        self.keys = [f"{prefix}:state", f"{prefix}:inflight"]
        self._rpm_t_us = 60 * _US / config.max_rpm if config.max_rpm else 0.0
        self._tpm_t_us = 60 * _US / config.max_tpm if config.max_tpm else 0.0
        self._rpm_tau_us = self._rpm_t_us * config.burst
        self._tpm_tau_us = self._tpm_t_us * config.estimated_tokens_per_request * config.burst
        self._scripts: dict[str, Any] | None = None
        self._freed: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        # loop.time() until which we know the quota is paused (from wait lengths
        # the server computed, never from comparing our clock with its clock).
        self._paused_until = 0.0

    # ------------------------------------------------------------------ plumbing
    @property
    def client(self) -> Any:
        if self._client is None:
            assert self._url is not None
            self._client = connect(self._url)
        return self._client

    def _script(self, name: str) -> Any:
        if self._scripts is None:
            client = self.client
            self._scripts = {
                n: client.register_script(src)
                for n, src in (
                    ("acquire", _ACQUIRE),
                    ("release", _RELEASE),
                    ("renew", _RENEW),
                    ("block", _BLOCK),
                    ("paused", _PAUSED),
                    ("state", _STATE),
                )
            }
        return self._scripts[name]

    async def _call(self, name: str, args: list[Any], *, what: str) -> Any:
        script = self._script(name)
        return await with_reconnect(lambda: script(keys=self.keys, args=args), what=what)

    def _background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _wake_waiters(self) -> None:
        if self._freed is not None:
            freed, self._freed = self._freed, asyncio.Event()
            freed.set()

    # ------------------------------------------------------------------ leases
    def lease(self, tokens: int | None = None) -> _LeaseContext:
        """Wait for room under every limit, then hold a slot for the duration of the block."""
        return _LeaseContext(self, tokens)

    def _pause_locally(self, seconds: float) -> None:
        self._paused_until = max(self._paused_until, asyncio.get_running_loop().time() + seconds)

    async def acquire(self, tokens: int | None = None) -> Lease:
        """The low-level half of ``lease``: returns a Lease the caller must ``release``
        (and, for calls longer than ``lease_ttl_s`` under max_inflight, renew)."""
        cfg = self.config
        tokens = cfg.estimated_tokens_per_request if tokens is None else max(0, int(tokens))
        loop = asyncio.get_running_loop()
        began = loop.time()
        inflight_poll_s = 0.005
        lease_id = uuid.uuid4().hex
        args = [
            self._rpm_t_us,
            self._rpm_tau_us,
            self._tpm_t_us,
            self._tpm_tau_us,
            tokens,
            cfg.max_concurrent or 0,
            lease_id,
            int(cfg.lease_ttl_s * _US),
            int(cfg.adaptive),
            cfg.recovery_s * _US,
            _KEY_TTL_MS,
        ]
        while True:
            if self._paused_until > loop.time():
                await asyncio.sleep(self._paused_until - loop.time() + random.random() * 0.01)
            try:
                granted, wait_us, code, start_us, f_ppm = await self._call("acquire", args, what="quota acquire")
            except asyncio.CancelledError:
                # The script may have run: do not leave a lease behind to block others until its TTL.
                if cfg.max_concurrent:
                    self._background(self._release_call(lease_id, 0, 1.0))
                raise
            if granted:
                lease = Lease(lease_id, tokens, start_at=start_us / _US, rate_factor=f_ppm / _US, _limiter=self)
                wait = wait_us / _US
                if wait > 0:
                    target = loop.time() + wait
                    paused = False
                    try:
                        if wait >= _RECHECK_AFTER_S:
                            # Check a little before the slot, so the round trip
                            # (or a Redis hiccup) does not make the request late.
                            await asyncio.sleep(wait - _RECHECK_LEAD_S)
                            paused = await self._paused()
                        if not paused:
                            await asyncio.sleep(max(0.0, target - loop.time()))
                    except asyncio.CancelledError:
                        self._background(self.release(lease))
                        raise
                    if paused:
                        # Another worker hit a 429 while we slept: our slot is
                        # inside the pause. Give it up and queue after the pause.
                        await self.release(lease)
                        lease_id = uuid.uuid4().hex
                        args[6] = lease_id
                        continue
                lease.waited_s = loop.time() - began
                return lease
            if code == _BLOCKED:
                self._pause_locally(wait_us / _US)
                continue
            # Max in flight reached: a release in this process wakes us at once;
            # releases elsewhere are noticed by polling, with a growing interval.
            if self._freed is None:
                self._freed = asyncio.Event()
            timeout = min(inflight_poll_s, max(wait_us / _US, 0.001))
            try:
                await asyncio.wait_for(self._freed.wait(), timeout)
            except asyncio.TimeoutError:  # TimeoutError from 3.11 on; not yet on 3.10
                pass
            inflight_poll_s = min(inflight_poll_s * 2, 0.1)

    async def _paused(self) -> bool:
        remaining_us = await self._call("paused", [], what="quota check")
        if remaining_us > 0:
            self._pause_locally(remaining_us / _US)
            return True
        return False

    async def release(self, lease: Lease) -> None:
        """Give the in-flight slot back and settle TPM with the actual token count."""
        if lease._released:
            return
        lease._released = True
        delta = 0 if lease.actual_tokens is None else lease.actual_tokens - lease.tokens
        if lease.actual_tokens is not None:
            lease.tokens = lease.actual_tokens
        lease_id = lease.id if self.config.max_concurrent else ""
        if lease_id or delta:
            await self._release_call(lease_id, delta, lease.rate_factor)
        self._wake_waiters()

    async def _release_call(self, lease_id: str, delta: int, rate_factor: float) -> None:
        per_token = self._tpm_t_us / max(rate_factor, 1e-6) if self._tpm_t_us else 0
        try:
            await self._call("release", [lease_id, delta, per_token], what="quota release")
        except Exception as exc:  # the lease expires on its own; never fail a scored sample for this
            log.warning("quota %r: release failed (%s); the lease will expire", self.config.name, type(exc).__name__)

    async def _renew_forever(self, lease: Lease) -> None:
        interval = self.config.lease_ttl_s / 3
        ttl_us = int(self.config.lease_ttl_s * _US)
        while True:
            await asyncio.sleep(interval)
            try:
                await self._script("renew")(keys=self.keys, args=[lease.id, ttl_us])
            except REDIS_ERRORS as exc:
                log.debug("quota %r: lease renewal failed: %s", self.config.name, type(exc).__name__)

    # ------------------------------------------------------------------ 429s
    async def block_for(self, seconds: float) -> None:
        """Pause this verifier for every worker (a 429's Retry-After). Extends, never shortens."""
        cfg = self.config
        seconds = max(0.0, float(seconds))
        remaining_us, f_ppm = await self._call(
            "block",
            [
                int(seconds * _US),
                int(cfg.adaptive),
                cfg.recovery_s * _US,
                cfg.rate_decrease,
                cfg.min_rate_factor,
                cfg.repeat_window_s * _US,
                _KEY_TTL_MS,
            ],
            what="quota block",
        )
        self._pause_locally(remaining_us / _US)
        if cfg.adaptive and f_ppm < _US:
            log.info("quota %r: 429, paused %.2fs; rate lowered to %.0f%%", cfg.name, seconds, f_ppm / _US * 100)

    # ------------------------------------------------------------------ status
    async def state(self) -> dict[str, Any]:
        """Limits, effective rate, counters, leases in flight and the pause, for `status`."""
        now, rtat, ttat, blocked, f_ppm, requests, tokens, http_429, inflight = await self._call(
            "state", [self.config.recovery_s * _US], what="quota state"
        )
        cfg = self.config
        factor = f_ppm / _US
        return {
            "name": cfg.name,
            "max_rpm": cfg.max_rpm,
            "max_tpm": cfg.max_tpm,
            "max_concurrent": cfg.max_concurrent,
            "rate_factor": factor,
            "effective_rpm": cfg.max_rpm * factor if cfg.max_rpm else None,
            "effective_tpm": cfg.max_tpm * factor if cfg.max_tpm else None,
            "requests": requests,
            "tokens": tokens,
            "http_429": http_429,
            "in_flight": inflight,
            "blocked_until": blocked / _US if blocked > now else None,
            "blocked_for_s": max(0.0, (blocked - now) / _US),
            # How far ahead the schedule is booked: the queue for the quota, in seconds.
            "rpm_reserved_ahead_s": max(0.0, (rtat - now) / _US),
            "tpm_reserved_ahead_s": max(0.0, (ttat - now) / _US),
        }

    async def aclose(self) -> None:
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        if self._client is not None and self._owns_client:
            await self._client.aclose()
        self._client = None
        self._scripts = None
        self._freed = None  # bound to this loop; a later loop makes its own
        self._paused_until = 0.0
