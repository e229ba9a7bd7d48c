"""The registry of reward managers and the ``--scorer`` spec factory: every verl manager
name is registered and a user's registers by decorator or loads by path; an unknown name
or a bad spec is a ``ConfigError`` naming its key; the remote and sandbox specs import
their modules only when asked; ``naive`` scores rules inline and ``async def`` functions
on the worker's loop under the timeout, merging dict and bare-float results."""

from __future__ import annotations

import sys
import time
import types

import pytest
from helpers import score_batch, wait_for_workers

from stream_reward import Trajectory
from stream_reward.config import ManagerConfig
from stream_reward.errors import ConfigError
from stream_reward.scoring.registry import build_scorer, function_scorer, manager_names, register_manager
from stream_reward.scoring.scorer import Scored

pytestmark = pytest.mark.anyio

SCORERS = "tests/data/scorers.py"
FAST = ["--block-ms", "50", "--log-level", "ERROR"]


# ---------------------------------------------------------------------- names
def test_every_verl_manager_name_is_registered():
    assert {"naive", "dapo", "batch", "prime", "rate_limited", "remote"} <= set(manager_names())


def test_unknown_manager_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError) as info:
        build_scorer(ManagerConfig(manager="fancy"))
    assert info.value.key == "manager" and "naive" in str(info.value)


async def test_user_manager_registers_by_decorator_and_loads_by_path():
    @register_manager("test-constant")
    def _constant(config: ManagerConfig):
        class Constant:
            inline = True

            async def score(self, traj):
                return Scored(float(config.reward_kwargs["value"]))

        return Constant()

    traj = Trajectory("b", 0, "x")
    scorer = build_scorer(ManagerConfig(manager="test-constant", reward_kwargs={"value": 3}))
    assert (await scorer.score(traj)).score == 3.0
    # by import path: a builder function ManagerConfig -> Scorer
    scorer = build_scorer(ManagerConfig(manager=f"{SCORERS}:exact_manager"))
    assert (await scorer.score(Trajectory("b", 0, "x", response="a", ground_truth="a"))).score == 1.0


# ---------------------------------------------------------------------- naive, through a worker
async def test_naive_mixed_dict_and_float_results_merge_extra_info(redis_url, namespace, spawn_workers):
    spawn_workers(1, "--scorer", f"{SCORERS}:prefix_match", "--num-processes", "2", *FAST)
    rows = [("dict", "42", "42"), ("float", "12", "1234"), ("dict", "ab", "abd"), ("float", "", "")]
    trajs = [
        Trajectory("n1", i, ds, response=r, ground_truth=g, valid_response_length=len(r))
        for i, (ds, r, g) in enumerate(rows)
    ]
    rewards = await score_batch(redis_url, namespace, trajs)
    assert rewards.status == ["ok"] * 4
    assert rewards.scores == [1.0, 0.5, 2 / 3, 1.0]
    # union of keys over the batch, None where a sample returned a bare float
    assert rewards.reward_extra_info == {"acc": [True, None, False, None], "pred": ["42", None, "ab", None]}
    # the zero-length response's score is reported but placed nowhere
    assert not rewards.rm_scores[3].any() and not rewards.valid[3]


async def test_naive_rules_inline_and_async_function_with_timeout(redis_url, namespace, spawn_workers):
    # 2 s: far above what the other samples take even beside CPU hogs, far below the hang.
    spawn_workers(1, "--scorer", f"{SCORERS}:async_exact", "--timeout-s", "2", "--reward-kwargs", '{"tag": "t"}', *FAST)
    trajs = [
        Trajectory("n2", 0, "x", response="a", ground_truth="a", valid_response_length=1),
        Trajectory("n2", 1, "x", response="hang", ground_truth="a", valid_response_length=1),
        Trajectory("n2", 2, "x", response="b", ground_truth="a", valid_response_length=1),
    ]
    await wait_for_workers(redis_url, namespace, 1)  # its start-up (imports) is not under test
    started = time.monotonic()
    rewards = await score_batch(redis_url, namespace, trajs)
    assert time.monotonic() - started < 5
    assert rewards.status == ["ok", "failed", "ok"]
    assert rewards.scores[0] == 1.0 and rewards.scores[2] == 0.0
    assert rewards.results[1].reason == "timeout"
    assert rewards.reward_extra_info["echo"] == ["t", None, "t"]


# ---------------------------------------------------------------------- spec dispatch
def _fake_scorer_modules(monkeypatch) -> dict[str, list]:
    seen: dict[str, list] = {"http": [], "sandbox": [], "fusion": []}

    http = types.ModuleType("stream_reward.scoring.http.verifiers")
    http.build_http_scorer = lambda spec, config: seen["http"].append((spec, config.timeout)) or "http-scorer"
    sandbox = types.ModuleType("stream_reward.scoring.sandbox.scorer")
    sandbox.SandboxConfig = lambda **kw: ("cfg", kw)
    sandbox.SandboxScorer = lambda cfg: seen["sandbox"].append(cfg) or "sandbox-scorer"
    fusion = types.ModuleType("stream_reward.scoring.sandbox.fusion")
    fusion.SandboxFusionScorer = lambda url: seen["fusion"].append(url) or "fusion-scorer"
    for module in (http, sandbox, fusion):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return seen


def test_remote_and_sandbox_specs_dispatch_lazily(monkeypatch):
    seen = _fake_scorer_modules(monkeypatch)
    for kind in ("http", "disrm", "genrm"):
        assert function_scorer(ManagerConfig(scorer=f"{kind}:http://rm:8000/v1", timeout=7)) == "http-scorer"
    assert seen["http"] == [(f"{k}:http://rm:8000/v1", 7) for k in ("http", "disrm", "genrm")]
    assert function_scorer(ManagerConfig(scorer="sandbox", sandbox={"timeout_s": 2})) == "sandbox-scorer"
    assert seen["sandbox"] == [("cfg", {"timeout_s": 2})]
    assert function_scorer(ManagerConfig(scorer="sandbox-fusion:http://sf:8080")) == "fusion-scorer"
    assert seen["fusion"] == ["http://sf:8080"]


def test_spec_errors_name_the_scorer_key(monkeypatch):
    _fake_scorer_modules(monkeypatch)
    for spec in ("http:", "sandbox-fusion:", "sandbox:extra"):
        with pytest.raises(ConfigError) as info:
            function_scorer(ManagerConfig(scorer=spec))
        assert info.value.key == "scorer"
    monkeypatch.setitem(sys.modules, "stream_reward.scoring.http.verifiers", None)  # not importable
    with pytest.raises(ConfigError, match="stream_reward.scoring.http.verifiers"):
        function_scorer(ManagerConfig(scorer="genrm:http://x"))


def test_prime_rejects_specs_that_are_not_python_functions(monkeypatch):
    _fake_scorer_modules(monkeypatch)
    with pytest.raises(ConfigError) as info:
        build_scorer(ManagerConfig(manager="prime", scorer="http:http://localhost:1/score"))
    assert info.value.key == "scorer"


def test_unknown_sandbox_limit_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        function_scorer(ManagerConfig(scorer="sandbox", sandbox={"no_such_limit": 1}))
    assert info.value.key == "sandbox"
