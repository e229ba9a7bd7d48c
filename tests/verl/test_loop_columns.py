"""The columns of verl's reward loop are declared, so that every sample of every
RewardLoopWorker actor carries the same keys (``stream_reward.verl.columns``): the loop's
own, dapo's, a composite's or a custom function's ``extra_keys``; an undeclared key is
dropped with one warning naming the option; a missing one is None. Runs without verl."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from stream_reward.errors import ConfigError
from stream_reward.verl.columns import LOOP_COLUMNS, VerlColumns, declared_columns
from stream_reward.verl.options import LoopOptions

DATA = str(Path(__file__).resolve().parent.parent / "data" / "composite_scorers.py")


def options(**kwargs: object) -> LoopOptions:
    return LoopOptions.from_verl({"reward": {"reward_kwargs": kwargs}})


def test_a_custom_functions_extra_keys_are_its_columns() -> None:
    opts = LoopOptions.from_verl(
        {
            "reward": {
                "custom_reward_function": {"path": f"{DATA}", "name": "with_undeclared"},
                "reward_kwargs": {"extra_keys": ["hit", "pred"]},
            }
        }
    )
    assert declared_columns(opts.manager, opts.extra_keys) == [*LOOP_COLUMNS, "hit", "pred"]


def test_reward_extra_keys_is_read_too_and_reward_kwargs_wins() -> None:
    opts = LoopOptions.from_verl({"reward": {"extra_keys": ["a"]}})
    assert opts.extra_keys == ("a",)
    opts = LoopOptions.from_verl({"reward": {"extra_keys": ["a"], "reward_kwargs": {"extra_keys": ["b"]}}})
    assert opts.extra_keys == ("b",)


def test_built_in_scorers_and_composites_declare_their_own() -> None:
    assert declared_columns(options().manager) == [*LOOP_COLUMNS, "pred"]  # rules: acc, pred
    composite = options(
        components=[
            {"name": "format", "scorer": f"{DATA}:format_ok", "columns": ["tags"]},
            {"name": "correct", "scorer": "math-verify"},
        ]
    )
    assert declared_columns(composite.manager)[len(LOOP_COLUMNS) :] == [
        "format",
        "format_status",
        "format_latency_ms",
        "format/tags",
        "correct",
        "correct_status",
        "correct_latency_ms",
        "correct/timeout",
    ]
    dapo = options(manager="dapo", max_resp_len=64, overlong_buffer_cfg={"enable": True, "len": 8, "log": True})
    assert {"overlong_reward", "overlong"} <= set(declared_columns(dapo.manager))


@pytest.mark.parametrize("value", ["pred", [1], ["a b"], ["x", "x"], {"a": 1}])
def test_extra_keys_that_are_not_a_list_of_names_are_one_line(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        options(extra_keys=value)
    assert info.value.key == "reward.reward_kwargs.extra_keys" and "\n" not in str(info.value)


def test_columns_in_a_component_that_are_not_a_list_are_one_line_naming_it() -> None:
    opts = options(components=[{"name": "judge", "scorer": "rules", "columns": "pred"}])
    with pytest.raises(ConfigError) as info:  # the manager builds its columns at start, in the trainer
        declared_columns(opts.manager)
    assert info.value.key == "reward.components.judge.columns"


def test_conform_fills_drops_and_flattens(caplog: pytest.LogCaptureFixture) -> None:
    columns = VerlColumns(["score", "pred", "cases", "judge/why"], composite=True)
    with caplog.at_level(logging.WARNING, logger="stream_reward.verl.columns"):
        first = columns.conform({"score": 1.0, "noise": 1, "judge/extra": 2, "cases": ["passed", "failed"]})
        second = columns.conform({"score": 0.0, "noise": 2, "pred": "7", "judge/why": "ok"})
    assert list(first) == list(second) == ["score", "pred", "cases", "judge/why"]
    assert first["pred"] is None and first["judge/why"] is None  # declared, absent: None, never a missing key
    assert first["cases"] == '["passed", "failed"]' and second["cases"] is None  # lists as JSON text
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings  # one per undeclared key, not one per sample
    assert any("'noise'" in w and "reward.reward_kwargs.extra_keys" in w for w in warnings)
    assert any("'judge/extra'" in w and "reward.components.judge.columns" in w for w in warnings)
