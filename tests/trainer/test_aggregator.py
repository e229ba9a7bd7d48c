"""The aggregator (trainer/aggregator.py): ``collect``, ``stream`` and ``build_rewards``.

It promises: every per-sample field of a collected batch stays aligned under each
failure policy (``fallback`` scores a failed sample at its last valid token, ``mask``
zeroes and invalidates it, ``drop`` removes its row), the same with or without the
pipeline; a deadline resolves unfinished samples as failed; a garbled, foreign or odd
record fails its own sample, never the batch; ``BatchRewards`` keeps its results through
copy, deepcopy, pickle and ``dataclasses.replace``, builds them on first use and holds no
garbage-collected object per sample until then.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import gc
import pickle
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgpack
import pytest
from helpers import ok, producer_and_aggregator, samples, wait_until
from trainer_support import garbage_row, record

from stream_reward import BatchPolicy, BatchRewards, RewardAggregator, RolloutProducer, Trajectory
from stream_reward.config import ConsumerConfig, ProducerConfig
from stream_reward.errors import BatchExistsError, CollectTimeoutError, ConfigError, StateLostError, VerifierError
from stream_reward.scoring.scorer import Scored
from stream_reward.trainer.rewards import build_rewards
from stream_reward.wire.batch_meta import BatchMeta
from stream_reward.wire.codec import PROTOCOL_VERSION, encode_result
from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys
from stream_reward.wire.ledger import DONE_FIELD, LedgerItem, LedgerWriter
from stream_reward.wire.trajectory import ScoreResult
from stream_reward.worker.consumer import Worker

pytestmark = pytest.mark.anyio


RESPONSE_LEN = 8


class FakeVerifier:
    """Scores by exact match; 'fail' exhausts its retries, 'hang' never answers."""

    async def score(self, traj: Trajectory) -> Scored:
        if traj.response == "fail":
            raise VerifierError("verifier replied HTTP 503 (gave up after 6 attempts)", reason="http_503", attempts=6)
        if traj.response == "hang":
            await asyncio.sleep(3600)
        ok = traj.response == traj.ground_truth
        return Scored(1.0 if ok else 0.0, {"acc": ok})


@asynccontextmanager
async def worker(redis_url: str, namespace: str) -> AsyncIterator[Worker]:
    w = Worker(redis_url, FakeVerifier(), ConsumerConfig(namespace=namespace, block_ms=50, drain_timeout_s=0.2))
    stop = asyncio.Event()
    task = asyncio.create_task(w.run(stop))
    try:
        yield w
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
        await w.aclose()


# response per index; lengths chosen so each row's last token is distinct
RESPONSES = ["a", "fail", "b", "wrong", "fail", "c"]


LENGTHS = [3, 5, 1, 8, 2, 4]


async def run_batch(
    redis_url: str,
    namespace: str,
    policy: BatchPolicy,
    responses: list[str] = RESPONSES,
    lengths: list[int] = LENGTHS,
    **collect: object,
):
    batch = f"b-{policy.on_failure}-{time.monotonic_ns()}"
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
        worker(redis_url, namespace),
    ):
        await producer.open_batch(batch, len(responses), RESPONSE_LEN, policy=policy)
        await producer.push_many(
            Trajectory(
                batch, i, "test", response=r, ground_truth=r if r != "wrong" else "right", valid_response_length=n
            )
            for i, (r, n) in enumerate(zip(responses, lengths))
        )
        return await agg.collect(batch, **collect)


def row_of(rewards, index: int) -> list[float]:
    return rewards.rm_scores[rewards.indices.index(index)].tolist()


def pure_batch(policy: BatchPolicy, responses: list[str] = RESPONSES, lengths: list[int] = LENGTHS):
    """What the pipeline's results for ``responses`` are, laid out by ``build_rewards`` alone."""
    results = []
    for i, (response, length) in enumerate(zip(responses, lengths)):
        if response == "fail":
            results.append(
                ScoreResult.failed(
                    f"u{i}", "pure", i, reason="http_503", error="gave up", attempts=6, valid_response_length=length
                )
            )
        else:
            ok = response != "wrong"
            results.append(ScoreResult(f"u{i}", "pure", i, float(ok), extra={"acc": ok}, valid_response_length=length))
    meta = BatchMeta(size=len(results), response_len=RESPONSE_LEN, policy=policy, created=0.0, deadline=0.0)
    return build_rewards("pure", meta, results)


SIZE = 10


RESP = 6


POLICIES = ["mask", "drop", "fallback"]


def raw(version, uid, batch, index, score=1.0, status="ok", extra=None, vl=None) -> bytes:
    return msgpack.packb([version, uid, batch, index, score, status, 1, 0.0, extra, None, None, vl, "ds", None])


def written(batch: str) -> list[LedgerItem]:
    """The done stream of the mixed batch: what lands, in order (see expected())."""
    b = batch
    items = [
        LedgerItem("", b, f"{b}/0", encode_result(ok(b, 0, 0.5, 3, {"acc": True, "nested": {"a": [1, 2]}}))),
        LedgerItem(
            "",
            b,
            f"{b}/1",
            encode_result(
                ScoreResult(
                    f"{b}/1",
                    b,
                    1,
                    7.0,
                    "failed",
                    {"why": "x"},
                    "scorer_error",
                    "boom",
                    2,
                    4,
                    "ds",
                    "g",
                    5.0,
                )
            ),
        ),
        # A record of a foreign protocol version: fails its own sample.
        LedgerItem("", b, f"{b}/2", raw(PROTOCOL_VERSION + 1, f"{b}/2", b, 2, 9.0, extra={"acc": False}, vl=2)),
        # This version, a garbled field (score a string): fails its own sample.
        LedgerItem("", b, f"{b}/3", raw(PROTOCOL_VERSION, f"{b}/3", b, 3, "high", vl=2)),
        # idx 4: pushed, never scored (timeout); idx 5: never pushed.
        LedgerItem("", b, f"{b}/6", encode_result(ok(b, 6, 1.0, 0, {"acc": False}))),
        LedgerItem("", b, f"{b}/7", encode_result(ok(b, 7, 2.0, None, {"list": [1, [2, 3]]}))),
        # A second uid at index 7: ignored, the first is the sample's.
        LedgerItem("", b, "intruder", encode_result(ok(b, 7, -5.0, 1, {"acc": "intruder"}, uid="intruder"))),
        # Index outside the batch: ignored.
        LedgerItem("", b, "outside", encode_result(ok(b, 40, -6.0, 1, uid="outside"))),
        # The same uid again (another score): the first stands.
        LedgerItem("", b, f"{b}/8", encode_result(ok(b, 8, 3.0, 9))),
        LedgerItem("", b, f"{b}/9", encode_result(ScoreResult(f"{b}/9", b, 9, 0.0, "failed", {}, "timeout", "t"))),
    ]
    return items


async def mixed_batch(redis_url: str, namespace: str, producer: RolloutProducer, batch: str, policy: str) -> None:
    await producer.open_batch(batch, SIZE, RESP, policy=BatchPolicy(on_failure=policy, fallback_score=-1.0))
    await producer.push(Trajectory(batch, 4, "ds", "resp", valid_response_length=5))
    client = connect(redis_url)
    try:
        ledger = LedgerWriter(client, Keys(namespace), "scorers", result_ttl_s=60)
        items = written(batch)
        await ledger.write(0, items[:3])
        await ledger.write(0, items[3:7])
        await ledger.write(0, items[7:])
        # A redelivered 8 scored again, in a later flush: written once, ignored.
        await ledger.write(0, [LedgerItem("", batch, f"{batch}/8", encode_result(ok(batch, 8, 99.0, 1)))])
    finally:
        await client.aclose()


# index -> (status, score as stored, length, extra, reason or None for "any failure reason")
def expected(batch: str) -> dict[int, tuple]:
    return {
        0: ("ok", 0.5, 3, {"acc": True, "nested": {"a": [1, 2]}}, None),
        1: ("failed", 7.0, 4, {"why": "x"}, "scorer_error"),
        2: ("failed", 0.0, None, {}, "schema_version"),
        3: ("failed", 0.0, None, {}, "malformed"),
        4: ("failed", 0.0, 5, {}, "timeout"),
        5: ("failed", 0.0, None, {}, "never_pushed"),
        6: ("ok", 1.0, 0, {"acc": False}, None),
        7: ("ok", 2.0, None, {"list": [1, [2, 3]]}, None),
        8: ("ok", 3.0, 9, {}, None),
        9: ("failed", 0.0, None, {}, "timeout"),
    }


def check_aligned(rewards: BatchRewards, batch: str, policy: str) -> None:
    want = expected(batch)
    kept = [i for i in range(SIZE) if not (policy == "drop" and want[i][0] == "failed")]
    assert rewards.indices == kept
    assert rewards.n == len(kept)
    results = rewards.results
    assert len(results) == len(kept) == len(rewards.scores) == len(rewards.status) == len(rewards.errors)
    assert tuple(rewards.rm_scores.shape) == (len(kept), RESP)
    assert tuple(rewards.valid.shape) == (len(kept),)
    keys = set()
    for i in kept:
        keys |= set(want[i][3])
    assert set(rewards.reward_extra_info) == keys
    for row, i in enumerate(kept):
        status, score, length, extra, reason = want[i]
        r = results[row]
        uid = "" if i == 5 else f"{batch}/{i}"  # a sample never pushed has no uid
        assert (r.index, r.uid, r.status, r.batch_id) == (i, uid, status, batch), (row, r)
        assert rewards.status[row] == status
        assert rewards.errors[row] == r.error
        assert r.valid_response_length == length
        assert r.extra == extra
        if reason is not None:
            assert r.reason == reason, (i, r)
        if status == "ok":
            assert r.score == score
        want_score = score if status == "ok" else (-1.0 if policy == "fallback" else 0.0)
        assert rewards.scores[row] == want_score
        assert bool(rewards.valid[row]) == (
            (status == "ok" or (policy == "fallback" and length is not None)) and length != 0
        ), (i, r)
        line = rewards.rm_scores[row].tolist()
        col = None if length == 0 else RESP - 1 if length is None else min(length, RESP) - 1
        assert line == [want_score if c == col else 0.0 for c in range(RESP)], (i, line)
        for key in keys:
            assert rewards.reward_extra_info[key][row] == extra.get(key), (i, key)


def meta(policy: str = "mask", size: int = 4) -> BatchMeta:
    policy_ = BatchPolicy(on_failure=policy, fallback_score=-1.0)
    return BatchMeta(size=size, response_len=RESP, policy=policy_, created=0.0, deadline=0.0)


def sample_results() -> list[ScoreResult]:
    shared = {"deep": [1, {"x": 2}]}
    return [
        ScoreResult("b/0", "b", 0, 0.25, "ok", {"acc": True, "shared": shared}, valid_response_length=2),
        ScoreResult("b/1", "b", 1, 0.0, "failed", {"acc": False}, "scorer_error", "boom", valid_response_length=3),
        ScoreResult("b/2", "b", 2, 1.0, "ok", {"shared": shared}, valid_response_length=None),
        ScoreResult("b/3", "b", 3, 0.0, "failed", {}, "never_pushed", "never"),
    ]


N = 3000


def result(batch: str, i: int) -> ScoreResult:
    extra = {"acc": i % 2 == 0, "pred": str(i)} if i % 3 else {}
    status = "failed" if i % 7 == 0 else "ok"
    return ScoreResult(
        f"{batch}/{i}",
        batch,
        i,
        float(i % 5),
        status,
        extra,
        "scorer_error" if status == "failed" else None,
        "boom" if status == "failed" else None,
        1 + i % 2,
        i % 11,
        "openai/gsm8k",
        f"g{i // 8}",
        1_700_000_000.5 + i,
    )


async def store(redis_url: str, namespace: str, producer: RolloutProducer, batch: str) -> list[ScoreResult]:
    await producer.open_batch(batch, N, 16)
    results = [result(batch, i) for i in range(N)]
    client = connect(redis_url)
    try:
        ledger = LedgerWriter(client, Keys(namespace), "scorers", result_ttl_s=60)
        for lo in range(0, N, 500):
            items = [LedgerItem("", batch, r.uid, encode_result(r)) for r in results[lo : lo + 500]]
            assert await ledger.write(0, items) == len(items)
    finally:
        await client.aclose()
    return results


# The failure policy, pure and through the pipeline


async def test_mask_zeroes_and_invalidates_failed_samples(redis_url: str, namespace: str) -> None:
    rewards = await run_batch(redis_url, namespace, BatchPolicy(on_failure="mask"), timeout_s=20)
    assert rewards.indices == [0, 1, 2, 3, 4, 5]
    assert rewards.status == ["ok", "failed", "ok", "ok", "failed", "ok"]
    assert rewards.scores == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert rewards.valid.tolist() == [True, False, True, True, False, True]
    assert row_of(rewards, 1) == [0.0] * RESPONSE_LEN
    assert row_of(rewards, 0)[2] == 1.0 and sum(row_of(rewards, 0)) == 1.0  # last valid token = length - 1
    failed = [r for r in rewards.results if r.status == "failed"]
    assert {(r.reason, r.attempts) for r in failed} == {("http_503", 6)}
    assert all("gave up" in (e or "") for e, s in zip(rewards.errors, rewards.status) if s == "failed")
    # reward_extra_info keeps one entry per sample, failed ones filled explicitly
    assert rewards.reward_extra_info["acc"] == [True, None, True, False, None, True]


def test_mask_is_the_same_without_the_pipeline() -> None:
    rewards = pure_batch(BatchPolicy(on_failure="mask"))
    assert rewards.status == ["ok", "failed", "ok", "ok", "failed", "ok"]
    assert rewards.scores == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert rewards.valid.tolist() == [True, False, True, True, False, True]
    assert rewards.reward_extra_info["acc"] == [True, None, True, False, None, True]


def test_fallback_scores_failed_samples_at_their_last_token() -> None:
    rewards = pure_batch(BatchPolicy(on_failure="fallback", fallback_score=-0.5))
    assert rewards.status.count("failed") == 2
    assert rewards.scores == [1.0, -0.5, 1.0, 0.0, -0.5, 1.0]
    assert rewards.valid.tolist() == [True] * 6
    assert row_of(rewards, 1)[LENGTHS[1] - 1] == -0.5 and sum(row_of(rewards, 1)) == -0.5
    assert row_of(rewards, 4)[LENGTHS[4] - 1] == -0.5


def test_drop_removes_failed_rows() -> None:
    rewards = pure_batch(BatchPolicy(on_failure="drop"))
    assert rewards.indices == [0, 2, 3, 5]
    assert tuple(rewards.rm_scores.shape) == (4, RESPONSE_LEN)
    assert rewards.status == ["ok"] * 4
    assert rewards.scores == [1.0, 1.0, 0.0, 1.0]
    assert all(len(column) == 4 for column in rewards.reward_extra_info.values())
    assert row_of(rewards, 3) == [0.0] * RESPONSE_LEN


def test_zero_length_response_never_writes_to_the_last_column() -> None:
    rewards = pure_batch(BatchPolicy(on_failure="fallback", fallback_score=-1.0), ["a", "fail"], [0, 0])
    assert rewards.rm_scores.abs().sum().item() == 0.0
    assert rewards.valid.tolist() == [False, False]


async def test_deadline_resolves_unfinished_samples_as_failed(redis_url: str, namespace: str) -> None:
    began = time.monotonic()
    rewards = await run_batch(
        redis_url,
        namespace,
        BatchPolicy(on_failure="mask", deadline_s=1.0),
        responses=["a", "hang", "b", "fail"],
        lengths=[1, 2, 3, 4],
    )
    elapsed = time.monotonic() - began
    assert 0.9 <= elapsed < 10  # collect returned at the deadline, not when the verifier answered
    assert rewards.status == ["ok", "failed", "ok", "failed"]
    assert [r.reason for r in rewards.results] == [None, "deadline", None, "http_503"]
    assert rewards.valid.tolist() == [True, False, True, False]
    assert rewards.scores == [1.0, 0.0, 1.0, 0.0]


async def test_deadline_with_drop(redis_url: str, namespace: str) -> None:
    rewards = await run_batch(
        redis_url,
        namespace,
        BatchPolicy(on_failure="drop", deadline_s=0.8),
        responses=["hang", "a", "hang"],
        lengths=[1, 2, 3],
    )
    assert rewards.indices == [1]
    assert tuple(rewards.rm_scores.shape) == (1, RESPONSE_LEN)


async def test_deadline_fallback_lands_on_the_last_valid_token(redis_url: str, namespace: str) -> None:
    rewards = await run_batch(
        redis_url,
        namespace,
        BatchPolicy(on_failure="fallback", fallback_score=-1.0, deadline_s=0.8),
        responses=["a", "hang"],
        lengths=[1, 2],
    )
    assert rewards.scores == [1.0, -1.0]
    assert row_of(rewards, 1)[1] == -1.0


async def test_collect_timeout_raises_or_resolves(redis_url: str, namespace: str) -> None:
    with pytest.raises(CollectTimeoutError):
        await run_batch(
            redis_url, namespace, BatchPolicy(on_failure="mask"), responses=["a", "hang"], lengths=[1, 1], timeout_s=0.5
        )
    rewards = await run_batch(
        redis_url,
        namespace,
        BatchPolicy(on_failure="mask"),
        responses=["a", "hang"],
        lengths=[1, 1],
        timeout_s=0.5,
        on_timeout="resolve",
    )
    assert rewards.status == ["ok", "failed"]
    assert rewards.results[1].reason == "timeout"
    assert rewards.valid.tolist() == [True, False]


# Collected records, aligned


@pytest.mark.parametrize("policy", POLICIES)
async def test_collect_keeps_every_per_sample_field_aligned_under_each_policy(redis_url, namespace, policy) -> None:
    async with producer_and_aggregator(redis_url, namespace) as (producer, agg):
        await mixed_batch(redis_url, namespace, producer, "m", policy)
        rewards = await agg.collect("m", timeout_s=0.5, on_timeout="resolve")
    check_aligned(rewards, "m", policy)


@pytest.mark.parametrize("policy", POLICIES)
async def test_build_rewards_of_the_collected_results_is_the_collected_batch(redis_url, namespace, policy) -> None:
    async with producer_and_aggregator(redis_url, namespace) as (producer, agg):
        await mixed_batch(redis_url, namespace, producer, "p", policy)
        meta = await agg.meta("p")
        everything = await agg.collect("p", timeout_s=0.5, on_timeout="resolve")
    # Rebuilt from what collect kept (all under mask / fallback, the ok ones under drop).
    again = build_rewards("p", meta, everything.results)
    check_aligned(again, "p", policy)
    assert again.results == everything.results
    assert again.reward_extra_info == everything.reward_extra_info
    assert again.scores == everything.scores and again.errors == everything.errors
    assert again.rm_scores.tolist() == everything.rm_scores.tolist()
    assert again.valid.tolist() == everything.valid.tolist()


async def test_stream_yields_each_sample_once_with_its_own_extra_and_fails_unreadable_ones(
    redis_url, namespace
) -> None:
    async with producer_and_aggregator(redis_url, namespace) as (producer, agg):
        await mixed_batch(redis_url, namespace, producer, "s", "mask")
        got = [r async for r in agg.stream("s", timeout_s=0.5)]
        rewards = await agg.collect("s", timeout_s=0.5, on_timeout="resolve")
    by_index = {r.index: r for r in got}
    assert len(by_index) == len(got) == 8  # 4 and 5 never land; the intruder, 40 and 8's rescore ignored
    assert sorted(by_index) == [0, 1, 2, 3, 6, 7, 8, 9]
    for r in got:
        assert isinstance(r, ScoreResult)
        assert r == rewards.results[r.index], r
    assert by_index[2].reason == "schema_version" and by_index[3].reason == "malformed"
    assert by_index[7].uid == "s/7" and by_index[8].score == 3.0
    extras = [r.extra for r in got]
    assert len({id(x) for x in extras}) == len(extras)  # no dict shared between two samples
    got[0].extra["mine"] = 1
    assert all("mine" not in r.extra for r in got[1:])


async def test_per_sample_result_of_foreign_and_garbled_records_fails_that_sample(redis_url, namespace) -> None:
    async with producer_and_aggregator(redis_url, namespace) as (producer, agg):
        await mixed_batch(redis_url, namespace, producer, "r", "mask")
        foreign = await agg.result("r", "r/2", timeout_s=2)
        garbled = await agg.result("r", "r/3", timeout_s=2)
        good = await agg.result("r", "r/0", timeout_s=2)
        seven = await agg.result("r", "r/7", timeout_s=2)
        intruder = await agg.result("r", "intruder", timeout_s=2)
    assert (foreign.status, foreign.reason, foreign.index, foreign.batch_id) == ("failed", "schema_version", 2, "r")
    assert (garbled.status, garbled.reason, garbled.index) == ("failed", "malformed", 3)
    assert good == ok("r", 0, 0.5, 3, {"acc": True, "nested": {"a": [1, 2]}})
    assert seven.extra == {"list": [1, [2, 3]]} and seven.valid_response_length is None
    assert (intruder.uid, intruder.index, intruder.score) == ("intruder", 7, -5.0)


@pytest.mark.parametrize("policy", POLICIES)
def test_build_rewards_under_drop_mask_fallback_keeps_rows_aligned(policy) -> None:
    results = sample_results()
    rewards = build_rewards("b", meta(policy), results)
    kept = [r for r in results if not (policy == "drop" and r.status == "failed")]
    assert rewards.indices == [r.index for r in kept]
    assert rewards.results == kept
    assert rewards.status == [r.status for r in kept]
    assert rewards.errors == [r.error for r in kept]
    assert rewards.rm_scores.shape[0] == len(kept) == rewards.valid.shape[0] == len(rewards.scores)
    for row, r in enumerate(kept):
        for key, column in rewards.reward_extra_info.items():
            assert column[row] == r.extra.get(key)
    # Extras are read, never copied: nested values are the sample's own objects.
    shared = results[0].extra["shared"]
    assert rewards.results[0].extra["shared"] is shared
    assert rewards.reward_extra_info["shared"][0] is shared


def test_build_rewards_with_nothing_and_with_every_sample_dropped() -> None:
    empty = build_rewards("b", meta("drop", 0), [])
    assert (empty.indices, empty.results, empty.scores, tuple(empty.rm_scores.shape)) == ([], [], [], (0, RESP))
    failed = [r for r in sample_results() if r.status == "failed"]
    none = build_rewards("b", meta("drop"), failed)
    assert (none.indices, none.results, none.status, none.errors, none.reward_extra_info) == ([], [], [], [], {})
    assert tuple(none.rm_scores.shape) == (0, RESP) and tuple(none.valid.shape) == (0,)


def test_build_rewards_keeps_the_given_result_objects() -> None:
    """``results=list(kept)``: the caller's own ScoreResults, so an edit of one
    (or a subclass with more to it) is what the batch shows."""
    results = sample_results()
    rewards = build_rewards("b", meta(), results)
    assert all(a is b for a, b in zip(rewards.results, results))


def test_results_extra_edits_do_not_leak_between_samples_or_into_the_columns() -> None:
    rewards = build_rewards("b", meta(), sample_results())
    before = copy.deepcopy(rewards.reward_extra_info)
    rewards.results[1].extra["new"] = "x"
    rewards.reward_extra_info["acc"][0] = "edited"
    assert "new" not in rewards.results[0].extra and "new" not in rewards.reward_extra_info
    assert rewards.results[0].extra["acc"] is True
    assert rewards.results is rewards.results and rewards.results[1].extra["new"] == "x"  # kept, not remade
    assert before["acc"] == [True, False, None, None]


async def test_collect_survives_a_record_whose_score_is_not_a_number(redis_url, namespace) -> None:
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as p,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await p.open_batch("g", 3, 8)
        client = connect(redis_url)
        try:
            await client.xadd(
                p.keys.done("g", 0), {DONE_FIELD: record("g", 0) + garbage_row("g", 1, score="abc") + record("g", 2)}
            )
        finally:
            await client.aclose()
        rewards = await agg.collect("g", timeout_s=2, on_timeout="resolve")  # observed: raw ValueError
    assert rewards.status[0] == "ok" and rewards.status[2] == "ok"
    assert rewards.status[1] == "failed"


async def test_collect_survives_a_record_whose_extra_is_not_a_map(redis_url, namespace) -> None:
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as p,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await p.open_batch("g", 2, 8)
        client = connect(redis_url)
        try:
            await client.xadd(p.keys.done("g", 0), {DONE_FIELD: record("g", 0) + garbage_row("g", 1, extra=5)})
        finally:
            await client.aclose()
        rewards = await agg.collect("g", timeout_s=2, on_timeout="resolve")  # observed: TypeError in merge_extra_info
    assert rewards.status == ["ok", "failed"]


# BatchRewards as a value


def test_batch_rewards_survives_copy_deepcopy_pickle_and_replace_with_its_results() -> None:
    rewards = build_rewards("b", meta(), sample_results())
    want = sample_results()
    for other in (
        copy.copy(rewards),
        copy.deepcopy(rewards),
        pickle.loads(pickle.dumps(rewards)),
        dataclasses.replace(rewards, scores=list(rewards.scores)),
    ):
        assert other.results == want
        assert other.indices == rewards.indices and other.errors == rewards.errors
        assert other.rm_scores.tolist() == rewards.rm_scores.tolist()
    _ = rewards.results  # made and cached: a copy after that as well
    assert pickle.loads(pickle.dumps(rewards)).results == want
    assert copy.deepcopy(rewards).results == want
    assert rewards == copy.copy(rewards)


async def test_a_shallow_copy_of_a_collected_batch_shares_its_results(redis_url, namespace) -> None:
    """As a shallow copy of a batch whose results were a list shares that list, taken
    before the first read too (the ScoreResults are made once, for both)."""
    async with producer_and_aggregator(redis_url, namespace) as (producer, agg):
        await producer.open_batch("b", SIZE, RESP, policy=BatchPolicy(on_failure="mask"))
        client = connect(redis_url)
        try:
            ledger = LedgerWriter(client, Keys(namespace), "scorers", result_ttl_s=60)
            items = [LedgerItem("", "b", f"b/{i}", encode_result(ok("b", i, 1.0, 2))) for i in range(SIZE)]
            await ledger.write(0, items)
        finally:
            await client.aclose()
        rewards = await agg.collect("b", timeout_s=30)
    twin = copy.copy(rewards)
    assert twin.results is rewards.results and len(twin.results) == SIZE


def test_an_edit_of_a_result_survives_dataclasses_replace() -> None:
    """replace() passes the same ScoreResult objects on: a copy that remade them from the
    records would lose an edit made through ``results``."""
    rewards = build_rewards("b", meta(), sample_results())
    rewards.results[0].reason = "relabelled"
    assert dataclasses.replace(rewards, scores=list(rewards.scores)).results[0].reason == "relabelled"


def test_batch_rewards_results_as_a_field() -> None:
    """``results`` is a dataclass field: set, replaced, in asdict() and fields()."""
    rewards = build_rewards("b", meta(), sample_results())
    names = [f.name for f in dataclasses.fields(rewards)]
    assert "results" in names
    assert dataclasses.asdict(rewards)["results"][0]["uid"] == "b/0"
    fewer = dataclasses.replace(rewards, results=rewards.results[:1])
    assert len(fewer.results) == 1


def test_batch_rewards_results_assignable() -> None:
    rewards = build_rewards("b", meta(), sample_results())
    rewards.results = rewards.results[:2]
    assert len(rewards.results) == 2


def test_batch_rewards_built_by_keyword_with_results() -> None:
    """A trainer's fake / a test double builds a BatchRewards itself, as the class documents its fields."""
    r = build_rewards("b", meta(), sample_results())
    made = BatchRewards(
        batch_id="b",
        rm_scores=r.rm_scores,
        scores=r.scores,
        status=r.status,
        reward_extra_info=r.reward_extra_info,
        valid=r.valid,
        indices=r.indices,
        results=sample_results(),
        errors=r.errors,
    )
    assert made.results == sample_results()


def test_batch_rewards_built_positionally() -> None:
    """The 8th positional argument is ``results``, the 9th ``errors``: not ``_records`` /
    ``_extras``, where they would land silently and break the batch later, on first use."""
    r = build_rewards("b", meta(), sample_results())
    made = BatchRewards(
        "b", r.rm_scores, r.scores, r.status, r.reward_extra_info, r.valid, r.indices, sample_results(), r.errors
    )
    assert made.errors == r.errors
    assert made.results == sample_results()


def test_batch_rewards_repr_shows_each_sample_result() -> None:
    """repr(BatchRewards) lists the results (uids, reasons, errors)."""
    rewards = build_rewards("b", meta(), sample_results())
    assert "scorer_error" in repr(rewards) and "b/3" in repr(rewards)


def test_two_batches_differing_only_in_a_result_are_unequal() -> None:
    a = build_rewards("b", meta(), sample_results())
    changed = sample_results()
    changed[0] = dataclasses.replace(changed[0], uid="other")  # uid is in no other column
    b = dataclasses.replace(a, **{f.name: getattr(a, f.name) for f in dataclasses.fields(a) if f.init})
    assert a == b
    c = build_rewards("b", meta(), changed)
    c = dataclasses.replace(c, rm_scores=a.rm_scores, valid=a.valid)  # same tensor objects: comparable
    assert a != c


def test_a_batch_made_without_init_has_no_results_attribute_rather_than_a_key_error() -> None:
    """As with a plain field: ``hasattr`` (and copy or pickle helpers that probe) see an
    unset ``results`` as missing; a KeyError from the field would escape hasattr."""
    bare = BatchRewards.__new__(BatchRewards)
    assert not hasattr(bare, "results")


# What a collected batch leaves on the heap. A trainer holds a batch's rewards through its
# step, and the aggregator holds the results while the batch fills: an object the garbage
# collector tracks per sample, alive that long, reaches the oldest generation and counts
# toward its next full collection, which walks the whole heap of a process with torch (and
# a model) loaded (measured in ``bench throughput``: 3 full collections of ~0.12 s per
# 100,000 samples). The results are kept as tuples of atoms, which the collector stops
# tracking after one pass, and made ScoreResults on first use.
async def test_a_collected_batch_holds_no_tracked_object_per_sample_until_its_results_are_asked_for(
    redis_url, namespace
) -> None:
    async with producer_and_aggregator(redis_url, namespace) as (producer, agg):
        await store(redis_url, namespace, producer, "warm")
        await agg.collect("warm", timeout_s=30)  # connections, scripts, torch's first calls
        expected = await store(redis_url, namespace, producer, "b")
        gc.collect()
        before = len(gc.get_objects())
        rewards = await agg.collect("b", timeout_s=30)
        gc.collect()
        held = len(gc.get_objects()) - before
        # Before: one ScoreResult per sample (3,000 and more); the lists of the batch's fields are a handful.
        assert held < N // 20, held
        # What the results were, unchanged: every field, made once and kept.
        assert rewards.results == expected
        assert rewards.results is rewards.results
        assert rewards.scores == [r.score if r.status == "ok" else 0.0 for r in expected]  # the default policy
        assert rewards.status == [r.status for r in expected]
        assert rewards.errors == [r.error for r in expected]
        assert rewards.reward_extra_info["acc"] == [r.extra.get("acc") for r in expected]
        # Each sample's extra is its own dict, as a ScoreResult's always was.
        rewards.results[1].extra["mine"] = 1
        assert "mine" not in rewards.results[2].extra


async def test_a_forgotten_batch_keeps_under_a_kilobyte_per_sample_and_is_refused_after(own_url: str) -> None:
    """Batches of one sample each, as an agent loop sends them: once collected and
    forgotten, what stays in Redis (the write-once marks, the meta that refuses the id)
    is under 1 KB a sample; the results themselves go at once. A collect of a forgotten
    batch says so rather than waiting for results that are gone."""
    from helpers import samples, worker

    n = 200
    admin = connect(own_url)
    try:
        async with producer_and_aggregator(own_url, "ns") as (producer, agg), worker(own_url, "ns"):

            async def one(batch: str) -> None:
                await producer.open_batch(batch, 1, 8)
                await producer.push_many(samples(batch, ["a"]))
                assert (await agg.collect(batch, timeout_s=30)).scores == [1.0]
                await agg.forget(batch)

            await one("warm")  # streams, groups and namespace records exist from here on
            before = (await admin.info("memory"))["used_memory"]
            for i in range(n):
                await one(f"b{i}")
            per_sample = ((await admin.info("memory"))["used_memory"] - before) / n
            assert per_sample <= 1024, f"{per_sample:.0f} bytes kept per collected sample"
            with pytest.raises(ConfigError, match="forgotten"):
                await agg.collect("b0", timeout_s=5)
            with pytest.raises(BatchExistsError):
                await producer.open_batch("b0", 1, 8)  # the id is still refused while its meta lives
    finally:
        await admin.aclose()


@pytest.mark.parametrize("shift_s", [-3600.0, 3600.0])
async def test_an_aggregator_clock_an_hour_off_ends_the_collect_at_the_deadline(
    redis_url: str, namespace: str, shift_s: float
) -> None:
    """The aggregator compares the deadline with the server's time (read once per collect), not its own."""
    real_time = time.time
    async with producer_and_aggregator(redis_url, namespace) as (producer, agg):
        await producer.open_batch("b", 2, RESPONSE_LEN, policy=BatchPolicy(deadline_s=1.0))
        await producer.push_many([Trajectory("b", i, "test", response="a", ground_truth="a") for i in range(2)])
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(time, "time", lambda: real_time() + shift_s)  # this process's clock only
            began = time.monotonic()
            rewards = await agg.collect("b", timeout_s=15, on_timeout="resolve")
            elapsed = time.monotonic() - began
    assert [r.reason for r in rewards.results] == ["deadline", "deadline"]
    assert 0.8 <= elapsed < 10


@pytest.mark.parametrize("lost", ["batch record", "results stream", "result ledger"])
async def test_a_key_deleted_mid_collect_is_state_lost_naming_the_batch_and_the_key(
    redis_url: str, namespace: str, lost: str
) -> None:
    """An operator's DEL (or an eviction) while a collect waits, of the batch record, the
    done stream (the results in landing order) or the write-once ledger written with it:
    a StateLostError naming the batch and the key within a few seconds, not a deadline or
    timeout an hour later."""
    keys = Keys(namespace)
    key = {
        "batch record": keys.batch_meta("b"),
        "results stream": keys.done("b", 0, "scorers"),
        "result ledger": keys.results("b", 0, "scorers"),
    }[lost]
    admin = connect(redis_url)
    try:
        async with producer_and_aggregator(redis_url, namespace) as (producer, agg), worker(redis_url, namespace):
            await producer.open_batch("b", 3, RESPONSE_LEN)
            await producer.push_many(
                [Trajectory("b", i, "test", response=r, ground_truth="a") for i, r in enumerate(["a", "a", "hang"])]
            )
            results = agg.stream("b", timeout_s=30)
            assert [(await anext(results)).index for _ in range(2)]  # the collect is under way
            assert await admin.delete(key) == 1
            began = time.monotonic()
            with pytest.raises(StateLostError) as info:
                await anext(results)
            elapsed = time.monotonic() - began
    finally:
        await admin.aclose()
    assert info.value.batches == ["b"] and info.value.key == key
    assert "batch 'b'" in str(info.value) and lost in str(info.value)
    assert elapsed < 10, f"noticed after {elapsed:.1f}s"


async def test_a_batch_record_deleted_before_its_collect_is_state_lost_not_expired(
    redis_url: str, namespace: str
) -> None:
    keys = Keys(namespace)
    admin = connect(redis_url)
    try:
        async with producer_and_aggregator(redis_url, namespace) as (producer, _):
            await producer.open_batch("b", 2, RESPONSE_LEN)
            await producer.push_many([Trajectory("b", i, "test", response="a", ground_truth="a") for i in range(2)])
        await admin.delete(keys.batch_meta("b"))
        async with RewardAggregator(redis_url, namespace=namespace) as fresh:
            with pytest.raises(StateLostError) as info:
                await fresh.collect("b", timeout_s=5)
    finally:
        await admin.aclose()
    assert info.value.batches == ["b"] and info.value.key == keys.batch_meta("b")
    assert "expired" not in str(info.value) and "never opened" not in str(info.value)


async def test_an_eviction_mid_collect_is_state_lost_naming_the_batch_and_the_eviction(own_url: str) -> None:
    """A server that evicts (allkeys-lru, run with --allow-eviction) drops the batch under
    memory pressure: the collect says the batch lost its state, and that the server evicted keys."""
    admin = connect(own_url)
    try:
        async with (
            RolloutProducer(own_url, ProducerConfig(namespace="ns", allow_eviction=True)) as producer,
            RewardAggregator(own_url, namespace="ns", allow_eviction=True) as agg,
        ):
            await producer.open_batch("b", 2, RESPONSE_LEN)
            await producer.push_many([Trajectory("b", i, "test", response="a", ground_truth="a") for i in range(2)])
            await agg.meta("b")
            collect = asyncio.create_task(agg.collect("b", timeout_s=30))
            await admin.config_set("maxmemory-policy", "allkeys-lru")
            await admin.config_set("maxmemory", "1")  # memory pressure: everything goes
            began = time.monotonic()
            await wait_until(lambda: _evicted_all(admin))
            await admin.config_set("maxmemory", "0")
            with pytest.raises(StateLostError) as info:
                await collect
            elapsed = time.monotonic() - began
    finally:
        await admin.aclose()
    assert info.value.batches == ["b"]
    said = str(info.value).lower()
    assert "batch 'b'" in said and "evicted" in said and "allkeys-lru" in said
    assert elapsed < 10, f"noticed after {elapsed:.1f}s"


async def _evicted_all(client) -> bool:
    return (await client.info("stats"))["evicted_keys"] > 0 and await client.dbsize() == 0


async def test_a_failover_to_a_lagging_replica_is_state_lost_naming_the_batch() -> None:
    """The replica promoted had not received the last results: the count the aggregator
    read went backwards on the server it now reads. Reported, not waited out."""
    from helpers import FailoverProxy, free_tcp_port

    from stream_reward.ops.embedded import EmbeddedServer

    p_port, r_port = free_tcp_port(), free_tcp_port()
    tcp = ["--bind", "127.0.0.1"]
    with (
        EmbeddedServer(extra_args=["--port", str(p_port), *tcp]) as primary,
        EmbeddedServer(extra_args=["--port", str(r_port), *tcp]) as replica,
    ):
        p, r = connect(primary.url), connect(replica.url)
        keys = Keys("ns")
        done = keys.done("b", 0, "scorers")
        writer = LedgerWriter(p, keys, "scorers", result_ttl_s=3600)

        async def result(i: int) -> None:
            record = encode_result(ScoreResult(f"u{i}", "b", i, 1.0))
            await writer.write(0, [LedgerItem("", "b", f"u{i}", record)])

        async def replicated() -> bool:
            return await r.exists(done) == 1 and await r.xlen(done) == 2

        try:
            await r.execute_command("REPLICAOF", "127.0.0.1", p_port)
            async with (
                FailoverProxy(primary.socket_path) as proxy,
                RolloutProducer(primary.url, ProducerConfig(namespace="ns")) as producer,
                RewardAggregator(proxy.url, namespace="ns") as agg,
            ):
                await producer.open_batch("b", 4, RESPONSE_LEN)
                await result(0)
                await result(1)
                await wait_until(replicated)
                await r.execute_command("REPLICAOF", "NO", "ONE")  # promoted, without what comes next
                await result(2)
                results = agg.stream("b", timeout_s=30)
                assert sorted([(await anext(results)).index for _ in range(3)]) == [0, 1, 2]
                await proxy.fail_over(replica.socket_path)
                began = time.monotonic()
                with pytest.raises(StateLostError) as info:
                    await anext(results)
                elapsed = time.monotonic() - began
        finally:
            await p.aclose()
            await r.aclose()
    assert info.value.batches == ["b"] and info.value.key == done
    assert "holds 2 entries, 3 were read" in str(info.value)
    assert elapsed < 10, f"noticed after {elapsed:.1f}s"


async def test_a_batch_forgotten_by_another_aggregator_mid_collect_says_forgotten_not_lost(
    redis_url: str, namespace: str
) -> None:
    async with producer_and_aggregator(redis_url, namespace) as (producer, agg), worker(redis_url, namespace):
        await producer.open_batch("b", 3, RESPONSE_LEN)
        await producer.push_many(
            [Trajectory("b", i, "test", response=r, ground_truth="a") for i, r in enumerate(["a", "a", "hang"])]
        )
        results = agg.stream("b", timeout_s=30)
        assert [(await anext(results)).index for _ in range(2)]
        async with RewardAggregator(redis_url, namespace=namespace) as other:
            await other.forget("b")
        with pytest.raises(ConfigError, match="forgotten while being collected"):
            await anext(results)


@pytest.mark.anyio
async def test_collect_raises_redis_unavailable_within_its_give_up_when_redis_is_black_holed(namespace):
    """collect with a long timeout: a server that stops answering is an error within the
    liveness bound (GIVE_UP_S, retries included), not a wait for the collect timeout."""
    from helpers import CutProxy, exact_traj

    from stream_reward.errors import RedisUnavailableError
    from stream_reward.ops.embedded import EmbeddedServer
    from stream_reward.wire.connection import DEFAULT_TIMEOUT_S, GIVE_UP_S

    assert GIVE_UP_S + DEFAULT_TIMEOUT_S <= 45  # a caller hears of an outage within a minute, overheads included

    with EmbeddedServer() as server:
        async with CutProxy(server.url[len("unix://") :]) as proxy:
            async with producer_and_aggregator(proxy.url, namespace) as (producer, agg):
                await producer.open_batch("b1", 4, 8)
                await producer.push(exact_traj("b1", 0))
                proxy.black = True
                loop = asyncio.get_running_loop()
                start = loop.time()
                try:
                    with pytest.raises(RedisUnavailableError):
                        await asyncio.wait_for(agg.collect("b1", timeout_s=600), 120)
                    assert loop.time() - start <= GIVE_UP_S + 2  # and the scheduling slack of a loaded host
                finally:
                    proxy.black = False


async def test_a_result_read_while_the_state_check_is_in_flight_is_not_state_lost(
    redis_url: str, namespace: str
) -> None:
    """On a cluster one reader per done stream runs beside the state check: an entry that
    lands after the check's XLEN and is read before its reply is compared is no loss."""
    from stream_reward.trainer.watch import BatchWatch, check_written

    keys = Keys(namespace, 2)
    client = connect(redis_url)
    watch = BatchWatch()
    streams = [keys.done("b", p, "scorers") for p in range(2)]
    for p, stream in enumerate(streams):
        await client.xadd(stream, {DONE_FIELD: b""})
        await client.hset(keys.results("b", p, "scorers"), "u", "1")
        watch.ledgers[stream] = keys.results("b", p, "scorers")
        watch.saw(stream, 1)
    await client.hset(keys.batch_meta("b"), "size", 4)
    real_pipeline = client.pipeline

    class ReadMeanwhile:
        """The pipeline, with the other stream's reader reading a new entry between the
        server's reply and its comparison."""

        def __init__(self, **kwargs) -> None:
            self._pipe = real_pipeline(**kwargs)

        async def __aenter__(self):
            await self._pipe.__aenter__()
            return self

        async def __aexit__(self, *exc):
            return await self._pipe.__aexit__(*exc)

        def __getattr__(self, name):
            return getattr(self._pipe, name)

        async def execute(self):
            replies = await self._pipe.execute()
            await client.xadd(streams[1], {DONE_FIELD: b""})
            watch.saw(streams[1], 2)
            return replies

    client.pipeline = ReadMeanwhile  # type: ignore[method-assign]
    try:
        await check_written(client, "b", keys.batch_meta("b"), watch)
    finally:
        client.pipeline = real_pipeline  # type: ignore[method-assign]
        await client.aclose()


@pytest.mark.parametrize("closing", ["collect", "forget"])
async def test_closing_writes_refused_at_maxmemory_wait_for_memory(own_url, namespace, caplog, closing) -> None:
    """At ``maxmemory`` under noeviction the server refuses writes (``OOM command not
    allowed``), the very moment results pile up. A batch whose results are all in is not
    failed for its closing writes (the ``collected`` / ``forgotten`` stamps): they wait the
    refusal out, logged in the server's words, and land once memory frees."""
    admin = connect(own_url)
    try:
        async with producer_and_aggregator(own_url, namespace) as (producer, agg), worker(own_url, namespace):
            await producer.open_batch("m", 3, 8)
            await producer.push_many(samples("m", ["a", "x", "a"]))
            keys = Keys(namespace)

            async def all_in() -> bool:
                return await admin.hlen(keys.results("m", 0, "scorers")) >= 3

            await wait_until(all_in)
            if closing == "forget":
                await agg.collect("m", timeout_s=30)
            await admin.config_set("maxmemory", 1)  # below what is used: every write is refused
            call = asyncio.ensure_future(agg.collect("m", timeout_s=30) if closing == "collect" else agg.forget("m"))

            async def refused() -> bool:
                return call.done() or any("OutOfMemoryError" in r.getMessage() for r in caplog.records)

            await wait_until(refused)
            assert not call.done(), call.exception()
            await admin.config_set("maxmemory", 0)
            outcome = await asyncio.wait_for(call, 30)
            if closing == "collect":
                assert (outcome.scores, outcome.status) == ([1.0, 0.0, 1.0], ["ok", "ok", "ok"])
                assert await admin.hget(keys.batch_meta("m"), "collected")
            else:
                assert await admin.hget(keys.batch_meta("m"), "forgotten")
                assert await admin.exists(keys.done("m", 0, "scorers")) == 0
    finally:
        await admin.config_set("maxmemory", 0)
        await admin.aclose()
