"""The trusted comparison of a candidate's answer with the expected one: exact types
(``True`` is not ``1``), tuples as lists, floats within rounding, and an expected
output unwrapped from APPS-style ``[[answer]]`` only when every sample is wrapped."""

from __future__ import annotations

from stream_reward.scoring.sandbox.judge import same, wrapped_outputs


def test_same_is_exact_and_only_unwraps_wrapped_samples():
    assert same((0, 1), [0, 1]) and same(0.30000000000000004, 0.3)
    assert not same(True, 1) and not same(1, True) and not same("1", 1)
    assert not same(1, [1, 2, 3])  # min(xs) for a sort
    assert same(5, [5], wrapped=True) and not same(5, [5])
    assert wrapped_outputs([[1], [[2, 3]]]) and not wrapped_outputs([[1, 2], [3]])
