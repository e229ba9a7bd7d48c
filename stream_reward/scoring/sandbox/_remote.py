"""The trusted checker's side of the wall: its frames to the host and the proxies
that stand for the candidate's functions and objects in a test.

Pasted, as source, between ``wire`` and ``_checker`` (the checker's process
imports nothing of stream_reward). A test holds only proxies (``Remote*``):
calling one, or reading an attribute of one, sends ``(kind, name, handle, args,
kwargs)`` as plain data through the host to the candidate's process, and the
reply comes back as plain data. Both directions may carry references
(``wire``'s ``ref``): an object of the candidate's crosses as a handle it keeps
(a ``RemoteObject`` here), a callable of the test's (a lambda, ``len``) as a
number the candidate calls back through while the call is in progress; the
checker then runs it and answers, nested as deep as the calls go.

What the candidate returns is data, never control flow here: its exceptions
are rebuilt as ordinary ones (``_rebuilt``), a proxy object refuses to be
compared, tested for truth, iterated or hashed into an answer (``_refuse``),
and an object a call returned that the test never looked into fails the case
(``unexamined``): a test that only checks ``is not None`` gets no answer from
an object. An argument the call changed in place is written back into the
test's own list, dict, set or bytearray only when the call returned None (the
in-place convention): a function that returns a value as well cannot empty
the input a test then compares its answer against.
"""

import builtins
import marshal
import math
import operator
import os

if "dumps" not in globals():  # run on its own; the host normally sends wire.py ahead of this source
    from stream_reward.scoring.sandbox.wire import WireError, dumps, loads
if "rebuilt_value" not in globals():  # likewise _values.py
    from stream_reward.scoring.sandbox._values import rebuilt_value, sync_in_place


def read_exact(fd, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


FRAMES_IN, FRAMES_OUT = 0, 1  # moved off stdin/stdout by private_frames(), before any test runs


def recv():
    head = read_exact(FRAMES_IN, 4)
    if head is None:
        os._exit(0)
    return marshal.loads(read_exact(FRAMES_IN, int.from_bytes(head, "little")))


def send(obj):
    data = marshal.dumps(obj)
    data = len(data).to_bytes(4, "little") + data
    view = memoryview(data)
    while view:
        view = view[os.write(FRAMES_OUT, view) :]


def private_frames():
    """The frame pipes on fds of their own, stdin and stdout on /dev/null: a test that
    prints (the candidate's answer, say: past the 8 KB buffer it would be flushed into
    the frames) or reads input cannot corrupt the frames."""
    global FRAMES_IN, FRAMES_OUT
    FRAMES_IN, FRAMES_OUT = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)


_RAISED: set[int] = set()  # ids of exceptions rebuilt from the candidate's: a crash, not a wrong answer
_CALLBACKS: list = []  # the test's callables the candidate holds, by number
_UNEXAMINED: dict = {}  # handle -> type name: objects calls returned that the test has not looked into
_CALLBACK_FAILURES: list = []  # assertions that failed in a test's callable the candidate called


def new_case():
    _depth[0] = 0
    _CALLBACKS.clear()
    _UNEXAMINED.clear()
    _CALLBACK_FAILURES.clear()


def unexamined():
    """Why the case fails although its test ran through, or ""."""
    if _CALLBACK_FAILURES:
        return f"assertion failed in a callable of the test: {_CALLBACK_FAILURES[0]}"
    if _UNEXAMINED:
        return f"the program returned a {next(iter(_UNEXAMINED.values()))}, which is not plain data"
    return ""


class CandidateGone(BaseException):
    """The candidate's process ended (limit, crash or exit) during a call."""


class CandidateFault(BaseException):
    """The candidate replied with something that is not plain data, or the test used
    a candidate's object as a value.

    BaseException, so a test's ``except Exception`` cannot swallow it."""


def _ref(value):
    # Test -> candidate: a candidate's object goes back as its handle, a candidate's
    # function or class by name, a test's callable as a number to call back on.
    t = type(value)
    if t is RemoteObject:
        _UNEXAMINED.pop(value._handle, None)  # handed back to the candidate: used
        return ["h", value._handle]
    if t is RemoteFunction or t is RemoteClass:
        return ["g", value._name]
    if callable(value):
        _CALLBACKS.append(value)
        return ["c", len(_CALLBACKS) - 1]
    raise WireError(f"{t.__name__} is not plain data")


def _deref(r):
    # Candidate -> test: a handle becomes a proxy, a callback number the test's own callable.
    if len(r) == 3 and r[0] == "h" and type(r[1]) is int and type(r[2]) is str:
        _UNEXAMINED[r[1]] = r[2][:60]
        return RemoteObject(r[1], r[2][:60])
    if len(r) == 2 and r[0] == "c" and type(r[1]) is int and 0 <= r[1] < len(_CALLBACKS):
        return _CALLBACKS[r[1]]
    raise WireError("not a reference")


MAX_NESTING = 50  # calls into the candidate inside callbacks inside calls ...: far below the stack's limit
_depth = [0]


def _rpc(kind, name, handle, args, kwargs):
    args, kwargs = list(args), dict(kwargs)
    try:
        data = dumps((kind, name, handle, args, kwargs), _ref)
    except WireError as exc:
        raise TypeError(f"cannot pass this argument to the candidate: {exc}") from None
    if _depth[0] >= MAX_NESTING:
        # A RecursionError here could strike between a frame's halves and break the checker.
        raise CandidateFault("calls and callbacks nested too deep")
    _depth[0] += 1
    try:
        while True:
            send(("call", data))
            rep = _reply()
            if rep[0] != "callback":
                break
            data = _called_back(rep)
    finally:
        _depth[0] -= 1
    tag = rep[0]
    if tag == "ok" and len(rep) in (2, 3):
        if kind in ("new", "global"):  # asked for by the test: not an answer to examine
            for value in (rep[1],):
                if type(value) is RemoteObject:
                    _UNEXAMINED.pop(value._handle, None)
        if len(rep) == 3:
            if rep[1] is not None or type(rep[2]) is not list:
                raise CandidateFault("malformed reply")
            _write_back(args, kwargs, rep[2])
        return rep[1]
    if tag == "raise" and len(rep) == 3 and type(rep[1]) is str and type(rep[2]) is str:
        _RAISED.add(id(rebuilt := _rebuilt(rep[1], rep[2])))
        raise rebuilt
    if tag == "bad" and len(rep) == 2 and type(rep[1]) is str:
        raise CandidateFault(rep[1])
    raise CandidateFault("malformed reply")


def _reply():
    msg = recv()
    if msg[0] == "gone":
        raise CandidateGone()
    try:
        rep = loads(msg[1], _deref)
    except WireError as exc:
        raise CandidateFault(f"unreadable reply: {exc}") from None
    if type(rep) is not tuple or not rep or type(rep[0]) is not str:
        raise CandidateFault("malformed reply")
    return rep


def _called_back(rep):
    """The candidate called a test's callable: run it here, and the answer to send."""
    if not (len(rep) == 4 and type(rep[2]) is list and type(rep[3]) is dict and all(type(k) is str for k in rep[3])):
        raise CandidateFault("malformed callback")
    if not (type(rep[1]) is int and 0 <= rep[1] < len(_CALLBACKS)):
        raise CandidateFault("a callback to a callable the test never passed")
    fn = _CALLBACKS[rep[1]]
    try:
        answer = ("returned", fn(*rep[2], **rep[3]))
    except (CandidateGone, CandidateFault):
        raise
    except AssertionError as exc:  # the test's own check failed, whatever the candidate does with it
        _CALLBACK_FAILURES.append(_describe(exc))
        answer = ("raised", "AssertionError", _describe(exc))
    except BaseException as exc:
        answer = ("raised", type(exc).__name__, _describe(exc))
    try:
        return dumps(answer, _ref)
    except WireError as exc:
        return dumps(("raised", "TypeError", f"the test's callable returned {exc}"))


def _describe(exc):
    # The message may hold the candidate's answer (``assert r == e, r``): one that
    # cannot be turned into text (an int past str()'s digit limit) must not crash us.
    try:
        return str(exc)[:300]
    except BaseException:
        return "(message not printable)"


def _write_back(args, kwargs, changed):
    for item in changed:
        if type(item) is not list or len(item) != 2:
            raise CandidateFault("malformed reply")
        key, new = item
        if type(key) is int and 0 <= key < len(args):
            sync_in_place(args[key], new)
        elif type(key) is str and key in kwargs:
            sync_in_place(kwargs[key], new)


def _rebuilt(name, message):
    """The candidate's exception as the test may expect it (a ``ValueError`` stays one).
    Only ordinary exceptions are rebuilt: SystemExit & co. must not end the checker, and
    a StopIteration raised inside the test's ``map``/``next`` would end its loop early
    (``all(map(candidate, xs))`` true); those arrive as a RuntimeError."""
    cls = getattr(builtins, name, None)
    if (
        isinstance(cls, type)
        and issubclass(cls, Exception)
        and not issubclass(cls, (StopIteration, StopAsyncIteration))
    ):
        try:
            return cls(message)
        except BaseException:  # a class whose constructor wants more (UnicodeDecodeError)
            pass
    return RuntimeError(f"{name}: {message}")


class RemoteFunction:
    __slots__ = ("_name",)

    def __init__(self, name):
        self._name = name

    def __call__(self, *args, **kwargs):
        return _rpc("call", self._name, None, args, kwargs)

    def __repr__(self):
        return f"<candidate function {self._name}>"


class RemoteClass(RemoteFunction):
    __slots__ = ()

    def __call__(self, *args, **kwargs):
        return _rpc("new", self._name, None, args, kwargs)


def _refuse(self, *args):
    raise CandidateFault(f"the program's {self._type} is not plain data (the test used it as a value)")


def _valued(op):
    def method(self, *args):
        with _nesting():
            return op(self._value(), *args)

    return method


def _reflected(op):
    def method(self, other):
        with _nesting():
            return op(other, self._value())

    return method


class _nesting:
    # A value holding (or standing for) itself, ``x.append(x)``: comparing it compares
    # a proxy in turn, each level a few frames deeper, so bound the nesting before it
    # bounds the stack.
    level = 0

    def __enter__(self):
        if _nesting.level >= MAX_NESTING:
            raise CandidateFault("the program's value is nested too deep (or holds itself)")
        _nesting.level += 1

    def __exit__(self, *exc):
        _nesting.level -= 1


def _pulled(handle):
    while True:
        rep = _rpc("next", None, handle, (), {})
        if type(rep) is list and rep == ["end"]:
            return
        if type(rep) is not list or len(rep) != 2 or rep[0] != "item":
            raise CandidateFault("malformed reply")
        yield rep[1]


class RemoteObject:
    """An object of the candidate's: its attributes and calls cross; when the test uses
    it as a value, a container's contents (a namedtuple, a list subclass) cross as the
    plain data of its base type, a dict view, range, deque, Fraction, Decimal or
    numpy number as the same here, an iterator as a generator pulling its items one
    at a time; nothing else does."""

    __slots__ = ("_handle", "_type", "_held")

    def __init__(self, handle, type_name):
        self._handle, self._type, self._held = handle, type_name, None

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        _UNEXAMINED.pop(self._handle, None)
        return _rpc("attr", name, self._handle, (), {})

    def __call__(self, *args, **kwargs):
        _UNEXAMINED.pop(self._handle, None)
        return _rpc("invoke", None, self._handle, args, kwargs)

    def __repr__(self):
        return f"<candidate {self._type} object>"

    def _value(self):
        _UNEXAMINED.pop(self._handle, None)
        if self._held is not None:  # an iterator: one here for the one there
            return self._held
        try:
            reply = _rpc("value", None, self._handle, (), {})
        except Exception as exc:
            if id(exc) in _RAISED:  # not a container: no value to compare
                _refuse(self)
            raise
        if type(reply) is not list or len(reply) != 2 or type(reply[0]) is not str:
            raise CandidateFault("malformed reply")
        form, data = reply
        if form == "iter":
            self._held = _pulled(self._handle)
            return self._held
        try:
            return rebuilt_value(form, data)
        except (TypeError, ValueError, ArithmeticError):
            raise CandidateFault(f"malformed {form} value") from None

    def __hash__(self):
        # As its value hashes, so that a numpy number or a tuple of the program's finds
        # its equal in a set or dict (``mean(xs) in {1.5}``, ``set(np.unique(xs))``);
        # an object with no value, or an unhashable one, by identity.
        was = _UNEXAMINED.get(self._handle)
        try:
            with _nesting():
                return hash(self._value())
        except CandidateFault:
            if was is not None:  # hashing is not looking into it
                _UNEXAMINED[self._handle] = was
            return object.__hash__(self)
        except TypeError:
            return object.__hash__(self)

    __eq__, __ne__ = _valued(operator.eq), _valued(operator.ne)
    __lt__, __le__, __gt__, __ge__ = (
        _valued(operator.lt),
        _valued(operator.le),
        _valued(operator.gt),
        _valued(operator.ge),
    )
    __bool__, __len__, __iter__, __next__ = _valued(bool), _valued(len), _valued(iter), _valued(next)
    __contains__, __getitem__ = _valued(operator.contains), _valued(operator.getitem)
    # Numbers and sets the program returned compute as their values do: a test's
    # ``abs(area(1) - 3.14) < 1e-2`` on a numpy float, ``a + b`` on two Decimals.
    __str__, __format__, __bytes__ = _valued(str), _valued(format), _valued(bytes)
    __int__, __float__, __index__, __complex__ = _valued(int), _valued(float), _valued(operator.index), _valued(complex)
    __neg__, __pos__, __abs__, __invert__ = (
        _valued(operator.neg),
        _valued(operator.pos),
        _valued(abs),
        _valued(operator.invert),
    )
    __round__, __reversed__ = _valued(round), _valued(reversed)
    __trunc__, __floor__, __ceil__ = _valued(math.trunc), _valued(math.floor), _valued(math.ceil)


# Binary operators from either side (``x + 1``, ``1 + x``, ``divmod(x, 2)``, ``pow(x, 2, 7)``).
for _name in "add sub mul truediv floordiv mod pow divmod and or xor lshift rshift".split():
    _op = {"pow": pow, "divmod": divmod}.get(_name) or getattr(operator, f"__{_name}__")
    setattr(RemoteObject, f"__{_name}__", _valued(_op))
    setattr(RemoteObject, f"__r{_name}__", _reflected(_op))
del _name, _op
