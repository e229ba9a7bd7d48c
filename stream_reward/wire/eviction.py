"""Refusing a server that may evict the pipeline's keys.

A Redis with an eviction policy (``allkeys-lru``, a common default of managed Redis)
drops keys under memory pressure: queued trajectories, batch records, result indexes.
Nothing then says so; results just never come, and the loss is reported as a batch
"never opened" or expired. So producers, workers and aggregators read the server's
``maxmemory-policy`` when they first use a client and refuse anything but
``noeviction``, unless told the user accepts the loss (``allow_eviction``).

``INFO memory`` rather than ``CONFIG GET``: managed services often disable CONFIG,
rarely INFO. A server that refuses INFO too is let through with one warning.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from redis.exceptions import ResponseError

from stream_reward.errors import EvictionPolicyError

__all__ = ["check_eviction", "eviction_note", "ALLOW_EVICTION_HINT"]

log = logging.getLogger(__name__)

ALLOW_EVICTION_HINT = "--allow-eviction, allow_eviction=True or STREAM_REWARD_CONNECTION_ALLOW_EVICTION=1"

# Clients already checked: once per client, not per call (a producer joins its namespace
# at every open_batch). Weak, so a closed client's entry goes with it.
_checked: weakref.WeakSet[Any] = weakref.WeakSet()


async def check_eviction(client: Any, where: str, *, allow: bool) -> None:
    """Raise EvictionPolicyError if the server behind ``client`` may evict keys."""
    if allow or client in _checked:
        return
    try:
        info = await client.info("memory")
    except ResponseError as exc:  # INFO disabled (NOPERM, a renamed command)
        log.warning("%s: cannot read maxmemory-policy (%s); make sure it is noeviction", where, exc)
        _checked.add(client)
        return
    policies = _policies(info)
    evicting = sorted({p for p in policies if p != "noeviction"})
    if evicting:
        raise EvictionPolicyError(
            f"{where}: Redis uses maxmemory-policy {', '.join(evicting)}, which drops queued trajectories and "
            "results when memory runs short, silently. Set it to noeviction (CONFIG SET maxmemory-policy "
            f"noeviction, or in redis.conf / your provider's parameter group); to run anyway, {ALLOW_EVICTION_HINT}"
        )
    _checked.add(client)


def _policies(info: Any) -> list[str]:
    """maxmemory_policy of each node: a cluster client's INFO answers per node."""
    if isinstance(info, dict) and "maxmemory_policy" in info:
        return [_text(info["maxmemory_policy"])]
    if isinstance(info, dict):
        return [
            _text(node["maxmemory_policy"])
            for node in info.values()
            if isinstance(node, dict) and "maxmemory_policy" in node
        ]
    return []


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def eviction_note(client: Any) -> str:
    """A sentence for a lost-state message when the server evicts keys ('' when it does not,
    or will not say): the cause an operator looks for first. Only on an error path: two
    INFO round trips."""
    try:
        policies = _policies(await client.info("memory"))
        stats = await client.info("stats")
    except Exception:  # best effort: the error it goes into matters more than this note
        return ""
    nodes = [stats] if isinstance(stats, dict) and "evicted_keys" in stats else list(stats.values())
    evicted = sum(int(node.get("evicted_keys", 0)) for node in nodes if isinstance(node, dict))
    evicting = sorted({p for p in policies if p != "noeviction"})
    if not evicting and not evicted:
        return ""
    policy = f"maxmemory-policy {', '.join(evicting) or 'noeviction'}"
    return f"the server has evicted {evicted} keys since it started ({policy}), the likely cause"
