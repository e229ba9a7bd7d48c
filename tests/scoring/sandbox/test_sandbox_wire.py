"""The plain-data codec across the sandbox wall: every plain value round-trips with its
exact types (non-finite floats included); a value that is not plain data (an
always-equal object, a subclass of int or list, a function) is refused on the way out,
and hostile or too deeply nested bytes are refused on the way in, never a crash."""

from __future__ import annotations

import collections
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stream_reward.scoring.sandbox.wire import WireError, dumps, loads

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text() | st.binary()
hashables = st.recursive(scalars, lambda c: st.tuples(c, c) | st.frozensets(c, max_size=3), max_leaves=8)
values = st.recursive(
    scalars,
    lambda c: (
        st.lists(c, max_size=4)
        | st.tuples(c, c)
        | st.dictionaries(hashables, c, max_size=3)
        | st.sets(hashables, max_size=3)
    ),
    max_leaves=20,
)


def _same_types(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(map(_same_types, a, b))
    if type(a) is dict:
        return a.keys() == b.keys() and all(_same_types(a[k], b[k]) for k in a)
    return a == b


@given(values)
def test_round_trip_keeps_values_and_exact_types(v):
    back = loads(dumps(v))
    assert back == v and _same_types(back, v)


def test_non_finite_floats_cross():
    back = loads(dumps([float("inf"), float("-inf"), float("nan")]))
    assert back[:2] == [float("inf"), float("-inf")] and math.isnan(back[2])


class AlwaysEqual:
    def __eq__(self, other):
        return True


class SneakyInt(int):
    def __eq__(self, other):
        return True


class SneakyList(list):
    pass


@pytest.mark.parametrize(
    "value", [AlwaysEqual(), SneakyInt(3), SneakyList([1]), [1, AlwaysEqual()], {1: SneakyInt(2)}, iter([]), len]
)
def test_non_plain_values_are_refused(value):
    with pytest.raises(WireError):
        dumps(value)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": 1}',
        b'{"t": 1}',
        b'{"x": []}',
        b"NaN",
        b'{"s": [[1]]}',
        b'{"d": [[1]]}',
        b"[" * 10000,
        b"\xff",
        b'{"b": "zz"}',
    ],
)
def test_hostile_bytes_are_refused(raw):
    with pytest.raises(WireError):
        loads(raw)


def test_deep_nesting_is_refused_not_crashed():
    v: list = []
    for _ in range(200):
        v = [v]
    with pytest.raises(WireError):
        dumps(v)


def test_a_reference_crosses_only_where_both_ends_ask_for_it():
    """A value that is not plain data crosses as the reference the sender's hook chose,
    and is rebuilt only by a receiver with a hook: forged into the bytes of a reply
    read without one, it is refused like any unknown tag."""
    kept: list[object] = []

    def ref(value: object) -> list[object]:
        kept.append(value)
        return ["h", len(kept) - 1]

    obj = object()
    data = dumps([1, (obj, "x")], ref)
    assert loads(data, lambda r: ("proxy", r[1])) == [1, (("proxy", 0), "x")]
    with pytest.raises(WireError):
        loads(data)
    with pytest.raises(WireError):
        dumps([obj])  # no hook: refused as before
    with pytest.raises(WireError):
        loads(b'{"r": "not a list"}', lambda r: r)


def test_collections_dicts_cross_as_dicts_with_their_key_types():
    """A Counter, defaultdict or OrderedDict answer is the dict a test compares it to
    (int keys stay ints); its own ``items`` or ``__eq__`` never runs on our side."""

    class Lying(collections.Counter):
        def items(self):
            return [(1, 99)]

        def __eq__(self, other):
            return True

    for value in (collections.Counter([1, 1, 2]), collections.defaultdict(int, {1: 2, 2: 1})):
        back = loads(dumps(value))
        assert type(back) is dict and back == {1: 2, 2: 1} and all(type(k) is int for k in back)
    assert loads(dumps(collections.OrderedDict([("b", 1), ("a", 2)]))) == {"b": 1, "a": 2}
    lying = loads(dumps(Lying([1])))
    assert type(lying) is dict and lying == {1: 1} and lying != {1: 99}
    with pytest.raises(WireError):
        dumps(type("MyDict", (dict,), {})())  # only collections' own dicts
