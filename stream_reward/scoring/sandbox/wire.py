"""Plain data across the sandbox wall: the only values a candidate program and the
trusted side exchange.

``dumps`` accepts exactly None, bool, int, float, str, bytes, list, tuple, dict,
set and frozenset (exact types: a subclass of int with a custom ``__eq__`` is
refused, so an always-equal object can never cross), nested to a bounded depth;
``collections``' dicts (``Counter``, ``defaultdict``, ``OrderedDict``) cross as
the plain dict of their items.
``loads`` rebuilds the same types from the bytes, to the same depth, and refuses
anything else, so whatever a hostile program writes on its reply pipe, the trusted
side sees either plain data or a ``WireError``.

Encoding: JSON, with lists as arrays, finite floats and ints as numbers, and every
other type as a one-key object (``{"t": [...]}`` tuple, ``{"s": [...]}`` set,
``{"F": [...]}`` frozenset, ``{"d": [[k, v], ...]}`` dict, ``{"b": "hex"}``
bytes, ``{"f": "nan"}`` non-finite float). A plain JSON object never appears.

References: with a ``ref`` hook, ``dumps`` encodes any other value as
``{"r": ref(value)}`` (a list of plain scalars the hook chose, or WireError from
it); ``loads`` with a ``deref`` hook rebuilds it as ``deref(list)``, and without
one refuses it like any unknown tag. The check and assert forms use them for an
object that stays in its own process (a proxy stands for it on the other side).

This module is also pasted, as source, in front of the in-sandbox harness and the
trusted checker (which must not import stream_reward): stdlib only, no relative
imports, every name public here is used there.
"""

import collections as _collections
import json as _json

WIRE_MAX_DEPTH = 100
_COLLECTIONS_DICTS = (_collections.Counter, _collections.defaultdict, _collections.OrderedDict)


class WireError(ValueError):
    """The value is not plain data (or the bytes are not a plain-data encoding)."""


def _enc(x, depth, ref=None):
    if depth > WIRE_MAX_DEPTH:
        raise WireError("value nested too deeply")
    t = type(x)
    if x is None or t is bool or t is int or t is str:
        return x
    if t is float:
        return x if x - x == 0.0 else {"f": repr(x)}
    d = depth + 1
    if t is list:
        return [_enc(v, d, ref) for v in x]
    if t is tuple:
        return {"t": [_enc(v, d, ref) for v in x]}
    if t is dict:
        return {"d": [[_enc(k, d, ref), _enc(v, d, ref)] for k, v in x.items()]}
    if t is set:
        return {"s": [_enc(v, d, ref) for v in x]}
    if t is frozenset:
        return {"F": [_enc(v, d, ref) for v in x]}
    if t is bytes or t is bytearray:
        return {"b": bytes(x).hex()}
    if isinstance(x, _COLLECTIONS_DICTS):
        # Counter, defaultdict, OrderedDict: a dict with its key types, as a test's
        # ``==`` against a dict sees them. Read with dict's own items(), never theirs.
        return {"d": [[_enc(k, d, ref), _enc(v, d, ref)] for k, v in dict.items(x)]}
    if ref is not None:
        return {"r": ref(x)}
    raise WireError(f"{t.__name__} is not plain data")


def dumps(value, ref=None):
    """``value`` as wire bytes; WireError if it is not plain data (and ``ref``,
    when given, refuses it)."""
    try:
        return _json.dumps(_enc(value, 0, ref), separators=(",", ":"), allow_nan=False).encode()
    except RecursionError:
        raise WireError("value nested too deeply") from None


_FLOATS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def _tagged(obj, deref=None):
    if len(obj) != 1:
        raise WireError("not a wire value")
    ((tag, v),) = obj.items()
    if tag == "r" and deref is not None and type(v) is list:
        return deref(v)
    if tag == "t" and type(v) is list:
        return tuple(v)
    if tag == "d" and type(v) is list:
        out = {}
        for pair in v:
            if type(pair) is not list or len(pair) != 2:
                raise WireError("bad dict item")
            out[pair[0]] = pair[1]
        return out
    if tag == "s" and type(v) is list:
        return set(v)
    if tag == "F" and type(v) is list:
        return frozenset(v)
    if tag == "b" and type(v) is str:
        return bytes.fromhex(v)
    if tag == "f" and v in _FLOATS:
        return _FLOATS[v]
    raise WireError(f"unknown wire tag {tag!r}")


def loads(data, deref=None):
    """The plain value encoded in ``data`` (references rebuilt by ``deref``, when
    given); WireError for anything else."""
    hook = _tagged if deref is None else (lambda obj: _tagged(obj, deref))
    try:
        value = _json.loads(data, object_hook=hook, parse_constant=_no_constant)
    except WireError:
        raise
    except (ValueError, TypeError, RecursionError, MemoryError) as exc:  # unhashable set item, bad JSON, ...
        raise WireError(f"not a wire value ({type(exc).__name__})") from None
    _check_depth(value)
    return value


def _check_depth(value):
    # The JSON parser nests as deep as the stack allows: bytes forged on a reply pipe
    # could hand the trusted side a value that overflows its stack when compared.
    # Iterative, so the check itself cannot.
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if depth > WIRE_MAX_DEPTH:
            raise WireError("value nested too deeply")
        t = type(v)
        if t is list or t is tuple or t is set or t is frozenset:
            stack.extend((x, depth + 1) for x in v)
        elif t is dict:
            stack.extend((x, depth + 1) for item in v.items() for x in item)


def _no_constant(name):
    raise WireError(f"bare {name} is not a wire value")
