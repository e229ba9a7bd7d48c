"""The trusted checker: runs a sample's tests (HumanEval ``check``, assert
statements) in a process the candidate cannot reach.

One checker process per sandbox slot, started on the host (never in the
sandbox) as ``python -I -S -c BOOT``; the host sends ``wire`` in front
of this source. Per sample it forks a child (so nothing one sample's tests did
survives into the next), which drops to an unprivileged uid when it can.

The test's names come from builtins, the test itself and the task's prompt
(HumanEval prompts define helpers such as ``poly``). A check test gets from the
response only its entry point and the prompt's stubs; a name it needs that nothing
trusted defines ends the case as ``unresolved`` (the scorer fails the sample: our
data is wrong, whatever the response). Functions and
classes the response defines reach the test only as proxies (``Remote*``):
calling one sends ``(kind, name, handle, args, kwargs)`` as plain data through
the host to the candidate's process and rebuilds the reply as plain data; any
other reply fails the case. A prompt function whose body is only a docstring is
a stub the response is meant to fill in, so the response's version is used.

Wire with the host: 4-byte little-endian length + ``marshal`` body both ways
(both ends are trusted). Host -> checker: ``("sample", prompt, sys_path, memory_mb)``,
``("case", form, test, entry_point, names)``, ``("reply", data)``, ``("gone",)``,
``("finish",)``. Checker -> host: ``("started", pid)``, ``("call", data)``,
``("verdict", status, detail)`` (status ``unresolved``: detail is the missing
name), ``("crashed", wait_status)``.
"""

import ast
import builtins
import marshal
import os
import sys

PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38

if "dumps" not in globals():  # run on its own; the host normally sends wire.py ahead of this source
    from stream_reward.scoring.sandbox.wire import WireError, dumps, loads


def read_exact(fd, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


FRAMES_IN, FRAMES_OUT = 0, 1  # moved off stdin/stdout by main(), before any test runs


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


class CandidateGone(BaseException):
    """The candidate's process ended (limit, crash or exit) during a call."""


class CandidateFault(BaseException):
    """The candidate replied with something that is not plain data.

    BaseException, so a test's ``except Exception`` cannot swallow it."""


def _rpc(kind, name, handle, args, kwargs):
    try:
        data = dumps((kind, name, handle, list(args), dict(kwargs)))
    except WireError as exc:
        raise TypeError(f"cannot pass this argument to the candidate: {exc}") from None
    send(("call", data))
    msg = recv()
    if msg[0] == "gone":
        raise CandidateGone()
    try:
        rep = loads(msg[1])
    except WireError as exc:
        raise CandidateFault(f"unreadable reply: {exc}") from None
    if type(rep) is not tuple or not rep or type(rep[0]) is not str:
        raise CandidateFault("malformed reply")
    tag = rep[0]
    if tag == "ok" and len(rep) == 2:
        return rep[1]
    if tag == "handle" and len(rep) == 2 and type(rep[1]) is int:
        return RemoteObject(rep[1])
    if tag == "raise" and len(rep) == 3 and type(rep[1]) is str and type(rep[2]) is str:
        _RAISED.add(id(rebuilt := _rebuilt(rep[1], rep[2])))
        raise rebuilt
    if tag == "bad" and len(rep) == 2 and type(rep[1]) is str:
        raise CandidateFault(rep[1])
    raise CandidateFault("malformed reply")


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


class RemoteMethod:
    __slots__ = ("_handle", "_name")

    def __init__(self, handle, name):
        self._handle, self._name = handle, name

    def __call__(self, *args, **kwargs):
        return _rpc("method", self._name, self._handle, args, kwargs)


class RemoteObject:
    __slots__ = ("_handle",)

    def __init__(self, handle):
        self._handle = handle

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return RemoteMethod(self._handle, name)


def stub_functions(prompt):
    """Names of prompt functions whose body is only a docstring / pass / ``...``."""
    try:
        tree = ast.parse(prompt)
    except SyntaxError:
        return set()
    stubs = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if all(
                isinstance(s, ast.Pass) or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
                for s in node.body
            ):
                stubs.add(node.name)
    return stubs


def run_case(prompt, form, test, entry_point, names):
    g = {"__name__": "__main__", "__builtins__": builtins}
    stubs = set()
    if prompt:
        try:
            exec(compile(prompt, "prompt.py", "exec"), g)
        except BaseException:
            pass  # a prompt that is not a complete program (an import this host lacks)
        stubs = stub_functions(prompt)
        for stub in stubs:
            g.pop(stub, None)
    # What the response may name for a check test: its entry point and the prompt's
    # stubs, the functions the task asks it to write. Any other name the test needs is
    # the trusted side's to define: the response's ``poly`` never reaches the test.
    # An assert test's names are the calls it makes; one named like a builtin
    # (``sorted``) is the response's only as its entry point.
    own = {entry_point, *stubs} if form == "check" else {entry_point}
    for name, kind in names.items():
        if type(name) is not str or not name.isidentifier() or name in g:
            continue
        if (name in own) if form == "check" else (name in own or not hasattr(builtins, name)):
            g[name] = RemoteClass(name) if kind == "class" else RemoteFunction(name)
    try:
        exec(compile(test, "test.py", "exec"), g)
        if form == "check":
            g["check"](RemoteFunction(entry_point))
        return ("verdict", "passed", "")
    except NameError as exc:
        missing = getattr(exc, "name", None)
        if form == "check" and id(exc) not in _RAISED and type(missing) is str and missing not in own:
            return ("verdict", "unresolved", missing)  # our data's fault, whatever the response
        return _raised(exc)
    except CandidateGone:
        return ("verdict", "gone", "")
    except CandidateFault as exc:
        return ("verdict", "failed", _describe(exc))
    except AssertionError as exc:
        return ("verdict", "failed", f"assertion failed {_describe(exc)}".strip()[:300])
    except BaseException as exc:
        return _raised(exc)


def _raised(exc):
    status = "runtime_error" if id(exc) in _RAISED else "failed"
    return ("verdict", status, f"{type(exc).__name__}: {_describe(exc)}"[:300])


def _describe(exc):
    # The message may hold the candidate's answer (``assert r == e, r``): one that
    # cannot be turned into text (an int past str()'s digit limit) must not crash us.
    try:
        return str(exc)[:300]
    except BaseException:
        return "(message not printable)"


def sample_child(prompt, sys_path, uid, memory_mb):
    sys.path[:0] = sys_path
    # Trusted code, but it computes on the candidate's answers: bound what an
    # answer built to blow up a comparison can cost the host.
    import resource

    limit = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    if uid is not None:
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        except OSError:
            os._exit(70)
    send(("started", os.getpid()))
    while True:
        msg = recv()
        if msg[0] == "case":
            _, form, test, entry_point, names = msg
            send(run_case(prompt, form, test, entry_point, names))
        elif msg[0] == "finish":
            os._exit(0)
        # a stray "reply"/"gone" (the case already ended) is ignored


def main():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)  # dies with the scorer's process
    private_frames()
    # The tests need no privilege: with root, each sample's child runs as nobody.
    uid = 65534 if os.geteuid() == 0 else None
    for name in ("math", "re", "collections", "itertools", "functools", "random", "copy", "string", "typing"):
        __import__(name)
    send(("ready",))
    while True:
        msg = recv()
        if msg[0] != "sample":
            continue  # leftovers of a sample whose child was killed
        _, prompt, sys_path, memory_mb = msg
        pid = os.fork()
        if pid == 0:
            sample_child(prompt, sys_path, uid, memory_mb)
        _, status = os.waitpid(pid, 0)
        if status:
            send(("crashed", status))


if __name__ == "__main__":
    main()
