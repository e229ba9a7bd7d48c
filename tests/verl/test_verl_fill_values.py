"""Why a declared column a sample lacks is None, not NaN: verl 0.9.1's validation metrics
(``process_validation_metrics``, the only place verl averages reward_extra_info columns)
drop None before they average, so a failed sample neither crashes the step nor biases a
component's mean; a NaN would make the mean NaN."""

from __future__ import annotations

import math
import warnings

from verl.trainer.ppo.metric_utils import process_validation_metrics


def metrics(column: list) -> dict:
    n = len(column)
    out = process_validation_metrics(["src"] * n, ["uid"] * n, {"judge": column, "pred": ["a", None, "b", "a"]})
    return out["src"]["judge"]


def test_none_is_left_out_of_the_mean_and_nan_poisons_it() -> None:
    assert metrics([1.0, None, 0.0, 1.0])["mean@3"] == 2 / 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's "invalid value" on the NaN
        assert math.isnan(metrics([1.0, math.nan, 0.0, 1.0])["mean@4"])


def test_a_column_of_none_only_is_skipped_not_a_crash() -> None:
    n = 3
    out = process_validation_metrics(["src"] * n, ["uid"] * n, {"judge/why": [None] * n, "acc": [1.0, 0.0, 1.0]})
    assert "judge/why" not in out["src"] and out["src"]["acc"]["mean@3"] == 2 / 3
