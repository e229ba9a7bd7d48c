"""A group's lag in samples: exact from the entries' stamps as workers read, whatever the
entries hold; an estimate, said so and never below zero, where the stamps or the pushed
count are missing; nothing for a stream never created or a group not asked for."""

from __future__ import annotations

import pytest
from helpers import push_exact

from stream_reward.wire.connection import connect
from stream_reward.wire.entries import entry_fields
from stream_reward.wire.keys import Keys
from stream_reward.wire.lag import read_group_lags

pytestmark = pytest.mark.anyio


async def test_lag_in_samples_is_exact_as_a_consumer_reads_entry_by_entry(redis_url, namespace) -> None:
    keys = Keys(namespace)
    await push_exact(redis_url, namespace, "b", 40, k=16)  # entries of 16, 16, 8
    client = connect(redis_url)
    try:
        seen = []
        for _ in range(4):
            (lag,) = await read_group_lags(client, keys, "scorers")
            seen.append((lag.lag_entries, lag.lag_samples, lag.pending_entries, lag.exact))
            await client.xreadgroup("scorers", "c", {keys.stream(): ">"}, count=1)
    finally:
        await client.aclose()
    assert seen == [(3, 40, 0, True), (2, 24, 1, True), (1, 8, 2, True), (0, 0, 3, True)]


async def test_entries_without_a_stamp_give_an_estimate_that_says_so(redis_url, namespace) -> None:
    keys = Keys(namespace)
    await push_exact(redis_url, namespace, "b", 32, k=16)
    client = connect(redis_url)
    try:
        await client.xreadgroup("scorers", "c", {keys.stream(): ">"}, count=2)
        # An entry XADDed by hand carries no stamp: the samples behind it cannot be counted.
        await client.xadd(keys.stream(), entry_fields(b"\xc1", "b", 99, "b/99"))
        (lag,) = await read_group_lags(client, keys, "scorers")
    finally:
        await client.aclose()
    assert (lag.lag_entries, lag.exact) == (1, False)
    assert lag.lag_samples == 16  # one entry at the mean of the entries pushed (32 samples in 2)


async def test_a_lost_pushed_count_gives_an_estimate_never_below_zero(redis_url, namespace) -> None:
    keys = Keys(namespace)
    await push_exact(redis_url, namespace, "b", 20, k=16)
    client = connect(redis_url)
    try:
        await client.delete(keys.pushed())
        (lag,) = await read_group_lags(client, keys, "scorers")
    finally:
        await client.aclose()
    assert (lag.lag_entries, lag.exact) == (2, False)
    assert lag.lag_samples == 32  # two entries at samples_per_entry: errs high, the side of scaling up


async def test_no_rows_for_a_stream_never_created_or_a_group_not_asked_for(redis_url, namespace) -> None:
    client = connect(redis_url)
    try:
        assert await read_group_lags(client, Keys(namespace, 2)) == []
        await push_exact(redis_url, namespace, "b", 3)
        assert await read_group_lags(client, Keys(namespace), "judges") == []
        (lag,) = await read_group_lags(client, Keys(namespace))
    finally:
        await client.aclose()
    assert (lag.group, lag.lag_entries, lag.lag_samples, lag.consumers) == ("scorers", 3, 3, 0)
