"""Connecting to Redis: URLs, clients, credential masking and reconnect backoff.

Every component takes a URL (``redis://``, ``rediss://`` for TLS, ``unix://``,
``redis+cluster://`` / ``rediss+cluster://`` for a cluster) and builds its client
here, so retry and masking rules live in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any, TypeVar

import redis.asyncio as aredis
from redis.asyncio.cluster import RedisCluster

# The asyncio Retry: redis-py's synchronous one, given to an asyncio client, returns the
# command's coroutine from call_with_retry unawaited, and nothing was ever retried.
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    AuthorizationError,
    BusyLoadingError,
    ClusterDownError,
    MasterDownError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from stream_reward.errors import BrokerError, RedisUnavailableError

__all__ = [
    "connect",
    "mask_url",
    "is_cluster_url",
    "is_cluster",
    "is_transient",
    "is_refusal",
    "is_permanent",
    "fault_text",
    "permanent_error",
    "LogLimiter",
    "with_reconnect",
    "cancel_until_done",
    "GIVE_UP_S",
    "set_default_timeout",
    "DEFAULT_TIMEOUT_S",
    "TRANSIENT_ERRORS",
    "CLUSTER_ERRORS",
    "REDIS_ERRORS",
    "redis_errors",
    "wait_out_refusals",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

# Errors that mean "Redis is (briefly) away", worth waiting out. BusyLoadingError
# (a restarted server replaying its AOF) is a ConnectionError subclass in redis-py.
# In a cluster, CLUSTERDOWN / TRYAGAIN and an uncovered slot are what a failover
# or a resharding looks like from a client: transient too. So are the refusals of a
# server that is there but cannot take the command now: OOM (noeviction at
# maxmemory, until memory frees), READONLY / MASTERDOWN (a replica, mid failover).
# A script refused for OOM ran none of its writes (Redis refuses a script's first
# write only), so sending it again is safe.
# Unannotated on purpose: mypy then knows each member, and accepts ``except (RedisError, *TRANSIENT_ERRORS)``.
TRANSIENT_ERRORS = (
    RedisConnectionError,
    RedisTimeoutError,
    OSError,
    ClusterDownError,
    TryAgainError,
    SlotNotCoveredError,
    OutOfMemoryError,
    ReadOnlyError,
    MasterDownError,
)
# Refusals redis-py has no class for, told by their error code: a script running past
# busy-reply-threshold (BUSY), a replica still loading its data set (LOADING).
_TRANSIENT_CODES = ("BUSY ", "LOADING ", "MASTERDOWN ", "TRYAGAIN ", "CLUSTERDOWN ", "OOM ", "READONLY ")
# redis-py puts this before the error of a pipeline's command, hiding its code.
_PIPELINE_NOTE = re.compile(r"^Command # \d+ \(.*?\) of pipeline caused error: ", re.S)
# With every node of a cluster away, redis-py raises a plain RedisClusterException
# (not a RedisError): told apart from a programming error (a cross-slot command)
# by its message. Catch these together with TRANSIENT_ERRORS, then ask is_transient.
CLUSTER_ERRORS = (RedisClusterException,)
# Everything a Redis command can raise: what the boundary translates into BrokerError.
REDIS_ERRORS = (RedisError, *TRANSIENT_ERRORS, *CLUSTER_ERRORS)


# Errors no retry can fix: wrong credentials, or a user without the rights. redis-py
# makes the first two ConnectionError subclasses, so they must be told apart from
# a server that is merely away before any "is it transient?" test.
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (
    AuthenticationError,
    AuthorizationError,
    AuthenticationWrongNumberOfArgsError,
    NoPermissionError,
)


def is_permanent(exc: BaseException) -> bool:
    if isinstance(exc, PERMANENT_ERRORS):
        return True
    text = str(exc)
    return text.startswith(("NOAUTH", "WRONGPASS", "NOPERM")) or "invalid username-password" in text


def is_transient(exc: BaseException) -> bool:
    if is_permanent(exc):
        return False
    if isinstance(exc, TRANSIENT_ERRORS):
        return True
    if isinstance(exc, ResponseError):
        return _PIPELINE_NOTE.sub("", str(exc), count=1).startswith(_TRANSIENT_CODES)
    return isinstance(exc, RedisClusterException) and "cannot be connected" in str(exc)


def is_refusal(exc: BaseException) -> bool:
    """A transient refusal: the server answered, and said "not now" (OOM, READONLY, BUSY,
    LOADING, MASTERDOWN, TRYAGAIN, CLUSTERDOWN), as opposed to no answer at all."""
    return is_transient(exc) and isinstance(exc, (ResponseError, BusyLoadingError))


def fault_text(exc: BaseException) -> str:
    """What went wrong, for a log line: a server that refused (with its own words) is not
    a server that is unreachable."""
    if isinstance(exc, (ResponseError, BusyLoadingError)):
        return f"Redis refused it for now: {type(exc).__name__}: {str(exc).split('. script:')[0]}"
    return f"Redis unreachable ({type(exc).__name__})"


def permanent_error(exc: BaseException, url: str | None = None) -> BrokerError:
    """The one clear line for a refusal no retry fixes (credentials never in it)."""
    where = f" at {mask_url(url)}" if url else ""
    if isinstance(exc, (NoPermissionError,)) or str(exc).startswith("NOPERM"):
        return BrokerError(f"Redis{where} refused the command: the user lacks the permission ({type(exc).__name__})")
    return BrokerError(
        f"Redis{where} refused authentication: wrong or missing password/user in the URL ({type(exc).__name__})"
    )


class LogLimiter:
    """One WARNING when a fault starts, then at most one summary every ``every_s``
    (with how many times it happened meanwhile): a fault that lasts minutes is a
    few lines, not one per retry."""

    def __init__(self, logger: logging.Logger, every_s: float = 30.0) -> None:
        self._log = logger
        self._every_s = every_s
        self._last = 0.0
        self._suppressed = 0
        self._active = False

    def warning(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if not self._active or now - self._last >= self._every_s:
            if self._suppressed:
                msg += f" ({self._suppressed} more since the last report)"
            self._log.warning(msg, *args)
            self._last, self._suppressed, self._active = now, 0, True
        else:
            self._suppressed += 1

    def recovered(self, msg: str | None = None, *args: Any) -> None:
        """The fault is over: the next one logs at once again."""
        if self._active and msg:
            self._log.info(msg, *args)
        self._active = False
        self._suppressed = 0


_KEEPALIVE = {
    opt: value
    for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3))
    if (opt := getattr(socket, name, None)) is not None
}

# Per client; a worker's in-flight samples share them (see connect()).
_MAX_CONNECTIONS = 128

_CRED = re.compile(r"(?P<scheme>[a-z+]+://)(?P<cred>[^@/]*)@")
_QUERY_SECRET = re.compile(r"(?P<key>[?&](?:password|pass|token)=)[^&]*", re.IGNORECASE)


def mask_url(url: str) -> str:
    """The URL with its credentials (user:password@, ?password=) replaced, for logs, errors and status output."""
    masked = _CRED.sub(lambda m: f"{m['scheme']}***@", url)
    return _QUERY_SECRET.sub(lambda m: f"{m['key']}***", masked)


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0].endswith("+cluster")


def is_cluster(client: Any) -> bool:
    """Whether ``client`` talks to a Redis Cluster: then no command or script may
    span two hash slots, and reads of several partitions go one per partition."""
    return isinstance(client, RedisCluster)


DEFAULT_TIMEOUT_S = 5.0
# How long a trainer-side call (push, open_batch, collect, result) waits out an
# unreachable Redis before RedisUnavailableError: a restart or a failover usually
# takes seconds, and the caller (verl failing its step, a trainer retrying) must hear
# of an outage within a minute, its own overheads included. Workers never give up.
GIVE_UP_S = 30.0

_UNSET: Any = object()
# The process's round-trip deadline: the CLI and the worker program set it from
# ``connection.timeout_s`` once, so every client they build (lanes included) takes it.
_timeout_s: float | None = DEFAULT_TIMEOUT_S


def set_default_timeout(timeout_s: float | None) -> None:
    """Set the ``timeout_s`` of every client ``connect()`` builds from now on in this
    process (None: no reply deadline). A library caller may pass ``timeout_s`` instead."""
    global _timeout_s
    _timeout_s = timeout_s


class _LostOnlyRetry(Retry):
    """redis-py's Retry for lost connections only, never for a server that did not answer.

    Some redis-py releases (8.1) wrap a reply that timed out during the connect's health
    PING in a ConnectionError, which the retry would then send again: one stopped server
    cost four timeouts (20 s), not one. Such an error is raised as the TimeoutError it is.
    """

    async def call_with_retry(self, do: Callable[[], Awaitable[T]], fail: Any, *args: Any, **kwargs: Any) -> T:
        async def once() -> T:
            try:
                return await do()
            except RedisConnectionError as exc:
                if isinstance(exc.__cause__, (RedisTimeoutError, asyncio.TimeoutError)):
                    raise RedisTimeoutError(str(exc)) from exc
                raise

        return await super().call_with_retry(once, fail, *args, **kwargs)


def connect(url: str, *, cluster: bool = False, timeout_s: float | None = _UNSET, **kwargs: Any) -> Any:
    """A redis-py asyncio client for ``url``; bytes in, bytes out.

    Every round trip has a deadline: connecting and each reply take at most
    ``timeout_s`` (default: ``set_default_timeout``'s, 5 s unless set; a blocking
    XREAD/XREADGROUP: its BLOCK on top, see
    ``entries.read_streams``), after which the command raises redis-py's
    TimeoutError. A timed-out command is not retried inside redis-py (its retries
    would stretch one stopped server to four timeouts and more); it is the
    caller's to retry or to give up on with RedisUnavailableError.

    A ``redis+cluster://host:port`` URL (any one node) gives a ``RedisCluster``
    client: it finds the other nodes itself and routes each command by key slot.

    Short commands get a few quick retries inside redis-py; longer outages are the
    caller's to wait out (see ``with_reconnect``), because only the caller knows
    whether a command may safely be sent again.
    """
    if timeout_s is _UNSET:
        timeout_s = _timeout_s
    # Only a lost connection is retried here (a reconnect is quick or fails fast); a
    # server that does not answer has had its timeout_s.
    retry = _LostOnlyRetry(
        ExponentialWithJitterBackoff(base=0.05, cap=1.0), retries=3, supported_errors=(RedisConnectionError,)
    )
    options: dict[str, Any] = {
        "decode_responses": False,
        "protocol": 2,  # reply shapes the code parses; RESP3 gives no speed-up here
        "retry": retry,
        "health_check_interval": 30,
        "socket_connect_timeout": timeout_s if timeout_s else 5,
    }
    if not (cluster or is_cluster_url(url)):
        options["socket_timeout"] = timeout_s
    options.update(kwargs)
    try:
        if cluster or is_cluster_url(url):
            plain = url.replace("+cluster://", "://", 1)
            options.pop("health_check_interval", None)  # not a RedisCluster option
            # RedisCluster defaults to a 5 s socket timeout, which redis-py applies to
            # sends with asyncio.wait_for; on Python 3.11 that swallows a task's
            # cancellation when it lands as the send completes, and a cancelled
            # reader would then run on. No timeout, as for a single node; TCP
            # keepalive finds a peer that vanished without a reset within ~1 minute.
            options.setdefault("socket_timeout", None)
            options.setdefault("socket_keepalive", True)
            options.setdefault("socket_keepalive_options", _KEEPALIVE)
            client = RedisCluster.from_url(plain, **options)
            _keep_startup_nodes(client)
            return client
        # A blocking pool: past max_connections a command waits for a free
        # connection instead of failing with MaxConnectionsError (a worker may have
        # hundreds of samples acquiring quota at once).
        max_connections = options.pop("max_connections", _MAX_CONNECTIONS)
        pool = aredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=60, **options)
        return aredis.Redis.from_pool(pool)  # the client owns the pool: aclose() closes it
    except ValueError as exc:
        raise BrokerError(f"bad Redis URL {mask_url(url)!r}: {exc}") from None


class _KeptNodes(dict):  # type: ignore[type-arg]
    """A cluster client's startup nodes that never lose the ones the URL named.

    redis-py's asyncio cluster drops a node from its startup nodes on every
    connection error, and a failing command closes every node's connections, so
    the commands in flight on the other nodes fail and drop theirs too: with all
    dropped, it raises "Redis Cluster cannot be connected ... None" for ever, even
    once the nodes are back (redis/redis-py#3693; hit here with redis-py 6.2 when
    a master was killed under a worker's concurrent writes)."""

    def __init__(self, nodes: dict[str, Any], keep: set[str]) -> None:
        super().__init__(nodes)
        self.keep = keep

    def pop(self, name: str, *default: Any) -> Any:
        if name in self.keep and name in self:
            return self[name]  # handed out, as a pop would, but kept
        return super().pop(name, *default)


def _keep_startup_nodes(client: Any) -> None:
    manager = getattr(client, "nodes_manager", None)
    nodes = getattr(manager, "startup_nodes", None)
    if isinstance(nodes, dict) and nodes:
        manager.startup_nodes = _KeptNodes(nodes, set(nodes))  # type: ignore[union-attr]


_LIMITERS: dict[str, LogLimiter] = {}
# Some callers name a batch or a sample in ``what``: limiters are made on a first fault
# only, and the oldest goes past this many, so a long run does not keep one per batch.
_LIMITERS_MAX = 256


def _limiter(what: str) -> LogLimiter:
    limiter = _LIMITERS.get(what)
    if limiter is None:
        if len(_LIMITERS) >= _LIMITERS_MAX:
            del _LIMITERS[next(iter(_LIMITERS))]
        limiter = _LIMITERS[what] = LogLimiter(log)
    return limiter


async def with_reconnect(
    op: Callable[[], Awaitable[T]],
    *,
    what: str,
    give_up_after_s: float | None = GIVE_UP_S,
    stop: asyncio.Event | None = None,
    refusals_only: bool = False,
) -> T:
    """Run ``op`` until it succeeds, backing off while Redis is unreachable or refuses
    for now.

    Only for idempotent operations (reads, write-once scripts, acks). Raises
    BrokerError once ``give_up_after_s`` has passed (None: never give up, for
    long-running workers), or when ``stop`` is set: RedisUnavailableError when no
    round trip completed, BrokerError with the server's words when it kept refusing.
    ``refusals_only``: an unreachable Redis is raised at once (the caller bounds it by
    its own reply deadline), only a refusal is waited out; anything else is raised as
    redis-py raised it, for the caller's ``redis_errors`` to say what it was doing.
    """
    loop = asyncio.get_running_loop()
    start = loop.time()
    delay = 0.05
    # Shared by every call doing ``what``: a hundred samples retrying their quota check
    # during one outage are one warning, then a summary now and then.
    limiter: LogLimiter | None = None
    attempt_s = 0.0  # the longest failed attempt: one that ends in a timeout takes timeout_s
    while True:
        began = loop.time()
        try:
            result = await op()
            if limiter is not None:
                limiter.recovered("%s: Redis takes it again", what)
            return result
        except (*TRANSIENT_ERRORS, *CLUSTER_ERRORS, ResponseError) as exc:
            if is_permanent(exc):
                if refusals_only:
                    raise  # the caller's redis_errors names what it was doing
                raise permanent_error(exc) from None
            if not is_transient(exc) or (refusals_only and not is_refusal(exc)):
                raise
            now = loop.time()
            elapsed = now - start
            attempt_s = max(attempt_s, now - began)
            # Give up before an attempt that would end past the give-up, not after it: a
            # stopped server costs timeout_s an attempt, and the bound is the caller's.
            out_of_time = give_up_after_s is not None and elapsed + attempt_s >= give_up_after_s
            if out_of_time or (stop is not None and stop.is_set()):
                if (stop is not None and stop.is_set()) or is_refusal(exc):
                    # A server that answers is not unreachable: its own words, and for how long.
                    raise BrokerError(f"{what}: for {elapsed:.1f}s, {fault_text(exc)}") from None
                # A finite give-up ran out while Redis kept failing: the caller is told
                # Redis is gone, not left to read a generic broker fault.
                raise RedisUnavailableError(
                    f"{what}: no reply from Redis for {elapsed:.1f}s, {fault_text(exc)}"
                ) from None
            limiter = limiter or _limiter(what)
            limiter.warning("%s: %s; retrying", what, fault_text(exc))
            pause = delay * (0.5 + random.random())
            if give_up_after_s is not None:
                pause = min(pause, max(0.0, give_up_after_s - elapsed))
            if stop is None:
                await asyncio.sleep(pause)
            else:
                try:
                    await asyncio.wait_for(stop.wait(), pause)
                except asyncio.TimeoutError:
                    pass
            delay = min(delay * 2, 2.0)
        except Exception as exc:
            if is_permanent(exc) and not refusals_only:  # NOAUTH / WRONGPASS / NOPERM arrive as a ResponseError
                raise permanent_error(exc) from None
            raise


async def cancel_until_done(tasks: Iterable[asyncio.Future[Any]], give_up_s: float = 5.0) -> None:
    """Cancel ``tasks`` and wait for them to end, cancelling again until it takes.

    A cancel that lands inside a redis-py command can be swallowed on Python 3.11: the
    task then runs on (a blocking read, a loop of them) as if never cancelled, and a
    plain ``cancel(); await gather(...)`` waits for good. Bounded: a task that never
    yields is left after ``give_up_s``."""
    pending = {task for task in tasks if not task.done()}
    loop = asyncio.get_running_loop()
    give_up = loop.time() + give_up_s
    while pending and loop.time() < give_up:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.1)
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: its error is the caller's to read, not the loop's to log


@contextlib.contextmanager
def redis_errors(what: str) -> Iterator[None]:
    """Translate a Redis failure inside the block into a ``BrokerError`` naming ``what``.

    The one place redis-py's errors become ours (as httpx maps httpcore's): callers
    say what they were doing; the message never holds credentials.
    """
    try:
        yield
    except REDIS_ERRORS as exc:
        if is_permanent(exc):
            raise BrokerError(f"{what}: {permanent_error(exc)}") from exc
        if isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError)):
            # No round trip completed (refused, reset, or no reply within timeout_s).
            raise RedisUnavailableError(f"{what}: {fault_text(exc)}") from exc
        raise BrokerError(
            f"{what}: {fault_text(exc) if is_transient(exc) else f'{type(exc).__name__}: Redis refused it'}"
        ) from exc


async def wait_out_refusals(op: Callable[[], Awaitable[T]], *, what: str) -> T:
    """Run one idempotent trainer-side write: a server that refuses for now (OOM at
    maxmemory, READONLY mid failover, BUSY, LOADING) is waited out, up to GIVE_UP_S;
    anything else is a BrokerError naming ``what`` at once (no reply within the
    round-trip deadline: RedisUnavailableError)."""
    with redis_errors(what):
        return await with_reconnect(op, what=what, refusals_only=True)
