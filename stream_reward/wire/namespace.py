"""A namespace's identity: the protocol version it speaks and its epoch.

The first producer or worker to use a namespace records both in
``Keys.namespace_info``. A component of another protocol version refuses to
join (``ProtocolMismatchError``) instead of writing records the others cannot
read. The epoch is a random id: when it vanishes or changes under a component
that saw it (Redis restarted without persistence, FLUSHALL, failover to an
empty replica), everything that component queued or stored is gone, and it
raises ``StateLostError`` at once instead of waiting forever for results that
will never come, or calling a lost batch "never opened".
"""

from __future__ import annotations

import uuid
from typing import Any

from stream_reward.errors import ProtocolMismatchError
from stream_reward.wire.codec import PROTOCOL_VERSION
from stream_reward.wire.keys import Keys

__all__ = ["join_namespace", "read_namespace", "check_protocol"]

# HSETNX both fields, then read them back: one round trip, atomic.
_JOIN_SCRIPT = """
redis.call('HSETNX', KEYS[1], 'protocol', ARGV[1])
redis.call('HSETNX', KEYS[1], 'epoch', ARGV[2])
return redis.call('HMGET', KEYS[1], 'protocol', 'epoch')
"""


def _text(value: Any) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def check_protocol(keys: Keys, protocol: Any) -> None:
    found = _text(protocol)
    if found is not None and found != str(PROTOCOL_VERSION):
        raise ProtocolMismatchError(
            f"namespace {keys.namespace!r} speaks protocol version {found}, this build speaks {PROTOCOL_VERSION}: "
            "run one version of stream-reward for every producer, worker and trainer of a namespace, "
            "or use another namespace"
        )


async def join_namespace(client: Any, keys: Keys) -> str:
    """Record this build's protocol and a fresh epoch unless the namespace has them;
    returns the namespace's epoch. Raises ProtocolMismatchError."""
    protocol, epoch = await client.eval(_JOIN_SCRIPT, 1, keys.namespace_info(), str(PROTOCOL_VERSION), uuid.uuid4().hex)
    check_protocol(keys, protocol)
    return str(_text(epoch))


async def read_namespace(client: Any, keys: Keys) -> str | None:
    """The namespace's epoch, None when it has none (never used, or its state was lost).
    Raises ProtocolMismatchError."""
    protocol, epoch = await client.hmget(keys.namespace_info(), ["protocol", "epoch"])
    check_protocol(keys, protocol)
    return _text(epoch)
