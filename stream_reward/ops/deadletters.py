"""Dead letters: entries that could not be scored, kept with the reason.

A dead letter holds the reason code, the error message, the consumer, the
delivery count and the original entry's fields (payload included), so that
``redrive`` can put it back on the stream once the cause is fixed. Redriving
a sample whose batch already has a `failed` result does not change that
result (results are write-once): redrive is for batches not yet collected,
or after clearing the batch's ledger on purpose.

Each partition has its own dead-letter stream under its own hash tag; a letter
goes back to its own partition's stream, stamped and counted as a push, in one
script call with its deletion (the keys share the partition's slot, so this works
on a Redis Cluster too).
"""

from __future__ import annotations

from typing import Any

from stream_reward.config import DEFAULT_NAMESPACE
from stream_reward.wire.connection import connect
from stream_reward.wire.deadletter import DeadLetter, decode_dead_letter
from stream_reward.wire.keys import Keys
from stream_reward.wire.push import REQUEUE_SCRIPT, requeue_args

__all__ = ["DeadLetter", "list_dead_letters", "redrive_dead_letters"]


async def list_dead_letters(
    redis_url: str, *, namespace: str = DEFAULT_NAMESPACE, partitions: int = 1, count: int = 100, client: Any = None
) -> list[DeadLetter]:
    owned = client is None
    client = client or connect(redis_url)
    try:
        keys = Keys(namespace, partitions)
        out: list[DeadLetter] = []
        for p in range(partitions):
            for entry_id, fields in await client.xrange(keys.dead_letters(p), count=count):
                out.append(decode_dead_letter(p, entry_id, fields))
        return out
    finally:
        if owned:
            await client.aclose()


async def redrive_dead_letters(
    redis_url: str,
    *,
    namespace: str = DEFAULT_NAMESPACE,
    partitions: int = 1,
    ids: list[str] | None = None,
    client: Any = None,
) -> int:
    """Push dead letters (all, or those with ``ids``) back onto their stream and delete them
    from the dead-letter stream, in one script call per letter. Returns how many it
    queued: a letter another redrive took first is not queued again. A letter goes back
    for the consumer group that wrote it only (its entry names the group)."""
    owned = client is None
    client = client or connect(redis_url)
    moved = 0
    try:
        keys = Keys(namespace, partitions)
        requeue = client.register_script(REQUEUE_SCRIPT)
        for letter in await list_dead_letters(
            redis_url, namespace=namespace, partitions=partitions, count=1_000_000, client=client
        ):
            if ids is not None and letter.id not in ids:
                continue
            if not letter.fields.get("d"):
                continue  # nothing to score again
            p = letter.partition
            # 0 when another redrive took the letter first: each is queued once.
            moved += await requeue(
                keys=[keys.stream(p), keys.pushed(p), keys.dead_letters(p)],
                args=requeue_args([letter.fields], delete_letter=letter.id),
            )
        return moved
    finally:
        if owned:
            await client.aclose()
