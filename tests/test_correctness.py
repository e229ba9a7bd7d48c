"""Never a stale, wrong or early-failed reward (issue 13): one test per finding.

Each test plays a case where an earlier build trained on a wrong reward or lost
one: a reused batch id, a collect called after the deadline, two uids on one
index, a second consumer group, a record of another protocol version, a
namespace whose state vanished, misleading failure reasons and bad input.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgpack
import pytest

from stream_reward import BatchPolicy, RewardAggregator, RolloutProducer, Trajectory
from stream_reward.cli import main as cli_main
from stream_reward.config import ConsumerConfig, ProducerConfig
from stream_reward.errors import BatchExistsError, CollectTimeoutError, PushConflictError, StateLostError
from stream_reward.scoring.scorer import Scored
from stream_reward.wire.codec import PROTOCOL_VERSION, decode_trajectory, encode_result, encode_trajectory
from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys
from stream_reward.wire.ledger import LedgerItem, LedgerWriter
from stream_reward.wire.trajectory import ScoreResult
from stream_reward.worker.consumer import Worker

pytestmark = pytest.mark.anyio

WIDTH = 8


class Exact:
    """1.0 when the response equals the ground truth, else 0.0."""

    async def score(self, traj: Trajectory) -> Scored:
        return Scored(1.0 if traj.response == traj.ground_truth else 0.0)


class Constant:
    def __init__(self, value: float) -> None:
        self.value = value

    async def score(self, traj: Trajectory) -> Scored:
        return Scored(self.value)


@asynccontextmanager
async def worker(redis_url: str, namespace: str, scorer: Any = None, **cfg: Any) -> AsyncIterator[Worker]:
    w = Worker(
        redis_url, scorer or Exact(), ConsumerConfig(namespace=namespace, block_ms=50, drain_timeout_s=0.2, **cfg)
    )
    stop = asyncio.Event()
    task = asyncio.create_task(w.run(stop))
    try:
        yield w
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
        await w.aclose()


def samples(batch: str, responses: list[str], truth: str = "a", **kw: Any) -> list[Trajectory]:
    return [
        Trajectory(batch, i, "test", response=r, ground_truth=truth, valid_response_length=i + 1, **kw)
        for i, r in enumerate(responses)
    ]


# ------------------------------------------------------------------ 1. batch identity


async def test_reopening_a_batch_id_is_refused_not_answered_with_old_rewards(redis_url: str, namespace: str) -> None:
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
        worker(redis_url, namespace),
    ):
        await producer.open_batch("b", 3, WIDTH)
        await producer.push_many(samples("b", ["a", "a", "a"]))
        assert (await agg.collect("b", timeout_s=20)).scores == [1.0, 1.0, 1.0]
        # The same id again (all wrong this time): refused, saying the batch was collected.
        with pytest.raises(BatchExistsError, match="collected") as info:
            await producer.open_batch("b", 3, WIDTH)
        assert "unique" in str(info.value)
        # Open and not collected: refused too, saying when it was opened.
        await producer.open_batch("c", 2, WIDTH)
        with pytest.raises(BatchExistsError, match="opened"):
            await producer.open_batch("c", 5, WIDTH)
        # A restarted producer continuing its own batch resumes it; another size or policy is refused.
        await producer.open_batch("c", 2, WIDTH, resume=True)
        with pytest.raises(BatchExistsError, match="size"):
            await producer.open_batch("c", 3, WIDTH, resume=True)
        with pytest.raises(BatchExistsError, match="on_failure"):
            await producer.open_batch("c", 2, WIDTH, resume=True, policy=BatchPolicy(on_failure="drop"))


def test_cli_produce_of_an_existing_batch_exits_2_with_a_hint(
    redis_url: str, namespace: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rollouts = tmp_path / "r.jsonl"
    rollouts.write_text(json.dumps({"data_source": "test", "response": "a", "ground_truth": "a"}) + "\n")
    argv = ["produce", "--redis", redis_url, "--namespace", namespace, "--batch", "step-1", str(rollouts)]
    assert cli_main(argv) == 0
    capsys.readouterr()
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "already" in err and "step-1" in err and "unique batch id" in err
    assert "Traceback" not in err


# ------------------------------------------------------------------ 2. deadlines


@pytest.mark.parametrize("on_failure", ["fallback", "drop", "mask"])
async def test_collect_after_the_deadline_returns_the_stored_results(
    redis_url: str, namespace: str, on_failure: str
) -> None:
    policy = BatchPolicy(on_failure=on_failure, fallback_score=0.5, deadline_s=1.0)  # type: ignore[arg-type]
    batch = f"late-{on_failure}"
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await producer.open_batch(batch, 3, WIDTH, policy=policy)
        await producer.push_many(samples(batch, ["a", "b"]))  # index 2 is never pushed
        async with worker(redis_url, namespace):
            async for _ in agg.stream(batch, timeout_s=10):
                pass
        await asyncio.sleep(1.2)  # past the deadline, then collect
        rewards = await agg.collect(batch)
    by_index = dict(zip(rewards.indices, zip(rewards.status, rewards.scores)))
    assert by_index[0] == ("ok", 1.0) and by_index[1] == ("ok", 0.0)
    if on_failure == "drop":
        assert 2 not in by_index
    else:
        assert by_index[2][0] == "failed"
        assert rewards.results[-1].reason == "never_pushed"


# ------------------------------------------------------------------ 3. conflicts (aggregator side)


async def land_result(redis_url: str, namespace: str, result: ScoreResult) -> None:
    """Write a result as a worker would, past the push-time checks."""
    client = connect(redis_url)
    try:
        ledger = LedgerWriter(client, Keys(namespace), "scorers", result_ttl_s=600)
        await ledger.write(0, [LedgerItem("", result.batch_id, result.uid, encode_result(result))])
    finally:
        await client.aclose()


async def test_two_uids_on_one_index_never_end_collect_early(redis_url: str, namespace: str) -> None:
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
        worker(redis_url, namespace),
    ):
        await producer.open_batch("x", 2, WIDTH)
        # Index 0 twice under two uids (a conflict), index 1 still to come. The push refuses
        # the second; a result for it may still land (a build without the push check, a
        # cluster where claims are per partition): the aggregator must not count it.
        await producer.push(Trajectory("x", 0, "test", response="a", ground_truth="a", uid="u0"))
        with pytest.raises(PushConflictError):
            await producer.push(Trajectory("x", 0, "test", response="b", ground_truth="a", uid="u0-again"))
        await land_result(redis_url, namespace, ScoreResult("u0-again", "x", 0, 0.25))
        collecting = asyncio.create_task(agg.collect("x", timeout_s=20, on_timeout="resolve"))
        await asyncio.sleep(1.0)
        assert not collecting.done()  # two results landed, but only one index is resolved
        await producer.push(Trajectory("x", 1, "test", response="a", ground_truth="a", uid="u1"))
        rewards = await collecting
    assert rewards.status == ["ok", "ok"]
    assert rewards.results[0].uid == "u0" and rewards.results[1].uid == "u1"


async def test_a_conflict_never_raises_a_timeout_at_zero_seconds(redis_url: str, namespace: str) -> None:
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
        worker(redis_url, namespace),
    ):
        await producer.open_batch("y", 2, WIDTH)
        await producer.push(Trajectory("y", 0, "test", response="a", ground_truth="a", uid="p"))
        await land_result(redis_url, namespace, ScoreResult("q", "y", 0, 1.0))  # index 0 again, another uid
        started = time.monotonic()
        with pytest.raises(CollectTimeoutError):
            await agg.collect("y", timeout_s=1.5)
        assert time.monotonic() - started >= 1.4


# ------------------------------------------------------------------ 4. consumer groups


async def test_a_worker_of_another_group_never_decides_the_batch(redis_url: str, namespace: str) -> None:
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await producer.open_batch("g", 20, WIDTH)
        await producer.push_many(samples("g", ["a"] * 20))
        # The judges group scores everything first, with another scorer ...
        async with worker(redis_url, namespace, Constant(-7.0), group="judges", consumer="j1"):
            client = connect(redis_url)
            try:
                for _ in range(200):
                    groups = await client.xinfo_groups(Keys(namespace).stream())
                    judges = [g for g in groups if g["name"] in (b"judges", "judges")]
                    if judges and judges[0]["pending"] == 0 and judges[0]["entries-read"] == 20:
                        break
                    await asyncio.sleep(0.05)
            finally:
                await client.aclose()
        # ... then the batch's own group: its scores are the batch's rewards.
        async with worker(redis_url, namespace):
            rewards = await agg.collect("g", timeout_s=20)
    assert rewards.scores == [1.0] * 20


def test_keys_hold_results_per_group() -> None:
    keys = Keys("ns")
    assert keys.results("b", 0, "scorers") != keys.results("b", 0, "judges")
    assert keys.done("b", 0, "scorers") != keys.done("b", 0, "judges")


# ------------------------------------------------------------------ 9. input


async def test_null_response_fails_as_bad_input_naming_the_field(redis_url: str, namespace: str) -> None:
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
        worker(redis_url, namespace),
    ):
        await producer.open_batch("n", 2, WIDTH)
        await producer.push(Trajectory("n", 0, "test", response=None, ground_truth="a"))  # type: ignore[arg-type]
        await producer.push(Trajectory("n", 1, "test", response="a", ground_truth="a"))
        rewards = await agg.collect("n", timeout_s=20)
    assert rewards.status == ["failed", "ok"]
    assert rewards.results[0].reason == "bad_input"
    assert "response" in (rewards.errors[0] or "")


def test_non_string_response_is_bad_input() -> None:
    from stream_reward.errors import CodecError

    for bad in (None, 5, ["a"]):
        payload = msgpack.packb({"v": PROTOCOL_VERSION, "u": "u", "b": "b", "i": 0, "ds": "x", "r": bad})
        with pytest.raises(CodecError, match="'response'") as info:
            decode_trajectory(payload)
        assert info.value.reason == "bad_input"
    missing = msgpack.packb({"v": PROTOCOL_VERSION, "u": "u", "b": "b", "i": 0, "ds": "x"})
    with pytest.raises(CodecError, match="'response'"):
        decode_trajectory(missing)
    assert decode_trajectory(encode_trajectory(Trajectory("b", 0, "x", response=""))).response == ""


def test_jsonl_null_response_is_a_bad_line() -> None:
    from stream_reward.wire.trajectory import trajectory_from_json

    with pytest.raises(ValueError, match="'response'"):
        trajectory_from_json({"data_source": "x", "response": None}, "b", 0)


def test_rule_scorers_compare_numeric_ground_truth_as_its_string_form() -> None:
    from stream_reward.errors import ScoringError
    from stream_reward.scoring.rules import compute_score

    assert compute_score("openai/gsm8k", "so #### 72", 72) == 1.0
    assert compute_score("openai/gsm8k", "so #### 72", 72.0) == 1.0
    assert compute_score("openai/gsm8k", "so #### 71", 72) == 0.0
    assert compute_score("lighteval/MATH", "\\boxed{5}", 5) == 1.0
    assert compute_score("math_dapo", "Answer: 5", 5)["score"] == 1.0
    for bad in (None, ["72"], {"a": 1}, True):
        with pytest.raises(ScoringError, match="ground_truth") as info:
            compute_score("openai/gsm8k", "so #### 72", bad)
        assert info.value.reason == "bad_ground_truth"


# ------------------------------------------------------------------ 5. protocol version


async def test_a_result_of_another_version_fails_its_sample_not_the_batch(redis_url: str, namespace: str) -> None:
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await producer.open_batch("v", 3, WIDTH)
        client = connect(redis_url)
        try:
            ledger = LedgerWriter(client, Keys(namespace), "scorers", result_ttl_s=60)
            old = msgpack.packb([PROTOCOL_VERSION - 1, "v/0", "v", 0, 1.0, "ok", 1, 0.0, None, None, None, 3])
            items = [LedgerItem("", "v", "v/0", old)]
            items += [LedgerItem("", "v", f"v/{i}", encode_result(ScoreResult(f"v/{i}", "v", i, 1.0))) for i in (1, 2)]
            await ledger.write(0, items)
        finally:
            await client.aclose()
        rewards = await agg.collect("v", timeout_s=10)
    assert rewards.status == ["failed", "ok", "ok"]
    assert rewards.results[0].reason == "schema_version"
    assert rewards.results[0].uid == "v/0"


def test_every_record_carries_the_one_protocol_version() -> None:
    from stream_reward.wire import codec

    traj = msgpack.unpackb(encode_trajectory(Trajectory("b", 0, "x", response="r")))
    assert traj["v"] == PROTOCOL_VERSION
    assert msgpack.unpackb(encode_result(ScoreResult("u", "b", 0, 1.0)))[0] == PROTOCOL_VERSION
    assert PROTOCOL_VERSION >= 2  # bumped when results became positional arrays
    assert codec.SCHEMA_VERSION == PROTOCOL_VERSION


@pytest.mark.parametrize("processes", ["1", "2"])
async def test_a_worker_of_another_protocol_version_refuses_to_join(
    redis_url: str, namespace: str, processes: str
) -> None:
    client = connect(redis_url)
    try:
        await client.hset(Keys(namespace).namespace_info(), mapping={"protocol": PROTOCOL_VERSION + 1, "epoch": "e"})
    finally:
        await client.aclose()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "workers",
        "--redis",
        redis_url,
        "--namespace",
        namespace,
        "--processes",
        processes,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:  # a supervisor restarting refused children forever
            proc.terminate()
            await proc.wait()
    assert proc.returncode == 2
    assert b"protocol" in err and b"Traceback" not in err
    with pytest.raises(Exception, match="protocol"):
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
            await producer.open_batch("z", 1, WIDTH)


# ------------------------------------------------------------------ 6. state loss


async def test_collect_raises_state_lost_when_the_namespace_vanishes(redis_url: str, namespace: str) -> None:
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await producer.open_batch("s", 2, WIDTH)
        collecting = asyncio.create_task(agg.collect("s", timeout_s=None))
        await asyncio.sleep(0.5)
        client = connect(redis_url)
        try:
            keys = await client.keys(f"{{{namespace}}}*")
            await client.delete(*keys)  # what a restart without persistence leaves of this namespace
        finally:
            await client.aclose()
        with pytest.raises(StateLostError, match="'s'"):
            await asyncio.wait_for(collecting, 5)
        with pytest.raises(StateLostError):
            await agg.collect("s", timeout_s=1)


async def test_producer_and_worker_notice_a_lost_state_and_carry_on(redis_url: str, namespace: str) -> None:
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await producer.open_batch("before", 2, WIDTH)
        await producer.push_many(samples("before", ["a"]))
        await agg.meta("before")  # the aggregator saw the old epoch
        client = connect(redis_url)
        try:
            await client.delete(*await client.keys(f"{{{namespace}}}*"))
        finally:
            await client.aclose()
        with pytest.raises(StateLostError, match="'before'") as info:
            await producer.open_batch("after", 1, WIDTH)
        assert info.value.batches == ["before"]
        # The next batch works: the producer made its stream and group again.
        await producer.open_batch("after", 1, WIDTH)
        await producer.push_many(samples("after", ["a"]))
        async with worker(redis_url, namespace):
            assert (await agg.collect("after", timeout_s=20)).scores == [1.0]


async def test_expired_and_never_opened_are_told_apart(redis_url: str, namespace: str) -> None:
    from stream_reward.errors import ConfigError

    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace, collected_ttl_s=1) as agg,
        worker(redis_url, namespace),
    ):
        await producer.open_batch("e", 1, WIDTH)
        await producer.push_many(samples("e", ["a"]))
        await agg.collect("e", timeout_s=20)
        await asyncio.sleep(1.5)
        with pytest.raises(ConfigError, match="expired"):
            await agg.collect("e", timeout_s=1)
        with pytest.raises(ConfigError, match="never opened"):
            await agg.collect("nope", timeout_s=1)


# ------------------------------------------------------------------ 8. reasons


async def test_http_success_after_retries_reports_its_attempts() -> None:
    from stream_reward.bench.verifier_server import VerifierServer
    from stream_reward.config import ManagerConfig
    from stream_reward.scoring.http.verifiers import build_http_scorer

    async with VerifierServer(fail_5xx_rate=0.5, seed=3) as srv:
        config = ManagerConfig(
            scorer=f"http:{srv.url}", retries=20, reward_kwargs={"backoff_base_s": 0.001, "backoff_max_s": 0.002}
        )
        s = build_http_scorer(config.scorer, config)
        results = await asyncio.gather(
            *(s.score(Trajectory("b", i, "test", response="1", ground_truth="1")) for i in range(20))
        )
        await s.aclose()
    assert s.stats["retries"] > 0
    assert sum(r.attempts for r in results) == 20 + s.stats["retries"]


async def test_missing_samples_say_never_pushed_or_deadline_with_their_uid(redis_url: str, namespace: str) -> None:
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await producer.open_batch("m", 3, WIDTH)
        # Index 0 and 1 pushed (nobody scores them), index 2 never pushed.
        await producer.push(Trajectory("m", 0, "test", response="a", uid="pushed-0", valid_response_length=3))
        await producer.push(Trajectory("m", 1, "test", response="a", uid="pushed-1", valid_response_length=2))
        rewards = await agg.collect("m", timeout_s=0.5, on_timeout="resolve")
    first, second, third = rewards.results
    assert (first.reason, first.valid_response_length, first.uid) == ("timeout", 3, "pushed-0")
    assert (second.reason, second.uid) == ("timeout", "pushed-1")
    assert "pushed as uid 'pushed-1'" in (second.error or "")
    assert third.reason == "never_pushed" and third.uid == ""
    assert "never pushed" in (third.error or "")
