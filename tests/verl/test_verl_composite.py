"""A composite reward inside verl 0.9.1's own RewardLoopWorker.

The components — a format function, the ``rules`` correctness check and a judge over
HTTP (the reference verifier server on loopback) — reach every sample's
``reward_extra_info`` as ``<name>``, ``<name>_status``, ``<name>_latency_ms``; a judge
outage leaves an optional judge out of the sum, and fails the samples of a required one,
which still carry every column. verl's RewardLoopManager builds its columns from the
first sample's keys (``columns_as_verl_builds_them``), with a failed sample first here.
"""

from __future__ import annotations

import asyncio
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from verl.experimental.reward_loop import RewardLoopWorker
from verl_support import STREAM_OVERRIDES, make_batch

from stream_reward.bench.verifier_server import VerifierServer
from stream_reward.verl import StreamRewardLoopManager

FORMAT = textwrap.dedent(
    """
    async def has_answer(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        return {"score": 1.0 if "####" in solution_str else 0.0, "marks": solution_str.count("#")}
    """
)
# (data_source, ground_truth, response, length): right, wrong, no answer mark
ROWS = [
    ("openai/gsm8k", "42", "The answer is #### 42", None),
    ("openai/gsm8k", "42", "The answer is #### 41", None),
    ("openai/gsm8k", "42", "The answer is 42", None),
]
NAMES = ("format", "correct", "judge")
COLUMNS = {f"{n}{suffix}" for n in NAMES for suffix in ("", "_status", "_latency_ms")} | {"format/marks"}


def columns_as_verl_builds_them(outputs: list[dict]) -> dict[str, np.ndarray]:
    """verl 0.9.1 RewardLoopManager.compute_rm_score's reward_extra_info, line for line."""
    reward_extra_infos = [output.get("reward_extra_info", {}) for output in outputs]
    reward_extra_keys = list(reward_extra_infos[0].keys())
    return {key: np.array([info[key] for info in reward_extra_infos]) for key in reward_extra_keys}


@pytest.fixture
def composite_worker(compose, tokenizer, tmp_path: Path) -> Iterator[Any]:
    """``composite_worker(judge_required, **server)`` -> a function scoring ROWS through
    verl's RewardLoopWorker with the three components; the judge server is started with
    ``server``'s options on the worker's loop."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # verl's RewardLoopWorker takes the thread's loop
    fmt = tmp_path / "fmt.py"
    fmt.write_text(FORMAT)
    made: list[tuple[RewardLoopWorker, VerifierServer]] = []

    def build(judge_required: bool, **server_options: Any) -> list[dict]:
        server = VerifierServer(rule="rules", **server_options)
        url = loop.run_until_complete(server.start())
        components = (  # as a user types it on verl's command line
            f"[{{name:format,scorer:'{fmt}:has_answer',weight:0.2,columns:[marks]}},{{name:correct,scorer:rules}},"
            f"{{name:judge,scorer:'http:{url}',weight:0.5,skip_unless:format,required:{str(judge_required).lower()},"
            "retries:0,timeout_s:10}]"
        )
        config = compose(
            *STREAM_OVERRIDES, "+reward.reward_kwargs.num_workers=1", f"+reward.reward_kwargs.components={components}"
        )
        worker = RewardLoopWorker(config)
        made.append((worker, server))
        assert isinstance(worker.reward_manager, StreamRewardLoopManager)
        data = make_batch(tokenizer, ROWS, width=32)
        return list(loop.run_until_complete(worker.compute_score_batch(data)))

    yield build
    for worker, server in made:
        worker.reward_manager.close()
        loop.run_until_complete(server.stop())
    asyncio.set_event_loop(None)
    loop.close()


def test_every_sample_carries_each_components_columns(composite_worker) -> None:
    out = composite_worker(True)
    assert [o["reward_score"] for o in out] == pytest.approx([0.2 + 1.0 + 0.5, 0.2, 0.0])
    for o in out:
        assert COLUMNS <= set(o["reward_extra_info"]), sorted(o["reward_extra_info"])
    columns = columns_as_verl_builds_them(out)
    assert columns["judge_status"].tolist() == ["ok", "ok", "skipped"]
    assert columns["format"].tolist() == [1.0, 1.0, 0.0] and columns["correct"].tolist() == [1.0, 0.0, 0.0]
    assert all(latency >= 0 for n in NAMES for latency in columns[f"{n}_latency_ms"])
    assert columns["reward_status"].tolist() == ["ok"] * 3


def test_an_optional_judge_down_leaves_the_sum_of_the_rest(composite_worker) -> None:
    out = composite_worker(False, fail_5xx_rate=1.0, fail_status=500)
    assert [o["reward_score"] for o in out] == pytest.approx([0.2 + 1.0, 0.2, 0.0])  # not 0
    columns = columns_as_verl_builds_them(out)
    assert columns["judge_status"].tolist() == ["failed", "failed", "skipped"]
    assert columns["judge"].tolist() == [None, None, 0.0]
    assert columns["reward_failed"].tolist() == [0.0, 0.0, 0.0]


def test_a_required_judge_down_fails_its_samples_which_keep_every_column(composite_worker) -> None:
    out = composite_worker(True, fail_5xx_rate=1.0, fail_status=500)
    columns = columns_as_verl_builds_them(out)  # the first sample is a failed one
    assert COLUMNS <= set(columns), sorted(columns)
    assert columns["reward_failed"].tolist() == [1.0, 1.0, 0.0]  # failed stays failed, flagged for the trainer
    assert all(status.startswith("judge:") for status in columns["reward_status"][:2])
    assert columns["judge_status"].tolist() == ["failed", "failed", "skipped"]
    assert columns["format"].tolist() == [1.0, 1.0, 0.0] and columns["correct"].tolist() == [1.0, 0.0, 0.0]
    assert all(set(o["reward_extra_info"]) == set(columns) for o in out)
