"""The layers the managers stack around a scorer: a precomputed ``rm_score`` used instead
of a call; DAPO's overlong penalty (verl's formula, validated only when enabled, with
``max_resp_len`` from the config or the trajectory); micro-batching (flush on size and
on wait, a failed call fails every sample in it); the quota of ``rate_limited``, global
across worker processes (in flight, RPM, the shared 429 pause, a retry budget) and never
taken twice; and a scorer's failure reason kept through every wrapper."""

from __future__ import annotations

import asyncio
import json

import pytest
from helpers import score_batch, wait_for_workers

from stream_reward import Trajectory
from stream_reward.config import ManagerConfig, OverlongConfig, QuotaConfig
from stream_reward.errors import BadReplyError, ConfigError, ScorerTimeoutError, ScoringError
from stream_reward.scoring.http.verifiers import HttpScorer
from stream_reward.scoring.layers import (
    MicroBatchScorer,
    OverlongShaping,
    PrecomputedScore,
    RateLimitedScorer,
    overlong_penalty,
)
from stream_reward.scoring.quota import QuotaLimiter
from stream_reward.scoring.registry import build_scorer
from stream_reward.scoring.scorer import Scored
from stream_reward.worker.main import main as worker_main

pytestmark = pytest.mark.anyio

SCORERS = "tests/data/scorers.py"
FAST = ["--block-ms", "50", "--log-level", "ERROR"]


def kwargs(**options: object) -> list[str]:
    return ["--manager-kwargs", json.dumps(options)]


async def _quota_state(redis_url: str, namespace: str, name: str, **limits: object) -> dict:
    limiter = QuotaLimiter(redis_url, QuotaConfig(name=name, **limits), namespace=namespace)
    try:
        return await limiter.state()
    finally:
        await limiter.aclose()


# ---------------------------------------------------------------------- precomputed scores
async def test_precomputed_rm_score_is_used_without_calling_the_scorer(redis_url, namespace, spawn_workers):
    # the scorer would kill its process on "crash": it must not be called for rm_score samples
    spawn_workers(1, "--scorer", f"{SCORERS}:slow_or_hang", "--num-processes", "1", *FAST)
    trajs = [
        Trajectory("pre", 0, "x", response="crash", valid_response_length=2, rm_score=0.25),
        Trajectory("pre", 1, "x", response="fine", valid_response_length=3),
    ]
    rewards = await score_batch(redis_url, namespace, trajs)
    assert rewards.status == ["ok", "ok"]
    assert rewards.scores == [0.25, 1.0]


# ---------------------------------------------------------------------- overlong shaping (dapo)
def test_overlong_penalty_matches_verl_formula():
    # max_resp_len 8, buffer 4: no penalty up to 4 tokens, then -0.25 per token (factor 1)
    assert [overlong_penalty(n, 8, 4, 1.0) for n in (0, 4, 5, 6, 8, 10)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.5]
    assert overlong_penalty(6, 8, 4, 0.5) == -0.25
    value = overlong_penalty(4, 8, 4, 0.0)
    assert type(value) is float and str(value) == "0.0"  # a plain float, never -0.0 or a tensor


@pytest.mark.parametrize(
    ("cfg", "max_resp_len", "key"),
    [
        ({"enable": True, "len": 0}, 8, "overlong_buffer_cfg.len"),
        ({"enable": True, "len": -2}, 8, "overlong_buffer_cfg.len"),
        ({"enable": True, "len": 16}, 8, "max_resp_len"),
        ({"enable": True, "len": 4, "penalty_factor": -1}, 8, "overlong_buffer_cfg.penalty_factor"),
        ({"enable": True, "len": 4, "lenght": 2}, 8, "overlong_buffer_cfg.lenght"),
    ],
)
def test_overlong_config_is_validated_when_enabled(cfg, max_resp_len, key):
    with pytest.raises(ConfigError) as info:
        build_scorer(ManagerConfig(manager="dapo", overlong_buffer_cfg=cfg, max_resp_len=max_resp_len))
    assert info.value.key == key


def test_overlong_config_is_not_validated_when_disabled():
    assert OverlongConfig.from_config({"enable": False, "len": 0}, 1) == OverlongConfig()
    assert OverlongConfig.from_config(None, None) == OverlongConfig()
    build_scorer(ManagerConfig(manager="dapo", overlong_buffer_cfg={"enable": False, "len": -5}, max_resp_len=1))


def test_bad_manager_option_makes_the_worker_exit_with_the_key_named(capfd):
    code = worker_main(
        [
            "--redis",
            "unix:///nonexistent",
            "--manager",
            "dapo",
            "--log-level",
            "ERROR",
            "--manager-kwargs",
            json.dumps({"overlong_buffer_cfg": {"enable": True, "len": 0}, "max_resp_len": 8}),
        ]
    )
    assert code == 2
    assert "overlong_buffer_cfg.len" in capfd.readouterr().err


async def test_dapo_penalty_per_sample_on_the_worker(redis_url, namespace, spawn_workers):
    overlong = {"enable": True, "len": 4, "penalty_factor": 1.0, "log": True}
    spawn_workers(
        1,
        "--manager",
        "dapo",
        "--scorer",
        f"{SCORERS}:prefix_match",
        "--num-processes",
        "2",
        *kwargs(overlong_buffer_cfg=overlong, max_resp_len=8),
        *FAST,
    )
    lengths = [2, 4, 5, 6, 8, 10, 7]
    trajs = [
        Trajectory("d1", i, "float", response="ab", ground_truth="ab", valid_response_length=n)
        for i, n in enumerate(lengths)
    ]
    # a dict result (its "acc" kept, not overwritten) and a precomputed score: both shaped
    trajs[6] = Trajectory("d1", 6, "dict", response="ab", ground_truth="abcd", valid_response_length=7)
    trajs.append(Trajectory("d1", 7, "float", response="ignored", valid_response_length=6, rm_score=0.75))
    rewards = await score_batch(redis_url, namespace, trajs, width=12)
    assert rewards.status == ["ok"] * 8
    penalties = [0.0, 0.0, -0.25, -0.5, -1.0, -1.5, -0.75, -0.5]
    task = [1.0] * 6 + [0.5, 0.75]
    assert rewards.scores == [t + p for t, p in zip(task, penalties)]
    info = rewards.reward_extra_info
    assert info["overlong_reward"] == penalties
    assert info["overlong"] == [p < 0 for p in penalties]
    assert all(type(v) is float for v in info["overlong_reward"])
    # verl logs a bare-number result as "acc"; a dict result keeps its own keys
    assert info["acc"] == [1.0] * 6 + [False, 0.75]
    assert info["pred"] == [None] * 6 + ["ab", None]


async def test_dapo_takes_max_resp_len_from_the_trajectory_and_fails_clearly_without_it(
    redis_url, namespace, spawn_workers
):
    spawn_workers(
        1, "--manager", "dapo", *kwargs(overlong_buffer_cfg={"enable": True, "len": 2, "penalty_factor": 0.5}), *FAST
    )
    right = "The answer is #### 7"
    trajs = [
        Trajectory(
            "d2", 0, "openai/gsm8k", response=right, ground_truth="7", valid_response_length=5, max_response_length=4
        ),
        Trajectory(
            "d2", 1, "openai/gsm8k", response=right, ground_truth="7", valid_response_length=2, max_response_length=4
        ),
        Trajectory("d2", 2, "openai/gsm8k", response=right, ground_truth="7", valid_response_length=2),
        Trajectory("d2", 3, "openai/gsm8k", response=right, ground_truth="7"),
    ]
    rewards = await score_batch(redis_url, namespace, trajs)
    assert rewards.status == ["ok", "ok", "failed", "failed"]
    assert rewards.scores[:2] == [1.0 - 0.75, 1.0]
    assert [r.reason for r in rewards.results[2:]] == ["config", "no_response_length"]
    assert "overlong_reward" not in rewards.reward_extra_info  # log is off


# ---------------------------------------------------------------------- micro-batching (batch)
async def test_micro_batcher_flushes_on_size_and_on_wait():
    calls: list[int] = []

    async def call(trajs):
        calls.append(len(trajs))
        return [Scored(float(t.index)) for t in trajs]

    batcher = MicroBatchScorer(call, batch_size=3, batch_wait_s=0.05)
    trajs = [Trajectory("m", i, "x") for i in range(5)]
    results = await asyncio.gather(*(batcher.score(t) for t in trajs))
    assert [r.score for r in results] == [0, 1, 2, 3, 4]
    assert calls == [3, 2]  # three at once, the last two after the wait
    await batcher.aclose()


async def test_micro_batcher_failure_of_the_call_fails_every_sample_in_it():
    async def broken(trajs):
        raise ScorerTimeoutError("killed")

    async def short(trajs):
        return [Scored(1.0)]

    for call, error in ((broken, ScorerTimeoutError), (short, BadReplyError)):
        batcher = MicroBatchScorer(call, batch_size=2, batch_wait_s=0.01)
        results = await asyncio.gather(
            *(batcher.score(Trajectory("m", i, "x")) for i in range(2)), return_exceptions=True
        )
        assert all(isinstance(r, error) for r in results)


def test_batch_manager_needs_a_batched_function():
    with pytest.raises(ConfigError) as info:
        build_scorer(ManagerConfig(manager="batch"))
    assert info.value.key == "scorer"
    with pytest.raises(ConfigError):
        build_scorer(ManagerConfig(manager="batch", batch_size=0, scorer=f"{SCORERS}:batched"))


async def test_batch_manager_scores_one_call_per_micro_batch_in_a_process(redis_url, namespace, spawn_workers):
    spawn_workers(
        1,
        "--manager",
        "batch",
        "--scorer",
        f"{SCORERS}:batched_mixed",
        "--reward-kwargs",
        '{"tag": "k"}',
        *kwargs(batch_size=4, batch_wait_ms=200),
        *FAST,
    )
    rows = [
        ("dict", "42", "42"),
        ("float", "1", "12"),
        ("dict", "x", "y"),
        ("float", "", ""),
        ("dict", "ab", "ab"),
        ("float", "z", "z"),
    ]
    trajs = [
        Trajectory("bt", i, ds, response=r, ground_truth=g, valid_response_length=max(len(r), 1))
        for i, (ds, r, g) in enumerate(rows)
    ]
    trajs.append(Trajectory("bt", 6, "dict", response="never scored", valid_response_length=1, rm_score=-1.0))
    rewards = await score_batch(redis_url, namespace, trajs)
    assert rewards.status == ["ok"] * 7
    assert rewards.scores == [1.0, 0.5, 0.0, 1.0, 1.0, 1.0, -1.0]
    info = rewards.reward_extra_info
    # 6 samples to score, batch_size 4: one call of 4, then one of 2 after the wait
    assert info["batch_len"] == [4, None, 4, None, 2, None, None]
    assert info["tag"] == ["k", None, "k", None, "k", None, None]


async def test_batch_manager_async_batched_function(redis_url, namespace, spawn_workers):
    spawn_workers(
        1, "--manager", "batch", "--scorer", f"{SCORERS}:async_batched", *kwargs(batch_size=3, batch_wait_ms=50), *FAST
    )
    trajs = [Trajectory("ba", i, "x", response=str(i % 2), ground_truth="1", valid_response_length=1) for i in range(3)]
    rewards = await score_batch(redis_url, namespace, trajs)
    assert rewards.scores == [0.0, 1.0, 0.0]
    assert rewards.reward_extra_info["batch_len"] == [3, 3, 3]


# ---------------------------------------------------------------------- the quota (rate_limited)
async def test_rate_limited_in_flight_limit_is_global_across_worker_processes(redis_url, namespace, spawn_workers):
    spawn_workers(
        2,
        "--manager",
        "rate_limited",
        "--scorer",
        f"{SCORERS}:timed",
        "--concurrency",
        "2",
        "--quota-key",
        "judge",
        *kwargs(max_concurrent=1),
        *FAST,
    )
    await wait_for_workers(redis_url, namespace, 2)
    trajs = [Trajectory("rl1", i, "x", extra_info={"sleep_s": 0.08}, valid_response_length=1) for i in range(8)]
    rewards = await score_batch(redis_url, namespace, trajs)
    assert rewards.status == ["ok"] * 8
    spans = sorted(zip(rewards.reward_extra_info["start"], rewards.reward_extra_info["end"]))
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert start >= end - 0.005, "two calls were in flight at once"
    assert len(set(rewards.reward_extra_info["pid"])) == 2  # both processes took part


async def test_rate_limited_rpm_spaces_requests_across_processes(redis_url, namespace, spawn_workers):
    spawn_workers(
        2, "--manager", "rate_limited", "--scorer", f"{SCORERS}:timed", "--max-rpm", "600", "--quota-key", "rpm", *FAST
    )
    n = 6
    trajs = [Trajectory("rl2", i, "x", extra_info={"sleep_s": 0.0}, valid_response_length=1) for i in range(n)]
    rewards = await score_batch(redis_url, namespace, trajs)
    assert rewards.status == ["ok"] * n
    starts = sorted(rewards.reward_extra_info["start"])
    # 600 RPM = one request per 100 ms, burst 1: n requests span at least (n - 1) * 100 ms
    assert starts[-1] - starts[0] >= (n - 1) * 0.1 - 0.03
    state = await _quota_state(redis_url, namespace, "rpm", max_rpm=600)
    assert state["requests"] == n


async def test_rate_limited_retries_a_429_and_pauses_every_worker(redis_url, namespace, spawn_workers, tmp_path):
    spawn_workers(
        1,
        "--manager",
        "rate_limited",
        "--scorer",
        f"{SCORERS}:rate_limited_then_ok",
        "--quota-key",
        "r429",
        "--max-rpm",
        "6000",
        *FAST,
    )
    marker = tmp_path / "attempts"
    trajs = [Trajectory("rl3", 0, "x", extra_info={"marker": str(marker), "fail_times": 3}, valid_response_length=1)]
    rewards = await score_batch(redis_url, namespace, trajs)
    assert rewards.status == ["ok"]
    assert rewards.reward_extra_info["attempts_seen"] == [3]
    state = await _quota_state(redis_url, namespace, "r429", max_rpm=6000)
    assert state["http_429"] == 2 and state["requests"] == 3


async def test_rate_limited_gives_up_after_the_retry_budget(redis_url, namespace, spawn_workers, tmp_path):
    spawn_workers(
        1, "--manager", "rate_limited", "--scorer", f"{SCORERS}:rate_limited_then_ok", "--retries", "1", *FAST
    )
    trajs = [
        Trajectory("rl4", 0, "x", extra_info={"marker": str(tmp_path / "m"), "fail_times": 10}, valid_response_length=1)
    ]
    rewards = await score_batch(redis_url, namespace, trajs)
    assert rewards.status == ["failed"]
    assert rewards.results[0].reason == "http_429" or rewards.results[0].reason == "retry_later"
    assert rewards.results[0].attempts == 2


def test_rate_limited_options_are_validated():
    with pytest.raises(ConfigError) as info:
        build_scorer(ManagerConfig(manager="rate_limited", max_rpm=0))
    assert info.value.key == "max_rpm"
    with pytest.raises(ConfigError) as info:
        build_scorer(ManagerConfig(manager="rate_limited", max_concurrent=0))
    assert info.value.key == "max_concurrent"


def test_rate_limited_does_not_add_a_second_lease_to_verifiers_that_take_their_own(redis_url):
    scorer = build_scorer(
        ManagerConfig(manager="rate_limited", scorer="http:http://127.0.0.1:9/score", redis_url=redis_url, max_rpm=60)
    )
    assert isinstance(scorer.inner, HttpScorer)
    scorer = build_scorer(
        ManagerConfig(manager="rate_limited", scorer=f"{SCORERS}:async_exact", redis_url=redis_url, max_rpm=60)
    )
    assert isinstance(scorer.inner, RateLimitedScorer)


# ---------------------------------------------------------------------- wrappers
async def test_scoring_error_reasons_survive_wrappers():
    class Failing:
        inline = True

        async def score(self, traj):
            raise ScoringError("nope", reason="custom")

    scorer = OverlongShaping(PrecomputedScore(Failing()), OverlongConfig(), None)
    assert scorer.inline
    with pytest.raises(ScoringError) as info:
        await scorer.score(Trajectory("b", 0, "x"))
    assert info.value.reason == "custom"
