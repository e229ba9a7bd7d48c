"""Connecting to Redis: URLs, clients, credential masking and reconnect backoff.

Every component takes a URL (``redis://``, ``rediss://`` for TLS, ``unix://``,
``redis+cluster://`` / ``rediss+cluster://`` for a cluster) and builds its client
here, so retry and masking rules live in one place.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aredis
from redis.asyncio.cluster import RedisCluster
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from .errors import BrokerError

__all__ = ["connect", "mask_url", "is_cluster_url", "with_reconnect", "TRANSIENT_ERRORS"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# Errors that mean "Redis is (briefly) away", worth waiting out. BusyLoadingError
# (a restarted server replaying its AOF) is a ConnectionError subclass in redis-py.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (RedisConnectionError, RedisTimeoutError, OSError)

_CRED = re.compile(r"(?P<scheme>[a-z+]+://)(?P<cred>[^@/]*)@")
_QUERY_SECRET = re.compile(r"(?P<key>[?&](?:password|pass|token)=)[^&]*", re.IGNORECASE)


def mask_url(url: str) -> str:
    """The URL with its credentials (user:password@, ?password=) replaced, for logs, errors and status output."""
    masked = _CRED.sub(lambda m: f"{m['scheme']}***@", url)
    return _QUERY_SECRET.sub(lambda m: f"{m['key']}***", masked)


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0].endswith("+cluster")


def connect(url: str, *, cluster: bool = False, **kwargs: Any) -> Any:
    """A redis-py asyncio client for ``url``; bytes in, bytes out.

    Short commands get a few quick retries inside redis-py; longer outages are the
    caller's to wait out (see ``with_reconnect``), because only the caller knows
    whether a command may safely be sent again.
    """
    retry = Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), retries=3)
    options: dict[str, Any] = {
        "decode_responses": False,
        "protocol": 2,  # reply shapes the code parses; RESP3 gives no speed-up here
        "retry": retry,
        "health_check_interval": 30,
        "socket_connect_timeout": 5,
    }
    options.update(kwargs)
    try:
        if cluster or is_cluster_url(url):
            plain = url.replace("+cluster://", "://", 1)
            options.pop("health_check_interval", None)
            return RedisCluster.from_url(plain, **options)
        return aredis.Redis.from_url(url, **options)
    except ValueError as exc:
        raise BrokerError(f"bad Redis URL {mask_url(url)!r}: {exc}") from None


async def with_reconnect(
    op: Callable[[], Awaitable[T]],
    *,
    what: str,
    give_up_after_s: float | None = 60.0,
    stop: asyncio.Event | None = None,
) -> T:
    """Run ``op`` until it succeeds, backing off while Redis is unreachable.

    Only for idempotent operations (reads, write-once scripts, acks). Raises
    BrokerError once ``give_up_after_s`` has passed (None: never give up, for
    long-running workers), or when ``stop`` is set.
    """
    loop = asyncio.get_running_loop()
    start = loop.time()
    delay = 0.05
    attempt = 0
    while True:
        try:
            return await op()
        except TRANSIENT_ERRORS as exc:
            attempt += 1
            elapsed = loop.time() - start
            if (give_up_after_s is not None and elapsed >= give_up_after_s) or (stop is not None and stop.is_set()):
                raise BrokerError(f"{what}: Redis unreachable for {elapsed:.1f}s ({type(exc).__name__})") from None
            if attempt == 1 or attempt % 20 == 0:
                log.warning("%s: Redis unreachable (%s), retrying", what, type(exc).__name__)
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 2.0)
