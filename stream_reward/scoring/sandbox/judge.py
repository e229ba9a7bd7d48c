"""How the trusted side compares a candidate's answer with the expected one.

Runs outside the candidate's process (in the scorer for the stdin and call
forms) on values rebuilt by ``sandbox_wire.loads``, so only exact plain types
arrive; ``same_output`` compares a stdin-form program's stdout. Its ``_sr_*``
functions are also pasted into the stand-alone per-case programs of
``sandbox.case_script()`` (remote sandboxes, the benchmark baseline): keep them
self-contained.
"""

from __future__ import annotations

import decimal
import re

__all__ = ["same", "same_output", "wrapped_outputs"]


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


_NUMBER = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_INTEGER = re.compile(r"[+-]?[0-9]+")
# Differences of decimals exact to 60 digits, at any exponent a token can spell.
_EXACT = decimal.Context(prec=60, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN, traps=[])


def same_output(got: str, expected: str, abs_tol: float = 0.0, rel_tol: float = 0.0) -> bool:
    """A stdin-form program's stdout is the expected output: line by line (trailing
    blank lines ignored), each line as its whitespace-separated tokens (so spacing
    within a line and at its ends does not count), tokens equal as text or as
    decimal numbers (``0.50`` is ``0.5``, ``1e3`` is ``1000``). A tolerance only
    when the task gives one, and only for expected tokens written as decimals (an
    integer answer stays exact): ``|got - expected| <= max(abs_tol, rel_tol * |expected|)``."""
    got_lines, want_lines = _lines(got), _lines(expected)
    if len(got_lines) != len(want_lines):
        return False
    tol = (decimal.Decimal(repr(float(abs_tol))), decimal.Decimal(repr(float(rel_tol)))) if abs_tol or rel_tol else None
    for got_tokens, want_tokens in zip(got_lines, want_lines, strict=True):
        if len(got_tokens) != len(want_tokens):
            return False
        for g, w in zip(got_tokens, want_tokens, strict=True):
            if g != w and not _same_number(g, w, tol):
                return False
    return True


def _lines(text: str) -> list[list[str]]:
    lines = [line.split() for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _same_number(got: str, want: str, tol: tuple[decimal.Decimal, decimal.Decimal] | None) -> bool:
    if not (_NUMBER.fullmatch(got) and _NUMBER.fullmatch(want)):
        return False
    try:
        g, w = decimal.Decimal(got), decimal.Decimal(want)
        if g == w:
            return True
        if tol is None or _INTEGER.fullmatch(want):
            return False
        diff = _EXACT.abs(_EXACT.subtract(g, w))
        return diff <= tol[0] or diff <= _EXACT.multiply(tol[1], _EXACT.abs(w))
    except ArithmeticError:  # an exponent past what Decimal spells: unequal, as the texts were
        return False
