"""One sample of an entry, as a worker holds it: an entry may carry several samples (a
producer batches them), and a worker opens, scores, dead-letters and hands back each apart.

The lowest of the worker's modules: the shared state (``state``) and every concern that
opens, settles or hands back samples name them.
"""

from __future__ import annotations

from typing import Any

from stream_reward.wire.entries import (
    FIELD_FOR_GROUP,
    FIELD_PAYLOAD,
    member_fields,
    members_from_payloads,
    read_members,
)

__all__ = ["Member", "sample_name", "split"]


class Member:
    """One sample of an entry: its payload (a view into the entry's) and its header."""

    __slots__ = ("payload", "head")

    def __init__(self, payload: Any, head: Any) -> None:
        self.payload, self.head = payload, head

    def fields(self, entry: dict[bytes, bytes], of: int, group: str) -> dict[bytes, bytes]:
        """What a dead letter of consumer group ``group`` keeps: the entry itself when it
        holds this sample only, else an entry of this sample's own (a redrive queues it
        alone); either names the group, so a redrive queues it for that group only."""
        if of == 1:
            return {**entry, FIELD_FOR_GROUP: group.encode()}
        return member_fields(bytes(self.payload), self.head, group=group)


def sample_name(head: Any) -> str:
    """A sample's name in a hand-back record: its batch and uid (a uid is unique only
    within its batch, and an entry may hold samples of several batches)."""
    batch, _, uid, _ = head
    return f"{len(batch)}:{batch}{uid}"


def split(fields: dict[bytes, bytes]) -> list[Member]:
    """An entry's samples. Headers that cannot be read: the samples are split by their
    payloads (one that names no sample is dead-lettered alone); failing that, the entry
    is one sample: its payload may still decode, and if not it is dead-lettered whole."""
    data = fields.get(FIELD_PAYLOAD, b"")
    members = read_members(fields)
    sized = [(head[3], head) for head in members] if members is not None else members_from_payloads(data)
    if sized is None:
        return [Member(data, None)]
    view = memoryview(data)
    out = []
    at = 0
    for size, head in sized:
        out.append(Member(view[at : at + size], head))
        at += size
    return out
