"""How the trusted side compares a candidate's answer with the expected one.

Runs outside the candidate's process (in the scorer for the stdin and call
forms) on values rebuilt by ``sandbox_wire.loads``, so only exact plain types
arrive. Its ``_sr_*`` functions are also pasted into the stand-alone per-case
programs of ``sandbox.case_script()`` (remote sandboxes, the benchmark
baseline): keep them self-contained.
"""

from __future__ import annotations

__all__ = ["same", "normalize_output", "wrapped_outputs"]


def _sr_plain(x):
    # tuples compare as lists (a LeetCode answer (0, 1) for [0, 1])
    if type(x) is tuple or type(x) is list:
        return [_sr_plain(v) for v in x]
    if type(x) is dict:
        return {k: _sr_plain(v) for k, v in x.items()}
    return x


def _sr_eq(a, b):
    ta, tb = type(a), type(b)
    if ta is list and tb is list:
        return len(a) == len(b) and all(_sr_eq(x, y) for x, y in zip(a, b))  # noqa: B905 (pasted into programs for any Python 3)
    if ta is dict and tb is dict:
        return len(a) == len(b) and all(k in a and _sr_eq(a[k], b[k]) for k in b)
    if ta not in (bool, int, float, str, type(None)) or tb not in (bool, int, float, str, type(None)):
        return False
    if tb is float and ta in (int, float):
        # A tolerance only where the expected answer is a float: an int answer is
        # exact (1000000.5 is not 1000000, though within 1e-6 of it).
        try:
            return a == b or abs(float(a) - b) <= 1e-9 + 1e-6 * abs(b)
        except OverflowError:  # an int past the float range is no answer near a float
            return False
    if tb is int and ta is float:
        return a == b  # int == float compares exactly, even past the float range
    return ta is tb and a == b  # True is not 1: JSON tells them apart


def _sr_same(result, expected, wrapped):
    # ``wrapped``: every output of the sample is a one-element list, the APPS/TACO
    # convention of wrapping the return value; then [x] and x are both accepted.
    # Otherwise only the exact answer is: accepting expected[0] for any list
    # answer let `min(xs)` pass a sort.
    result = _sr_plain(result)
    if _sr_eq(result, expected):
        return True
    return bool(wrapped) and _sr_eq(result, expected[0])


def same(result, expected, wrapped: bool = False) -> bool:
    """``result`` (plain data) is the ``expected`` JSON value: equal plain data (tuples as
    lists, bool apart from int), with a tolerance of 1e-9 + 1e-6 relative only where
    ``expected`` is a float."""
    return _sr_same(result, expected, wrapped)


def wrapped_outputs(outputs: list) -> bool:
    return bool(outputs) and all(type(o) is list and len(o) == 1 for o in outputs)


def normalize_output(raw: bytes) -> list[str]:
    """stdout as lines without trailing blanks or blank trailing lines."""
    lines = [line.rstrip() for line in raw.decode("utf-8", "replace").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines
