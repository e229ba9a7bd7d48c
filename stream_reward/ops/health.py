"""``stream-reward worker --check``: is a worker of this namespace alive?"""

from __future__ import annotations

from redis.exceptions import TimeoutError as RedisTimeoutError

from stream_reward.ops.settings import Settings
from stream_reward.ops.status import read_heartbeats
from stream_reward.wire.connection import REDIS_ERRORS, connect, mask_url
from stream_reward.wire.heartbeat import ALIVE_FACTOR
from stream_reward.wire.keys import Keys

__all__ = ["check_health"]


async def check_health(settings: Settings, *, consumer: str | None = None) -> tuple[bool, str]:
    """(healthy, one-line reason): a worker of the namespace (this ``consumer``, this
    group when one was configured) heartbeat within 3 heartbeat intervals."""
    url = settings.require_redis()
    interval = settings["consumer.heartbeat_interval_s"]
    group = settings["connection.group"] if settings.is_set("connection.group") else None
    timeout_s = settings["connection.timeout_s"]
    client = connect(url, timeout_s=timeout_s)
    try:
        beats = await read_heartbeats(client, Keys(settings.namespace), interval_s=interval)
    except REDIS_ERRORS as exc:
        if isinstance(exc, RedisTimeoutError):
            return False, f"unhealthy: cannot reach Redis at {mask_url(url)}: no reply within {timeout_s:g}s"
        return False, f"unhealthy: cannot reach Redis at {mask_url(url)}: {type(exc).__name__}"
    finally:
        await client.aclose()
    matching = {
        name: b
        for name, b in beats.items()
        if (consumer is None or name == consumer) and (group is None or b.get("group") == group)
    }
    alive = {name: b for name, b in matching.items() if b["alive"]}
    what = (
        f"consumer {consumer!r}"
        if consumer
        else f"namespace {settings.namespace!r}" + (f" group {group!r}" if group else "")
    )
    if alive:
        freshest = min(b["age_s"] for b in alive.values())
        return True, f"ok: {len(alive)} live worker(s) in {what}; freshest heartbeat {freshest:.1f}s ago"
    if matching:
        freshest = min(b["age_s"] for b in matching.values())
        return False, (
            f"unhealthy: no live worker in {what}; freshest heartbeat {freshest:.1f}s ago "
            f"(limit {ALIVE_FACTOR * interval:g}s)"
        )
    return False, f"unhealthy: no worker heartbeat in {what}"
