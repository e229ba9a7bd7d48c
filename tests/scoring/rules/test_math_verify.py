"""``--scorer math-verify``: math-verify's own verdict by verl's convention (the ground truth in
``\\boxed{}``, read as LaTeX; the response read as an expression or LaTeX), computed in the
scorer processes. An answer too costly to compare is the policy's loss (0.0, status ok,
``timeout`` in extra info) and costs only its own slot; a scorer process that dies, or
math-verify not installed, fails the sample."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import math_verify.metric as math_verify_metric  # the dev extra installs it: no skip hides a missing install
import pytest
from math_verify.errors import TimeoutException
from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

from stream_reward import Trajectory
from stream_reward.cli import main
from stream_reward.config import ManagerConfig
from stream_reward.errors import ConfigError, ScorerCrashedError, ScoringError
from stream_reward.scoring.registry import build_scorer

pytestmark = pytest.mark.anyio

TOWER = r"\boxed{9^{9^{9^{9^{9}}}}}"  # math-verify's comparison with 3 runs into its 5 s bound

_spec = importlib.util.spec_from_file_location("math_verify_cases", Path(__file__).with_name("math_verify_cases.py"))
assert _spec is not None and _spec.loader is not None
_cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_cases)
PAIRS = _cases.PAIRS  # (kind, response, ground truth)


def reference(response: str, ground_truth: str) -> float:
    """math-verify itself, called the way verl 0.9.1's math_verify.compute_score calls it."""
    metric = math_verify_metric.math_metric(
        gold_extraction_target=(LatexExtractionConfig(),),
        pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()),
    )
    try:
        score, _ = metric(["\\boxed{" + ground_truth + "}"], [response])
    except (Exception, TimeoutException):
        return 0.0
    return float(score)


def traj(i: int, response: str, ground_truth: Any) -> Trajectory:
    return Trajectory("mv", i, "math", response=response, ground_truth=ground_truth)


@pytest.fixture
async def math_scorer() -> AsyncIterator[Callable[..., Any]]:
    """``math_scorer(timeout=...)``: a ``--scorer math-verify`` scorer, two processes unless told, closed after the test."""
    made: list[Any] = []

    def make(**config: Any) -> Any:
        scorer = build_scorer(ManagerConfig(**{"scorer": "math-verify", "num_processes": 2, **config}))
        made.append(scorer)
        return scorer

    yield make
    for scorer in made:
        await scorer.aclose()


async def test_verdicts_equal_math_verify_by_verls_convention_on_the_answer_table(math_scorer):
    expected = [reference(response, truth) for _, response, truth in PAIRS]
    assert expected.count(1.0) >= 20 and expected.count(0.0) >= 20  # the table tells verdicts apart
    scorer = math_scorer()
    got = await asyncio.gather(*(scorer.score(traj(i, r, t)) for i, (_, r, t) in enumerate(PAIRS)))
    differ = [(kind, r, t, e, g.score) for (kind, r, t), e, g in zip(PAIRS, expected, got) if g.score != e]
    assert differ == []
    assert all(g.extra == {"timeout": False} for g in got)


async def test_a_tower_of_powers_is_killed_at_its_timeout_as_a_loss_and_its_neighbours_still_score(math_scorer):
    scorer = math_scorer(timeout=2.0)
    await asyncio.gather(*(scorer.score(traj(i, r"\boxed{1}", "1")) for i in range(2)))  # both processes up
    finished: dict[int, float] = {}
    started = time.monotonic()

    async def one(i: int, response: str, truth: str) -> Any:
        scored = await scorer.score(traj(i, response, truth))
        finished[i] = time.monotonic() - started
        return scored

    neighbours = [(r"\boxed{\frac12}", "0.5"), (r"\boxed{2\sqrt3}", r"\sqrt{12}"), (r"\boxed{4}", "5")] * 2
    results = await asyncio.gather(one(0, TOWER, "3"), *(one(i + 1, r, t) for i, (r, t) in enumerate(neighbours)))
    tower, rest = results[0], results[1:]
    assert (tower.score, tower.extra) == (0.0, {"timeout": True})
    assert 2.0 <= finished[0] < 2.0 + 10  # killed at its timeout, well before math-verify's own 5 s bound
    assert scorer.inner.kills == 1
    assert [r.score for r in rest] == [1.0, 1.0, 0.0] * 2 and all(r.extra == {"timeout": False} for r in rest)
    assert max(finished[i] for i in range(1, 7)) < finished[0]  # the other process scored them meanwhile
    again = await scorer.score(traj(9, r"\boxed{\pi}", r"\pi"))  # the killed process was replaced
    assert (again.score, again.extra) == (1.0, {"timeout": False})


def test_math_verifys_own_bound_on_a_costly_answer_is_reported_as_a_timeout():
    from stream_reward.scoring.rules.math_verify import compute_score

    assert compute_score("math", TOWER, "3") == {"score": 0.0, "timeout": True}
    assert compute_score("math", r"\boxed{3}", 3) == {"score": 1.0, "timeout": False}  # a number compares as text


def test_off_the_main_thread_it_refuses_instead_of_scoring_zero():
    from stream_reward.scoring.rules.math_verify import compute_score

    errors: list[BaseException] = []

    def call() -> None:
        try:
            compute_score("math", r"\boxed{1}", "1")
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "main thread" in str(errors[0])


async def test_without_math_verify_installed_the_sample_fails_naming_the_extra(math_scorer, tmp_path, monkeypatch):
    stub = tmp_path / "math_verify"
    stub.mkdir()
    (stub / "__init__.py").write_text("raise ImportError(\"No module named 'math_verify'\")\n")
    # The scorer processes inherit the environment: this package shadows the installed one there.
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    scorer = math_scorer()
    with pytest.raises(ScoringError) as caught:
        await scorer.score(traj(0, r"\boxed{1}", "1"))
    message = str(caught.value)
    assert "pip install 'stream-reward[math]'" in message and "\n" not in message


async def test_a_scorer_process_that_dies_mid_call_fails_the_sample(math_scorer):
    scorer = math_scorer(timeout=60.0)
    pool = scorer.inner
    await scorer.score(traj(0, r"\boxed{1}", "1"))  # one process up, idle
    (child,) = pool._all
    call = asyncio.ensure_future(scorer.score(traj(1, TOWER, "3")))
    await asyncio.sleep(0)  # the call takes the idle process and sends it the sample: seconds of work
    assert not pool._idle
    child.kill()
    with pytest.raises(ScorerCrashedError, match="died"):
        await call


HOSTILE = [
    ("nested braces", r"\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}", "1"),
    ("boxed bomb", r"\boxed{1}" * 20000, "1"),
    ("frac tower", r"\boxed{" + r"\frac{1}{" * 200 + "2" + "}" * 200 + "}", "1"),
    ("a megabyte of working", "x" * 1_000_000 + r" \boxed{1}", "1"),
    ("unicode", "\\boxed{\u00bd} \u7b54\u6848 \u202e \U0001d7d9", "0.5"),
    ("nul byte", "\\boxed{1\x00}", "1"),
]


async def test_hostile_answers_end_within_the_timeout_as_a_verdict_with_status_ok(math_scorer):
    scorer = math_scorer(timeout=3.0)
    started = time.monotonic()
    got = await asyncio.gather(*(scorer.score(traj(i, r, t)) for i, (_, r, t) in enumerate(HOSTILE)))
    took = time.monotonic() - started
    assert all(g.score in (0.0, 1.0) and set(g.extra) == {"timeout"} for g in got)
    assert took < len(HOSTILE) * 3.0 + 10  # none runs past its timeout, even queued two at a time
    after = await scorer.score(traj(99, r"\boxed{\frac12}", "0.5"))  # the pool is whole afterwards
    assert (after.score, after.extra) == (1.0, {"timeout": False})


async def test_many_towers_at_once_are_each_an_ok_zero_and_the_pool_is_restored(math_scorer):
    scorer = math_scorer(timeout=1.0)
    towers = [traj(i, TOWER, "3") for i in range(4)]
    neighbours = [traj(10 + i, r"\boxed{2\sqrt3}", r"\sqrt{12}") for i in range(4)]
    got = await asyncio.gather(*(scorer.score(t) for t in towers + neighbours))
    assert [(g.score, g.extra["timeout"]) for g in got[:4]] == [(0.0, True)] * 4
    assert [g.score for g in got[4:]] == [1.0] * 4
    pool = scorer.inner
    assert pool.kills == 4 and len(pool._all) <= pool.size  # killed processes are not kept
    again = await asyncio.gather(*(scorer.score(traj(20 + i, r"\boxed{\pi}", r"\pi")) for i in range(2)))
    assert [a.score for a in again] == [1.0, 1.0]


async def test_a_sample_cancelled_mid_call_frees_its_process_for_the_next(math_scorer):
    scorer = math_scorer(timeout=60.0, num_processes=1)
    pool = scorer.inner
    await scorer.score(traj(0, r"\boxed{1}", "1"))
    call = asyncio.ensure_future(scorer.score(traj(1, TOWER, "3")))
    await asyncio.sleep(0)  # the call takes the one process
    assert not pool._idle
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert pool._all == set()  # the busy process was killed, not left computing
    started = time.monotonic()
    again = await scorer.score(traj(2, r"\boxed{1}", "1"))
    assert again.score == 1.0 and time.monotonic() - started < 30  # not behind the tower's seconds


async def test_as_a_composite_component_a_costly_answer_is_an_ok_zero_under_the_components_timeout():
    component = {"name": "correct", "scorer": "math-verify", "timeout_s": 2.0}
    scorer = build_scorer(ManagerConfig(components=[component], num_processes=2))
    try:
        right, tower = await asyncio.gather(
            scorer.score(traj(0, r"\boxed{\frac12}", "0.5")), scorer.score(traj(1, TOWER, "3"))
        )
    finally:
        await scorer.aclose()
    assert (right.score, right.extra["correct_status"], right.extra["correct/timeout"]) == (1.0, "ok", False)
    assert (tower.score, tower.extra["correct_status"], tower.extra["correct/timeout"]) == (0.0, "ok", True)


@pytest.mark.parametrize("manager", ["naive", "dapo", "prime", "remote"])
def test_every_per_sample_manager_takes_the_spec(manager):
    scorer = build_scorer(ManagerConfig(manager=manager, scorer="math-verify", timeout=7.0))
    assert scorer.name == "math-verify"


@pytest.mark.parametrize(
    ("manager", "spec", "says"),
    [("naive", "math-verify:strict", "takes no argument"), ("batch", "math-verify", "batched compute_score")],
)
def test_misuse_of_the_spec_is_a_config_error(manager, spec, says):
    with pytest.raises(ConfigError, match=says):
        build_scorer(ManagerConfig(manager=manager, scorer=spec))


def test_score_command_runs_the_spec(tmp_path: Path):
    rows = [
        {"uid": "half", "response": r"so \boxed{\frac{1}{2}}", "ground_truth": "0.5"},
        {"uid": "wrong", "response": r"\boxed{3}", "ground_truth": "4"},
        {"uid": "tower", "response": TOWER, "ground_truth": "3"},
        {"uid": "no truth", "response": r"\boxed{3}", "ground_truth": None},
    ]
    src = tmp_path / "rollouts.jsonl"
    src.write_text("".join(json.dumps({"data_source": "math", **row}) + "\n" for row in rows))
    config = tmp_path / "reward.toml"
    config.write_text("[reward]\ntimeout = 2\n")
    out = tmp_path / "scores.jsonl"
    assert main(["score", str(src), "--scorer", "math-verify", "--config", str(config), "--out", str(out)]) == 0
    got = {row["uid"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert [(got[u]["status"], got[u]["score"]) for u in ("half", "wrong", "tower")] == [
        ("ok", 1.0),
        ("ok", 0.0),
        ("ok", 0.0),
    ]
    assert got["tower"]["reward_extra_info"]["timeout"] is True
    assert got["half"]["reward_extra_info"]["timeout"] is False
    assert got["no truth"]["status"] == "failed" and "ground_truth" in got["no truth"]["error"]
