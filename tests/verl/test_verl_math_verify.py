"""``--scorer math-verify`` inside verl 0.9.1's own RewardLoopWorker gives verl's own
``verl.utils.reward_score.math_verify.compute_score`` verdict on every pair of the answer
table (``tests/scoring/rules/math_verify_cases.py``)."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from verl.experimental.reward_loop import RewardLoopWorker
from verl.utils.reward_score.math_verify import compute_score  # math-verify: the dev extra installs it, no skip
from verl_support import STREAM_OVERRIDES, make_batch

from stream_reward.verl import StreamRewardLoopManager

_CASES = Path(__file__).resolve().parent.parent / "scoring" / "rules" / "math_verify_cases.py"
_spec = importlib.util.spec_from_file_location("math_verify_cases", _CASES)
assert _spec is not None and _spec.loader is not None
_cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_cases)
PAIRS: list[tuple[str, str, str]] = _cases.PAIRS  # (kind, response, ground truth)


@pytest.fixture
def math_verify_worker(compose) -> Iterator[RewardLoopWorker]:
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # verl's RewardLoopWorker takes the thread's loop
    worker = RewardLoopWorker(
        compose(*STREAM_OVERRIDES, "+reward.reward_kwargs.scorer=math-verify", "+reward.reward_kwargs.num_workers=1")
    )
    try:
        assert isinstance(worker.reward_manager, StreamRewardLoopManager)
        yield worker
    finally:
        worker.reward_manager.close()
        asyncio.set_event_loop(None)
        loop.close()


def test_verdicts_equal_verls_own_math_verify_compute_score(math_verify_worker: Any, tokenizer: Any) -> None:
    rows = [("math", truth, response, None) for _, response, truth in PAIRS]
    data = make_batch(tokenizer, rows, width=128)
    responses = [
        tokenizer.decode(r[m.bool()]) for r, m in zip(data.batch["responses"], data.batch["attention_mask"][:, 6:])
    ]
    assert responses == [response for _, response, _ in PAIRS]  # the rows hold the table's text, exactly
    expected = [float(compute_score(response, truth)) for _, response, truth in PAIRS]
    assert expected.count(1.0) >= 20 and expected.count(0.0) >= 20  # the table tells verdicts apart
    out = math_verify_worker.loop.run_until_complete(math_verify_worker.compute_score_batch(data))
    assert all(o["reward_extra_info"]["reward_status"] == "ok" for o in out)
    got = [o["reward_score"] for o in out]
    differ = [(kind, r, t, e, g) for (kind, r, t), e, g in zip(PAIRS, expected, got) if g != e]
    assert differ == []
