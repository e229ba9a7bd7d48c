"""The rule scorers compare a numeric ground truth as its string form."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.anyio


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
