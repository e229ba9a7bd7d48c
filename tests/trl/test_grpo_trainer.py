"""TRL's own GRPOTrainer with ``reward_func`` on the embedded server: a step of a tiny
random model on CPU (every prompt of the dataset, 4 generations each), plain and
conversational prompts.

Beside ours runs a plain-Python reference reward that computes the same score
(``tests/data/trl_scorers.py:length_plus``) from what TRL passes it; what TRL logged
and used for ours must equal the reference's, sample by sample, a failed sample as
NaN in both.

Needs trl (CI's trl job, ``.ci/trl.sh``, installs it and sets
``STREAM_REWARD_REQUIRE_TRL=1``, which turns a missing trl into a failure); skipped
without it.
"""

from __future__ import annotations

import math
import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import pytest

TRL_VERSION = "1.16.0"


def _missing() -> str | None:
    # By distribution metadata, not by import: this very folder is named trl, and
    # without the real package ``import trl`` finds it as a namespace package.
    try:
        found = version("trl")
    except PackageNotFoundError:
        return "trl is not installed"
    if found != TRL_VERSION:
        return f"trl {found} is installed, this suite checks {TRL_VERSION}"
    return None


MISSING = _missing()
if MISSING and os.environ.get("STREAM_REWARD_REQUIRE_TRL") == "1":
    raise RuntimeError(f"STREAM_REWARD_REQUIRE_TRL=1 but {MISSING}: the TRL test must run here")
if MISSING:
    pytest.skip(f"{MISSING}; it runs in CI's trl job (.ci/trl.sh)", allow_module_level=True)
pytest.importorskip("trl")

from grpo_support import grpo_args, tiny_model  # noqa: E402

from stream_reward.trl import reward_func  # noqa: E402

SCORER = f"python:{Path(__file__).resolve().parents[1] / 'data' / 'trl_scorers.py'}:length_plus"

pytestmark = [
    pytest.mark.timeout(600),
    # TRL, transformers, torch and datasets warn at import and on first use; our code stays under error.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]


def reference(prompts: list[Any], completions: list[Any], solution: list[str], **_: Any) -> list[float | None]:
    """length_plus from what TRL passes, computed here: the expected reward per sample."""
    out: list[float | None] = []
    for completion, truth in zip(completions, solution):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        out.append(None if truth == "boom" else float(len(text)) + float(truth))
    return out


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)


@pytest.mark.parametrize("shape", ["plain", "conversational"])
def test_grpo_trainer_uses_the_rewards_our_scorer_gives(tmp_path: Path, shape: str) -> None:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    model = tiny_model(tmp_path / "model")
    questions = ["What is 6 times 7?", "so x = 3", "Answer: 7", "The answer is"]
    rows = [
        {"prompt": q if shape == "plain" else [{"role": "user", "content": q}], "solution": s}
        for q, s in zip(questions, ["1", "boom", "2", "3"])
    ]
    history: list[dict[str, float]] = []

    class Keep(TrainerCallback):  # type: ignore[misc]
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            history.append(dict(logs or {}))

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward_func(scorer=SCORER, data_source="any", name="ours"), reference],
        args=grpo_args(tmp_path / "out"),
        train_dataset=Dataset.from_list(rows),
        callbacks=[Keep()],
    )
    trainer.train()

    steps = [log for log in history if "rewards/ours/mean" in log]
    assert len(steps) == 1
    for log in steps:
        assert same(log["rewards/ours/mean"], log["rewards/reference/mean"]), log
        assert same(log["rewards/ours/std"], log["rewards/reference/std"]), log
    ours = list(trainer._logs["rewards"]["ours"])
    expected = list(trainer._logs["rewards"]["reference"])
    assert len(ours) == len(expected) == 16
    assert all(same(a, b) for a, b in zip(ours, expected)), (ours, expected)
    # The failed prompt's 4 samples are NaN (TRL's "no reward"), not 0; no other is.
    boom = [i for i, c in enumerate(trainer._logs["prompt"]) if "so x = 3" in str(c)]
    assert len(boom) == 4
    assert [i for i in range(16) if math.isnan(ours[i])] == boom
    # And the completions were not all empty: the lengths the scorer saw vary.
    assert len({ours[i] for i in range(16) if i not in boom}) > 1
