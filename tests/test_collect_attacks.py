"""Attacks on collect() / stream() / build_rewards once a batch kept its results as
records and extras, ScoreResults made on first use of BatchRewards.results (helper-32).

Every test here passed on the code before it (7603024); the seven on BatchRewards as a
public class failed on the first version of the change (c84549d)."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import msgpack
import pytest
from helpers import producer_and_aggregator

from stream_reward import BatchPolicy, BatchRewards, RolloutProducer, ScoreResult
from stream_reward.trainer.aggregator import build_rewards
from stream_reward.wire.batch_meta import BatchMeta
from stream_reward.wire.codec import PROTOCOL_VERSION, encode_result, result_from_row, stored_result
from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys
from stream_reward.wire.ledger import LedgerItem, LedgerWriter
from stream_reward.wire.trajectory import Trajectory

pytestmark = pytest.mark.anyio

SIZE = 10
RESP = 6
POLICIES = ["mask", "drop", "fallback"]


def raw(version, uid, batch, index, score=1.0, status="ok", extra=None, vl=None) -> bytes:
    return msgpack.packb([version, uid, batch, index, score, status, 1, 0.0, extra, None, None, vl, "ds", None])


def ok(batch: str, i: int, score: float, vl: int | None, extra: dict | None = None, uid: str = "") -> ScoreResult:
    return ScoreResult(uid or f"{batch}/{i}", batch, i, score, "ok", extra or {}, valid_response_length=vl)


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


def test_codec_rows_round_trip_and_fail_their_own_sample() -> None:
    r = ScoreResult("u", "b", 3, 1, "ok", {"n": {"x": [1]}}, None, None, 2, 7, "ds", "g", 1.5)
    row = msgpack.unpackb(encode_result(r))
    back = result_from_row(row)
    assert back == dataclasses.replace(r, score=1.0) and type(back.score) is float
    assert stored_result(row) == back
    foreign = stored_result([PROTOCOL_VERSION + 7, "u", "b", 3, "anything"])
    assert (foreign.uid, foreign.index, foreign.batch_id, foreign.status, foreign.reason) == (
        "u",
        3,
        "b",
        "failed",
        "schema_version",
    )
    assert foreign.extra == {} and foreign.score == 0.0
    assert stored_result([PROTOCOL_VERSION, 5, "b"]) is None
    # Two failed results of unreadable rows never share an extra.
    a, b = stored_result([99, "a", 1, 0]), stored_result([99, "b", None, 1])
    assert a.batch_id == "" and b.batch_id == ""
    a.extra["k"] = 1
    assert b.extra == {}


# ---- build_rewards, a pure function, and BatchRewards as a value ----------------------------------


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
    """replace() passes the same ScoreResult objects on. With c84549d the copy remade
    them from the records, and an edit made through ``results`` was lost."""
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
    """The 8th positional argument is ``results``, the 9th ``errors``. The records change
    (c84549d) had them land in ``_records`` / ``_extras`` silently, and the batch broke
    later, on first use."""
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
