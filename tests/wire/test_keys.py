"""Key names (wire/keys.py): results and done streams are per consumer group."""

from __future__ import annotations

import pytest

from stream_reward.wire.keys import Keys

pytestmark = pytest.mark.anyio


def test_keys_hold_results_per_group() -> None:
    keys = Keys("ns")
    assert keys.results("b", 0, "scorers") != keys.results("b", 0, "judges")
    assert keys.done("b", 0, "scorers") != keys.done("b", 0, "judges")
