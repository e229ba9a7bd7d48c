"""Declared extra-info columns: a composite component's ``columns`` (the built-in scorers'
own keys by default) are on every sample from the first one on, filled with None where a
sample has none (a failed or skipped component); a ``columns`` that is not a list of
names is one line naming the component. Off verl's reward loop an undeclared key is kept,
as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stream_reward import Trajectory
from stream_reward.config import ManagerConfig
from stream_reward.errors import ConfigError, ScoringError
from stream_reward.ops.settings import load_settings
from stream_reward.scoring.columns import default_columns
from stream_reward.scoring.registry import build_scorer

pytestmark = pytest.mark.anyio

DATA = str(Path(__file__).resolve().parent.parent / "data" / "composite_scorers.py")
TAGGED = {"name": "tag", "scorer": f"{DATA}:with_undeclared", "columns": ["hit"]}


def traj(index: int, response: str, source: str = "openai/gsm8k", truth: str = "72") -> Trajectory:
    return Trajectory("b", index, source, response=response, ground_truth=truth, uid=f"u{index}")


async def scored(components: list[dict[str, Any]], *trajs: Trajectory) -> list[Any]:
    scorer = build_scorer(ManagerConfig(components=components, retries=0))
    out: list[Any] = []
    try:
        for t in trajs:
            try:
                out.append((await scorer.score(t)).extra)
            except ScoringError as exc:
                out.append(exc)
        return out
    finally:
        await scorer.aclose()


async def test_a_declared_column_is_on_the_first_sample_though_only_later_ones_have_it() -> None:
    first, second = await scored([TAGGED], traj(0, "no mark"), traj(1, "#### 72"))
    assert first["tag/hit"] is None and second["tag/hit"] is True
    # Off verl's loop an undeclared key is still kept (verl's loop drops it: stream_reward.verl.columns).
    assert first["tag/noise"] == 1


async def test_built_in_scorers_declare_their_keys_by_default() -> None:
    gsm8k, dapo = await scored(
        [{"name": "correct", "scorer": "rules"}], traj(0, "#### 72"), traj(1, "Answer: 7", "math_dapo", "7")
    )
    assert (gsm8k["correct/acc"], gsm8k["correct/pred"]) == (None, None)  # a bare-number rule: filled
    assert dapo["correct/acc"] is True and dapo["correct/pred"] == "7"


async def test_given_columns_replace_the_defaults() -> None:
    (extra,) = await scored([{"name": "correct", "scorer": "rules", "columns": ["pred"]}], traj(0, "#### 72"))
    assert "correct/pred" in extra and "correct/acc" not in extra


async def test_a_failed_sample_carries_every_declared_column_as_none() -> None:
    broken = {"name": "backend", "scorer": f"{DATA}:broken", "columns": ["why"]}
    (failed,) = await scored([TAGGED, {"name": "correct", "scorer": "rules"}, broken], traj(0, "#### 72"))
    assert isinstance(failed, ScoringError) and failed.reason.startswith("backend:")
    for key in ("backend/why", "correct/acc", "correct/pred"):
        assert key in failed.extra and failed.extra[key] is None, key
    assert failed.extra["tag/hit"] in (True, None)  # its value where tag finished first, None where cancelled


def test_default_columns_are_what_the_built_in_scorers_emit() -> None:
    from stream_reward.scoring.rules import compute_score
    from stream_reward.scoring.rules.math_verify import compute_score as math_verify
    from stream_reward.scoring.sandbox.forms import tally

    dapo = compute_score("math_dapo", "Answer: 7", "7")
    assert set(dapo) - {"score"} == set(default_columns("rules"))
    assert set(math_verify("lighteval/MATH", "\\boxed{2}", "2")) - {"score"} == set(default_columns("math-verify"))
    emitted = set(tally([("passed", "")], all_or_nothing=False).extra) - {"cases"}  # a list: not a verl column
    assert emitted == set(default_columns("sandbox")) == set(default_columns("sandbox-fusion:http://x"))
    assert default_columns("genrm:http://x", {"keep_verdict": True}) == ("genrm_verdict",)
    assert default_columns("genrm:http://x") == default_columns("http:http://x") == ()
    assert default_columns(f"{DATA}:format_ok") == ()  # a user's function declares its own


@pytest.mark.parametrize("value", ['"pred"', "3", "[1]", '["a b"]', '["pred", "pred"]', '[""]', "{ a = 1 }"])
def test_columns_that_are_not_a_list_of_names_are_one_line_naming_the_component(tmp_path: Path, value: str) -> None:
    path = tmp_path / "sr.toml"
    path.write_text(f'[[reward.components]]\nname = "judge"\nscorer = "rules"\ncolumns = {value}\n')
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={})
    assert info.value.key == "reward.components.judge.columns"
    assert "\n" not in str(info.value)
