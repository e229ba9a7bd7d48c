"""Composite rewards: ``[[reward.components]]`` as one scorer. The weighted sum and the
per-component columns (the same keys on every sample); a hung component is ``timeout``
and a broken one ``failed`` — the sample fails when it was required, and is the sum of
the rest when it was not, and a failed sample still carries every column, through a
worker and ``collect`` (``cancelled`` where a component was cut short); ``skip_unless``
makes no call at all; independent components run at once; a component's quota holds
across worker processes; a bad entry is one line naming it; and ``stream-reward score
--config`` shows the columns."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from helpers import running_worker, score_batch, stream_reward_cli

from stream_reward import Trajectory
from stream_reward.bench.verifier_server import VerifierServer
from stream_reward.config import BatchPolicy, ManagerConfig, ProducerConfig
from stream_reward.errors import ConfigError, ScoringError
from stream_reward.ops.settings import load_settings
from stream_reward.scoring.composite import CompositeScorer
from stream_reward.scoring.registry import build_scorer
from stream_reward.trainer.aggregator import RewardAggregator
from stream_reward.trainer.producer import RolloutProducer
from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys

pytestmark = pytest.mark.anyio

DATA = str(Path(__file__).resolve().parent.parent / "data" / "composite_scorers.py")
FORMAT = {"name": "format", "scorer": f"{DATA}:format_ok", "weight": 0.2}
CORRECT = {"name": "correct", "scorer": "rules"}
GOOD = "<answer>so the answer is #### 72"


def traj(index: int = 0, response: str = GOOD) -> Trajectory:
    return Trajectory("b", index, "openai/gsm8k", response=response, ground_truth="72", uid=f"u{index}")


def judge(url: str, **options: Any) -> dict[str, Any]:
    return {"name": "judge", "scorer": f"http:{url}", "weight": 0.5, "retries": 0, **options}


def composite(*components: dict[str, Any], **config: Any) -> Any:
    return build_scorer(ManagerConfig(components=list(components), **config))


async def scored_by(components: list[dict[str, Any]], *trajs: Trajectory) -> list[Any]:
    scorer = composite(*components)
    try:
        return [await scorer.score(t) for t in trajs]
    finally:
        await scorer.aclose()


# ---------------------------------------------------------------------- the sum and its columns
async def test_score_is_the_weighted_sum_with_each_components_columns() -> None:
    async with VerifierServer(rule="rules") as srv:
        (scored,) = await scored_by([FORMAT, CORRECT, judge(srv.url)], traj())
    assert scored.score == pytest.approx(0.2 * 1.0 + 1.0 + 0.5 * 1.0)
    extra = scored.extra
    assert {k: extra[k] for k in ("format", "correct", "judge")} == {"format": 1.0, "correct": 1.0, "judge": 1.0}
    assert {extra[f"{n}_status"] for n in ("format", "correct", "judge")} == {"ok"}
    assert all(extra[f"{n}_latency_ms"] >= 0 for n in ("format", "correct", "judge"))
    assert extra["format/tags"] == 1 and extra["judge/verifier"] == "reference"  # their own keys, prefixed


async def test_every_sample_carries_the_same_keys() -> None:
    async with VerifierServer(rule="rules") as srv:
        first, wrong_format = await scored_by(
            [FORMAT, CORRECT, judge(srv.url, skip_unless="format")], traj(0), traj(1, "#### 72")
        )
    assert set(first.extra) == set(wrong_format.extra)
    assert wrong_format.extra["judge/verifier"] is None  # filled explicitly: the judge did not run


# ---------------------------------------------------------------------- failures
async def test_keys_that_come_from_the_data_do_not_pile_up_on_every_sample() -> None:
    cases = {"name": "cases", "scorer": f"{DATA}:key_per_sample"}
    scored = await scored_by([cases], *(traj(i, f"r{i}") for i in range(300)))
    widest = max(len(s.extra) for s in scored)
    assert widest <= 3 + 64 + 1, widest  # its 3 columns, the keys carried (bounded), the sample's own
    assert scored[-1].extra["cases/case_r299"] == 1  # a sample's own key is never lost


async def test_hung_required_judge_fails_the_sample_naming_it() -> None:
    async with VerifierServer(timeout_rate=1.0, hang_s=30) as srv:
        with pytest.raises(ScoringError) as info:
            await scored_by([FORMAT, CORRECT, judge(srv.url, timeout_s=0.3)], traj())
    assert info.value.reason == "judge:timeout"
    assert "'judge' timed out" in str(info.value)


async def test_hung_optional_judge_is_dropped_from_the_sum() -> None:
    async with VerifierServer(timeout_rate=1.0, hang_s=30) as srv:
        (scored,) = await scored_by([FORMAT, CORRECT, judge(srv.url, timeout_s=0.3, required=False)], traj())
    assert scored.score == pytest.approx(0.2 + 1.0)
    assert scored.extra["judge_status"] == "timeout" and scored.extra["judge"] is None


async def test_failing_required_component_fails_the_sample() -> None:
    broken = {"name": "backend", "scorer": f"{DATA}:broken"}
    with pytest.raises(ScoringError) as info:
        await scored_by([FORMAT, broken], traj())
    assert info.value.reason.startswith("backend:") and "'backend' failed" in str(info.value)


async def test_a_failed_required_component_cancels_the_others() -> None:
    broken = {"name": "backend", "scorer": f"{DATA}:broken"}
    async with VerifierServer(timeout_rate=1.0, hang_s=30) as srv:
        started = time.perf_counter()
        with pytest.raises(ScoringError):
            await scored_by([broken, judge(srv.url, timeout_s=20)], traj())
        took = time.perf_counter() - started
    assert took < 10, took  # not the judge's 20 s: its call was cancelled


async def test_a_failed_sample_carries_every_components_columns() -> None:
    async with VerifierServer(timeout_rate=1.0, hang_s=30) as srv:
        with pytest.raises(ScoringError) as info:
            await scored_by([FORMAT, CORRECT, judge(srv.url, timeout_s=0.3)], traj())
    extra = info.value.extra
    assert {k: extra[k] for k in ("format", "correct", "judge")} == {"format": 1.0, "correct": 1.0, "judge": None}
    assert [extra[f"{n}_status"] for n in ("format", "correct", "judge")] == ["ok", "ok", "timeout"]
    assert extra["judge_latency_ms"] >= 250 and extra["format/tags"] == 1


async def test_components_cancelled_by_a_required_failure_say_so() -> None:
    broken = {"name": "backend", "scorer": f"{DATA}:broken"}
    async with VerifierServer(timeout_rate=1.0, hang_s=30) as srv:
        with pytest.raises(ScoringError) as info:
            await scored_by([broken, judge(srv.url, timeout_s=20)], traj())
    extra = info.value.extra
    assert (extra["backend_status"], extra["backend"]) == ("failed", None)
    assert (extra["judge_status"], extra["judge"]) == ("cancelled", None)
    assert extra["judge_latency_ms"] >= 0


async def test_a_failed_sample_keeps_its_columns_through_a_worker_and_collect(redis_url: str, namespace: str) -> None:
    async with VerifierServer(rule="rules", timeout_rate=1.0, hang_s=30) as srv:
        scorer = composite(FORMAT, CORRECT, judge(srv.url, timeout_s=0.3, skip_unless="format"))
        try:
            async with running_worker(redis_url, namespace, scorer):
                rewards = await score_batch(redis_url, namespace, [traj(0), traj(1, "#### 72")])
        finally:
            await scorer.aclose()
    assert rewards.status == ["failed", "ok"] and rewards.results[0].reason == "judge:timeout"
    info = rewards.reward_extra_info
    columns = {f"{n}{s}" for n in ("format", "correct", "judge") for s in ("", "_status", "_latency_ms")}
    assert columns | {"format/tags"} <= set(info)
    assert info["judge_status"] == ["timeout", "skipped"]
    assert info["format"] == [1.0, 0.0] and info["correct"] == [1.0, 1.0]
    assert rewards.valid.tolist() == [False, True]  # failed stays failed: its 0 is not a reward


async def test_failing_optional_component_says_why() -> None:
    broken = {"name": "backend", "scorer": f"{DATA}:broken", "required": False}
    (scored,) = await scored_by([FORMAT, CORRECT, broken], traj())
    assert scored.score == pytest.approx(1.2)
    assert scored.extra["backend_status"] == "failed" and scored.extra["backend"] is None


# ---------------------------------------------------------------------- skip_unless
async def test_skipped_judge_makes_no_request() -> None:
    async with VerifierServer(rule="rules") as srv:
        components = [FORMAT, CORRECT, judge(srv.url, skip_unless="format")]
        (scored,) = await scored_by(components, traj(0, "#### 72"))
        assert srv.stats()["requests"] == 0
        await scored_by(components, traj(1))
        assert srv.stats()["requests"] == 1  # the count counts: a sample with the format is judged
    assert scored.extra["judge_status"] == "skipped" and scored.extra["judge"] == 0.0
    assert scored.score == pytest.approx(1.0)  # correct alone: format scored 0, the judge did not run


async def test_a_required_component_whose_gate_failed_fails_the_sample() -> None:
    gate = {"name": "gate", "scorer": f"{DATA}:broken", "required": False}
    with pytest.raises(ScoringError) as info:
        await scored_by([gate, CORRECT, {**FORMAT, "skip_unless": "gate"}], traj())
    assert info.value.reason == "format:gate_failed"
    assert "'format'" in str(info.value) and "'gate'" in str(info.value)


async def test_an_optional_component_whose_gate_failed_is_failed_not_skipped() -> None:
    gate = {"name": "gate", "scorer": f"{DATA}:broken", "required": False}
    (scored,) = await scored_by([gate, CORRECT, {**FORMAT, "skip_unless": "gate", "required": False}], traj())
    assert scored.extra["format_status"] == "failed" and scored.extra["format"] is None
    assert scored.score == pytest.approx(1.0)


async def test_a_component_that_scores_a_skipped_gate_is_skipped_too() -> None:
    chain = [
        FORMAT,
        {**CORRECT, "skip_unless": "format"},
        {"name": "last", "scorer": "rules", "skip_unless": "correct"},
    ]
    (scored,) = await scored_by(chain, traj(0, "#### 72"))
    assert (scored.extra["correct_status"], scored.extra["last_status"]) == ("skipped", "skipped")
    assert scored.score == 0.0


@pytest.mark.parametrize("response", ["nan", "inf"])
async def test_a_component_scoring_a_non_finite_number_fails_the_sample(response: str) -> None:
    with pytest.raises(ScoringError) as info:
        await scored_by([CORRECT, {"name": "odd", "scorer": f"{DATA}:not_finite"}], traj(0, response))
    assert info.value.reason == "odd:bad_score"


async def test_a_component_returning_a_dict_without_score_fails_the_sample() -> None:
    with pytest.raises(ScoringError) as info:
        await scored_by([CORRECT, {"name": "odd", "scorer": f"{DATA}:no_score"}], traj())
    assert info.value.reason == "odd:no_score"


async def test_a_weighted_sum_past_the_float_range_fails_the_sample_rather_than_score_inf() -> None:
    huge = [{"name": "a", "scorer": "rules", "weight": 1e308}, {"name": "b", "scorer": "rules", "weight": 1e308}]
    with pytest.raises(ScoringError) as info:
        await scored_by(huge, traj(0, "#### 72"))
    assert info.value.reason == "bad_score" and "not finite" in str(info.value)


async def test_under_dapo_the_overlong_penalty_applies_to_the_sum_and_a_failed_component_still_fails() -> None:
    overlong = {"enable": True, "len": 4, "penalty_factor": 1.0, "log": True}
    broken = {"name": "backend", "scorer": f"{DATA}:broken"}
    scorer = composite(FORMAT, CORRECT, manager="dapo", max_resp_len=10, overlong_buffer_cfg=overlong)
    failing = composite(CORRECT, broken, manager="dapo", max_resp_len=10, overlong_buffer_cfg=overlong)
    long = traj(0)
    long.valid_response_length = 8  # 2 tokens into the 4-token buffer: -0.5
    try:
        scored = await scorer.score(long)
        with pytest.raises(ScoringError, match="backend"):  # never the penalty alone as the reward
            await failing.score(long)
    finally:
        await scorer.aclose()
        await failing.aclose()
    assert scored.score == pytest.approx(0.2 + 1.0 - 0.5)
    assert scored.extra["overlong_reward"] == pytest.approx(-0.5) and scored.extra["overlong"] is True
    assert scored.extra["format_status"] == scored.extra["correct_status"] == "ok"


# ---------------------------------------------------------------------- concurrency
async def _rendezvous_server() -> tuple[web.AppRunner, str, list[str]]:
    """Two endpoints that answer only once both have a request in flight: components
    run one after another would never get past the first."""
    both = asyncio.Event()
    arrived: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        arrived.append(request.path)
        if len(arrived) == 2:
            both.set()
        await asyncio.wait_for(both.wait(), 10)
        return web.json_response({"score": 1.0})

    app = web.Application()
    app.router.add_post("/a", handle)
    app.router.add_post("/b", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}", arrived


async def test_independent_components_run_concurrently() -> None:
    runner, url, arrived = await _rendezvous_server()
    try:
        a = {"name": "a", "scorer": f"http:{url}/a", "timeout_s": 5, "retries": 0}
        b = {"name": "b", "scorer": f"http:{url}/b", "timeout_s": 5, "retries": 0}
        (scored,) = await scored_by([a, b], traj())
    finally:
        await runner.cleanup()
    assert sorted(arrived) == ["/a", "/b"]
    assert scored.score == 2.0 and scored.extra["a_status"] == scored.extra["b_status"] == "ok"


async def test_two_slow_components_take_the_slower_one_not_the_sum() -> None:
    async with VerifierServer(latency_ms_p50=500) as one, VerifierServer(latency_ms_p50=500) as two:
        a = {"name": "a", "scorer": f"http:{one.url}", "retries": 0}
        b = {"name": "b", "scorer": f"http:{two.url}", "retries": 0}
        scorer = composite(a, b)
        try:
            await scorer.score(traj())  # sessions opened
            started = time.perf_counter()
            await scorer.score(traj())
            took = time.perf_counter() - started
        finally:
            await scorer.aclose()
    assert took < 0.9, took


# ---------------------------------------------------------------------- quota across processes
async def test_component_quota_holds_across_two_worker_processes(
    redis_url: str, namespace: str, spawn_workers: Any, tmp_path: Path
) -> None:
    async with VerifierServer(rule="rules") as srv:
        config = tmp_path / "composite.toml"
        config.write_text(
            "[[reward.components]]\n"
            'name = "correct"\nscorer = "rules"\n'
            "[[reward.components]]\n"
            f'name = "judge"\nscorer = "http:{srv.url}"\n'
            "[reward.components.quota]\nmax_rpm = 120\n"  # one request each 0.5 s, whoever sends it
        )
        spawn_workers(2, "--config", str(config), "--block-ms", "50")
        await _wait_for_workers(redis_url, namespace, 2)
        trajs = [traj(i) for i in range(6)]
        for t in trajs:
            t.batch_id = "quota"
        producer_config = ProducerConfig(namespace=namespace, samples_per_entry=1)
        async with (
            RolloutProducer(redis_url, producer_config) as producer,
            RewardAggregator(redis_url, namespace=namespace) as agg,
        ):
            await producer.open_batch("quota", len(trajs), 8, policy=BatchPolicy())
            await producer.push_many(trajs)
            rewards = await agg.collect("quota", timeout_s=60)
        arrivals = sorted(entry[0] for entry in srv.stats(with_log=True)["log"])
    assert rewards.status == ["ok"] * 6
    assert len(arrivals) == 6
    # 0.5 s apart (unlimited, the six would land within a few ms), with slack for a late request
    assert arrivals[-1] - arrivals[0] >= 2.0, arrivals
    assert min(c - a for a, c in zip(arrivals, arrivals[2:])) > 0.7, arrivals
    assert rewards.reward_extra_info["judge_status"] == ["ok"] * 6


async def test_a_component_cancelled_while_holding_its_quota_lease_gives_it_back(
    redis_url: str, namespace: str
) -> None:
    quota = {"max_concurrent": 1, "quota_key": "judge-lease"}
    broken = {"name": "backend", "scorer": f"{DATA}:broken_later"}
    async with VerifierServer(timeout_rate=1.0, hang_s=30) as hung, VerifierServer(rule="rules") as fine:
        first = composite(broken, judge(hung.url, timeout_s=20, quota=quota), redis_url=redis_url, namespace=namespace)
        second = composite(judge(fine.url, quota=quota), redis_url=redis_url, namespace=namespace)
        try:
            with pytest.raises(ScoringError, match="backend"):
                await first.score(traj(0))  # the judge holds the one lease, in a hung request, when it is cancelled
            assert hung.stats()["requests"] == 1
            started = time.perf_counter()
            scored = await second.score(traj(1))
            took = time.perf_counter() - started
        finally:
            await first.aclose()
            await second.aclose()
    assert scored.extra["judge_status"] == "ok"
    assert took < 10, took  # not the lease's 60 s expiry


async def _wait_for_workers(redis_url: str, namespace: str, n: int, timeout_s: float = 30) -> None:
    client = connect(redis_url)
    try:
        deadline = time.monotonic() + timeout_s
        while await client.hlen(Keys(namespace).workers()) < n:
            assert time.monotonic() < deadline, "workers did not start"
            await asyncio.sleep(0.05)
    finally:
        await client.aclose()


# ---------------------------------------------------------------------- config errors
def _load(tmp_path: Path, toml: str) -> Any:
    path = tmp_path / "sr.toml"
    path.write_text(toml)
    return load_settings(path, env={})


def _entry(name: str, scorer: str = "rules", **keys: str) -> str:
    lines = [f'name = "{name}"', f'scorer = "{scorer}"', *(f"{k} = {v}" for k, v in keys.items())]
    return "[[reward.components]]\n" + "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        (_entry("format", "nonsense"), "reward.components.format.scorer"),
        (_entry("judge", skip_unless='"format"') + _entry("format"), "reward.components.judge.skip_unless"),
        (_entry("judge", skip_unless='"nobody"'), "reward.components.judge.skip_unless"),
        (_entry("format") + _entry("format"), "reward.components.format"),
        (_entry("format", weight='"heavy"'), "reward.components.format.weight"),
        (_entry("judge") + _entry("judge_status"), "reward.components.judge_status"),
        (_entry("format", colour='"red"'), "reward.components.format.colour"),
        (
            _entry("judge", "http:http://x") + "[reward.components.quota]\nmax_rpm = -1\n",
            "reward.components.judge.quota.max_rpm",
        ),
        ("[reward]\ncomponents = []\n", "reward.components"),
        (_entry("format", weight="nan"), "reward.components.format.weight"),
        (_entry("format", weight="inf"), "reward.components.format.weight"),
        (_entry("format", weight="true"), "reward.components.format.weight"),
        (_entry("format", required='"false"'), "reward.components.format.required"),
        (_entry("format", timeout_s="0"), "reward.components.format.timeout_s"),
        (_entry("format", timeout_s="-1"), "reward.components.format.timeout_s"),
        (_entry("format", skip_unless='"format"'), "reward.components.format.skip_unless"),
        (_entry("format") + _entry("format_status"), "reward.components.format_status"),
        (_entry("format_status") + _entry("format"), "reward.components.format"),
        (_entry("score"), "reward.components.score"),
        (_entry("overlong"), "reward.components.overlong"),
        (_entry("overlong_reward"), "reward.components.overlong_reward"),
        (
            _entry("judge", "http:http://x") + "[reward.components.quota]\nmax_rps = 5\n",
            "reward.components.judge.quota.max_rps",
        ),
        (
            _entry("judge", "http:http://x") + "[reward.components.quota]\nmax_concurrent = 1.5\n",
            "reward.components.judge.quota.max_concurrent",
        ),
    ],
)
def test_config_errors_are_one_line_naming_the_component(tmp_path: Path, toml: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, toml)
    assert info.value.key == key
    assert "\n" not in str(info.value)


def test_components_replace_the_scorer_and_the_global_quota(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, '[reward]\nscorer = "sandbox"\n' + _entry("format"))
    assert info.value.key == "reward.scorer"
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, "[quota]\nmax_rpm = 10\n" + _entry("format"))
    assert info.value.key == "quota.max_rpm"


def test_a_scorer_that_cannot_load_names_its_component_at_start(tmp_path: Path) -> None:
    settings = _load(tmp_path, _entry("correct") + _entry("judge", "missing_file.py:score"))
    with pytest.raises(ConfigError) as info:
        build_scorer(settings.manager_config())
    assert info.value.key == "reward.components.judge.scorer" and "\n" not in str(info.value)


def test_yaml_and_json_give_the_same_components(tmp_path: Path) -> None:
    entries = [{"name": "format", "scorer": "rules", "weight": 0.2}, {"name": "correct", "scorer": "rules"}]
    (tmp_path / "sr.json").write_text(json.dumps({"reward": {"components": entries}}))
    (tmp_path / "sr.yaml").write_text(
        "reward:\n  components:\n"
        "    - {name: format, scorer: rules, weight: 0.2}\n"
        "    - {name: correct, scorer: rules}\n"
    )
    for name in ("sr.json", "sr.yaml"):
        scorer = build_scorer(load_settings(tmp_path / name, env={}).manager_config())
        assert isinstance(scorer.inner, CompositeScorer)
        assert [(c.name, c.weight) for c, _ in scorer.inner.components] == [("format", 0.2), ("correct", 1.0)]


# ---------------------------------------------------------------------- the score command
def test_score_command_with_components_shows_their_columns(tmp_path: Path) -> None:
    config = tmp_path / "sr.toml"
    config.write_text(
        _entry("format", f"{DATA}:format_ok", weight="0.2")
        + _entry("correct", skip_unless='"format"')
        + _entry("backend", f"{DATA}:broken", required="false")
    )
    src = tmp_path / "in.jsonl"
    rows = [{"data_source": "openai/gsm8k", "response": r, "ground_truth": "72"} for r in (GOOD, "#### 72")]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    done, _ = stream_reward_cli(
        "score", str(src), "--config", str(config), "--out", str(out), "--processes", "1", "--timeout-s", "60"
    )
    assert done.returncode == 0, done.stderr
    good, bad = (json.loads(line) for line in out.read_text().splitlines())
    assert good["status"] == bad["status"] == "ok"
    assert good["score"] == pytest.approx(1.2) and bad["score"] == 0.0
    info = good["reward_extra_info"]
    assert info["format_status"] == "ok" and info["correct_status"] == "ok" and info["backend_status"] == "failed"
    assert info["format/tags"] == 1 and "correct_latency_ms" in info
    assert bad["reward_extra_info"]["correct_status"] == "skipped"


# ---------------------------------------------------------------------- through verl's reward loop
def test_verl_loop_options_carry_the_components_to_its_workers() -> None:
    import argparse

    from stream_reward.ops.worker_cli import add_worker_arguments, resolve_args
    from stream_reward.verl.options import LoopOptions

    entries = [FORMAT, CORRECT]
    options = LoopOptions.from_verl({"reward": {"reward_kwargs": {"components": entries}}})
    argv = ["--redis", "redis://127.0.0.1:9", *options.worker_args()]
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    settings = resolve_args(parser.parse_args(argv))
    scorer = build_scorer(settings.manager_config())
    assert [c.name for c, _ in scorer.inner.components] == ["format", "correct"]
