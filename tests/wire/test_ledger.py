"""The write-once result store (wire/ledger.py): the ledger marks uids, the done stream holds
the records, one entry per flush. A result is stored once and a second write of its uid
changes nothing; a done entry whose bytes are no records fails its samples, not the batch,
and ``done_rows`` names what stopped it.
"""

from __future__ import annotations

import logging

import pytest

from stream_reward import ProducerConfig, RewardAggregator, RolloutProducer, ScoreResult
from stream_reward.wire.codec import encode_result
from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys
from stream_reward.wire.ledger import DONE_FIELD, LedgerItem, LedgerWriter, done_rows

pytestmark = pytest.mark.anyio


def record(i: int, score: float = 1.0) -> bytes:
    return encode_result(ScoreResult(f"b/{i}", "b", i, score))


async def test_a_result_is_stored_once_and_a_second_write_of_its_uid_changes_nothing(redis_url, namespace) -> None:
    keys = Keys(namespace)
    client = connect(redis_url)
    try:
        ledger = LedgerWriter(client, keys, "scorers", result_ttl_s=60)
        assert await ledger.write(0, [LedgerItem("", "b", f"b/{i}", record(i)) for i in range(3)]) == 3
        # A redelivered sample scored again (another score): not written, not added to the done stream.
        assert await ledger.write(0, [LedgerItem("", "b", "b/1", record(1, 0.0))]) == 0
        marks = await client.hgetall(keys.results("b", 0, "scorers"))
        entries = await client.xrange(keys.done("b", 0, "scorers"))
    finally:
        await client.aclose()
    assert marks == {b"b/0": b"1", b"b/1": b"1", b"b/2": b"1"}  # marks, not second copies of the records
    assert len(entries) == 1 and list(entries[0][1]) == [DONE_FIELD]
    rows, broken = done_rows(entries[0][1])
    assert broken is None
    assert [(row[1], row[4]) for row in rows] == [("b/0", 1.0), ("b/1", 1.0), ("b/2", 1.0)]


async def test_a_done_entry_with_bytes_that_are_no_records_fails_its_samples_not_the_batch(
    redis_url, namespace, caplog
) -> None:
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await producer.open_batch("b", 4, 8)
        client = connect(redis_url)
        try:
            ledger = LedgerWriter(client, Keys(namespace), "scorers", result_ttl_s=60)
            await ledger.write(0, [LedgerItem("", "b", "b/0", record(0))])
            # A foreign writer's garbage (0xc1 is no msgpack type) between two good records.
            await ledger.write(
                0,
                [
                    LedgerItem("", "b", "b/1", record(1)),
                    LedgerItem("", "b", "b/x", b"\xc1"),
                    LedgerItem("", "b", "b/2", record(2)),
                ],
            )
        finally:
            await client.aclose()
        with caplog.at_level(logging.WARNING, logger="stream_reward.trainer.aggregator"):
            rewards = await agg.collect("b", timeout_s=1.0, on_timeout="resolve")
    assert rewards.status == ["ok", "ok", "failed", "failed"]
    assert [r.reason for r in rewards.results[2:]] == ["never_pushed", "never_pushed"]
    assert "not result records" in caplog.text


def test_done_rows_names_what_stopped_it() -> None:
    rows, broken = done_rows({DONE_FIELD: record(0) + b"\xc1" + record(1)})
    assert [row[1] for row in rows] == ["b/0"] and broken is not None
    assert done_rows({}) == ([], "no results field")
