"""The candidate's side of the call, check and assert forms: answering the calls
of the trusted side inside the candidate's own process.

Pasted, as source, between ``wire`` and ``_harness`` (nothing of stream_reward
is importable in the sandbox). Requests arrive on fd 3 and replies leave on fd 4,
each a frame of a 4-byte little-endian length and ``wire`` bytes. A request is
``(kind, name, handle, args, kwargs)``: ``call`` a global function (or a method of
a fresh ``Solution``), ``new`` an instance of a global class, ``global`` the value
of a global, ``attr`` an attribute of an object held here, ``invoke`` that object
called, ``value`` the contents of a container object held here (``plain_value``),
``next`` the next item of an iterator held here (``["item", value]``, or ``["end"]``). A reply is ``("ok", value)``,
``("ok", None, changed)`` (a call that returned None: its list, dict, set and
bytearray arguments as they are now, ``[[position or keyword, value], ...]``),
``("raise", type name, message)`` or ``("bad", why)``.

With references (the check and assert forms) a value that is not plain data
stays here and crosses as a handle, ``["h", number, type name]``; a handle the
checker sends back is the object again, ``["g", name]`` a global of the
program, and ``["c", number]`` a callable of the test's: calling it sends
``("callback", number, args, kwargs)`` and serves the checker's calls until the
answer, ``("returned", value)`` or ``("raised", type name, message)``, arrives.
Nothing here is trusted: the checker decodes every reply as untrusted data.
"""

import builtins
import os

if "dumps" not in globals():  # run on its own; the host normally sends wire.py ahead of this source
    from stream_reward.scoring.sandbox.wire import WireError, dumps, loads

REQUESTS, REPLIES = 3, 4
_IN_PLACE = (list, dict, set, bytearray)


def _read_frame(fd):
    buf = b""
    while len(buf) < 4 or len(buf) < 4 + int.from_bytes(buf[:4], "little"):
        want = 4 - len(buf) if len(buf) < 4 else 4 + int.from_bytes(buf[:4], "little") - len(buf)
        chunk = os.read(fd, want)
        if not chunk:
            return None
        buf += chunk
    return buf[4:]


def reply(value, ref=None):
    try:
        data = dumps(value, ref)
    except WireError as exc:
        data = dumps(("bad", f"the program returned {exc}"))
    view = memoryview(len(data).to_bytes(4, "little") + data)
    while view:
        view = view[os.write(REPLIES, view) :]


def resolve(g, name):
    fn = g.get(name)
    if fn is None and isinstance(g.get("Solution"), type):
        fn = getattr(g["Solution"](), name, None)
    if fn is None:
        raise NameError(f"the program defines no function {name!r}")
    return fn


def _view_forms():
    import collections

    forms = {}
    for d in ({}, collections.OrderedDict()):  # an OrderedDict's views are types of their own
        forms.update({type(d.keys()): "keys", type(d.values()): "values", type(d.items()): "items"})
    return forms


_VIEWS = _view_forms()


def plain_value(obj):
    """``[form, data]``: what the checker rebuilds a returned object from when the test
    uses it as a value. A container subclass's contents as its base type holds them (a
    namedtuple's tuple), read with the base type's own methods, so no override of the
    program's runs: form ``plain``; a dict view, range, deque, Fraction or Decimal as
    the data of the same type there; a number of another library's (numpy's float64,
    int64, an array) as Python's (``tolist``); an iterator (a generator, ``map``) as
    form ``iter``, its items pulled one ``next`` at a time. Any other object has none
    (TypeError)."""
    import collections
    import decimal
    import fractions

    for base in (tuple, list, frozenset, set):
        if isinstance(obj, base):
            return ["plain", base(base.__iter__(obj))]
    if isinstance(obj, dict):
        return ["plain", dict(dict.items(obj))]
    if isinstance(obj, str):
        return ["plain", str.__str__(obj)]
    if isinstance(obj, bytes):
        return ["plain", bytes.__getitem__(obj, slice(None))]
    t = type(obj)
    if t in _VIEWS:
        return [_VIEWS[t], list(obj)]
    if t is range:
        return ["range", [obj.start, obj.stop, obj.step]]
    if isinstance(obj, collections.deque):
        return ["deque", [list(collections.deque.__iter__(obj)), obj.maxlen]]
    if isinstance(obj, fractions.Fraction):
        return ["fraction", [int(obj.numerator), int(obj.denominator)]]
    if isinstance(obj, decimal.Decimal):
        return ["decimal", decimal.Decimal.__str__(obj)]
    if isinstance(obj, float):
        return ["plain", float.__float__(obj)]
    if isinstance(obj, int):
        return ["plain", int.__index__(obj)]
    if str(getattr(t, "__module__", "")).partition(".")[0] == "numpy" and hasattr(obj, "tolist"):
        return ["plain", obj.tolist()]
    if hasattr(t, "__next__"):
        return ["iter", None]
    raise TypeError(f"{t.__name__} is not plain data")


def plain_answer(obj, depth=0):
    """The call form's answer with the numbers of int and float subclasses and numpy's
    (``np.float64``, an array's ``tolist()``) as Python's, inside plain containers too:
    APPS compares ``np.float64(2.5) == 2.5``. Anything else stays as it is, for the
    wire to refuse."""
    t = type(obj)
    if depth > 100 or obj is None or t in (bool, int, float, str, bytes):
        return obj
    if t is list or t is tuple:
        return t(plain_answer(v, depth + 1) for v in obj)
    if t is dict:
        return {plain_answer(k, depth + 1): plain_answer(v, depth + 1) for k, v in obj.items()}
    if t is set or t is frozenset:
        return t(plain_answer(v, depth + 1) for v in obj)
    if isinstance(obj, float):
        return float.__float__(obj)
    if isinstance(obj, int) and not isinstance(obj, bool):
        return int.__index__(obj)
    if str(getattr(t, "__module__", "")).partition(".")[0] == "numpy" and hasattr(obj, "tolist"):
        return plain_answer(obj.tolist(), depth + 1)
    return obj


def global_names(g):
    """What the program defines, for the checker: ``class``, ``function``,
    ``module:<its name>`` or ``value`` per global (dunders left out). A class or
    function that says it comes from a module adds ``:<module>:<qualname>``: the
    checker takes that module's own, whatever the object here is."""
    names = {}
    own_module = g.get("__name__")  # what the program defines says it comes from here
    for name, value in list(g.items()):
        if name.startswith("__"):
            continue
        if type(value) is type(builtins):
            names[name] = f"module:{getattr(value, '__name__', '')}"
        elif callable(value):
            kind = "class" if isinstance(value, type) else "function"
            try:  # the program's object: its attributes may be anything
                module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
            except BaseException:
                module = qualname = None
            if (
                type(module) is str
                and module not in ("__main__", own_module)
                and type(qualname) is str
                and "<" not in qualname
            ):
                kind = f"{kind}:{module}:{qualname}"
            names[name] = kind
        else:
            names[name] = "value"
    return names


class CheckerFunction:
    """A callable of the test's, held by the program: calling it asks the checker."""

    __slots__ = ("_number", "_server")

    def __init__(self, number, server):
        self._number, self._server = number, server

    def __call__(self, *args, **kwargs):
        return self._server.call_back(self._number, args, kwargs)


class Server:
    """The program's globals and the objects the checker holds handles to."""

    def __init__(self, g, refs):
        self.g, self.refs = g, refs
        self.handles = {}

    def ref(self, value):
        if type(value) is CheckerFunction and value._server is self:
            return ["c", value._number]
        self.handles[len(self.handles) + 1] = value
        return ["h", len(self.handles), type(value).__name__]

    def deref(self, r):
        if len(r) == 2 and r[0] == "h" and r[1] in self.handles:
            return self.handles[r[1]]
        if len(r) == 2 and r[0] == "g" and type(r[1]) is str:
            try:
                return resolve(self.g, r[1])
            except NameError:
                pass
        if len(r) == 2 and r[0] == "c" and type(r[1]) is int:
            return CheckerFunction(r[1], self)
        raise WireError("not a reference")

    def send(self, value):
        reply(value, self.ref if self.refs else None)

    def next_request(self):
        raw = _read_frame(REQUESTS)
        if raw is None:
            return None
        try:
            return loads(raw, self.deref if self.refs else None)
        except WireError as exc:
            return exc

    def serve(self):
        while True:
            req = self.next_request()
            if req is None:
                return
            self.answer(req)

    def answer(self, req):
        if isinstance(req, WireError):
            self.send(("bad", f"unreadable request: {req}"))
        else:
            self.send(self.serve_one(req))

    def call_back(self, number, args, kwargs):
        self.send(("callback", number, list(args), dict(kwargs)))
        while True:
            msg = self.next_request()
            if msg is None:
                os._exit(0)  # the checker is gone: nothing is waiting for this program
            if type(msg) is tuple and len(msg) == 2 and msg[0] == "returned":
                return msg[1]
            if type(msg) is tuple and len(msg) == 3 and msg[0] == "raised":
                cls = getattr(builtins, str(msg[1]), None)
                if isinstance(cls, type) and issubclass(cls, Exception):
                    raise cls(msg[2])
                raise RuntimeError(f"{msg[1]}: {msg[2]}")
            self.answer(msg)  # a call the test's callable makes in turn

    def serve_one(self, req):
        """One call from the trusted side: ``(kind, name, handle, args, kwargs)``."""
        g, handles = self.g, self.handles
        try:
            kind, name, handle, args, kwargs = req
            if kind == "call":
                target = resolve(g, name)
            elif kind == "new":
                target = g[name]
            elif kind == "global":
                return ("ok", g[name])
            elif kind == "attr":
                return ("ok", getattr(handles[handle], name))
            elif kind == "invoke":
                target = handles[handle]
            elif kind == "value":
                return ("ok", plain_value(handles[handle]))
            elif kind == "next":
                try:
                    return ("ok", ["item", next(handles[handle])])
                except StopIteration:  # the iterator's end: data, never the checker's control flow
                    return ("ok", ["end"])
            else:
                return ("bad", f"unknown request {kind!r}")
            result = target(*args, **kwargs)
            if kind == "new":
                return ("ok", result) if self.refs else ("bad", "objects need references")
            if not self.refs:  # the call form: an answer is plain data, numbers as Python's
                return ("ok", plain_answer(result))
            if result is None:
                changed = [[k, v] for k, v in [*enumerate(args), *kwargs.items()] if type(v) in _IN_PLACE]
                if changed:
                    return ("ok", None, changed)
            return ("ok", result)
        except MemoryError:
            return ("raise", "MemoryError", "")
        except BaseException as exc:
            if isinstance(exc, SystemExit):
                return ("raise", "SystemExit", str(exc.code)[:200])
            import traceback

            traceback.print_exc()
            return ("raise", _builtin_name(type(exc)), str(exc)[:300])


def _builtin_name(cls):
    """The nearest builtin exception class ``cls`` derives from, by name: the test's
    ``except ValueError`` catches a ``json.JSONDecodeError`` or the program's own
    ``class BadInput(ValueError)`` as it would in one process."""
    try:
        for base in cls.__mro__:
            if getattr(builtins, base.__name__, None) is base:
                return base.__name__
    except Exception:
        pass
    return cls.__name__
