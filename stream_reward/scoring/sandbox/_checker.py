"""The trusted checker: runs a sample's tests (HumanEval ``check``, assert
statements) in a process the candidate cannot reach.

One checker process per sandbox slot, started on the host (never in the
sandbox) as ``python -I -S -c BOOT``; the host sends ``wire`` and ``_remote``
(the proxies) in front of this source. Per sample it forks a child (so nothing
one sample's tests did survives into the next), which drops to an unprivileged
uid when it can.

The test's names come from builtins, the test itself and the task's prompt
(HumanEval prompts define helpers such as ``poly``). A check test gets from the
response only its entry point (which may be ``Solution().method``) and the
prompt's stubs; a name it needs that nothing trusted defines ends the case as
``unresolved`` (the scorer fails the sample: our data is wrong, whatever the
response). An assert test runs in the program's globals, as MBPP runs its
asserts: the program's functions and classes as proxies (``_remote``: a call
crosses as plain data to the candidate's process and back), a module it
imported (or a class or function it took from one) imported here for real, any
other value fetched as data when the test reads it. A function of the program's
own that the test hands the function under test or its result (``isclose(area(1),
3.14)``) would be the response judging itself: it fails the case. A prompt function whose body is only a docstring
is a stub the response is meant to fill in (so is ``raise NotImplementedError``,
and a class of only such methods), so the response's version is used.

Wire with the host: 4-byte little-endian length + ``marshal`` body both ways
(both ends are trusted). Host -> checker: ``("sample", prompt, sys_path, memory_mb)``,
``("case", form, test, entry_point, names)``, ``("reply", data)``, ``("gone",)``,
``("finish",)``. Checker -> host: ``("started", pid)``, ``("call", data)``,
``("verdict", status, detail)`` (status ``unresolved``: detail is the missing
name), ``("crashed", wait_status)``.
"""

import ast
import builtins
import os
import sys

PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38

if "RemoteFunction" not in globals():  # run on its own; the host normally sends wire.py and _remote.py ahead
    from stream_reward.scoring.sandbox._remote import (
        _RAISED,
        CandidateFault,
        CandidateGone,
        RemoteClass,
        RemoteFunction,
        _describe,
        _rpc,
        new_case,
        private_frames,
        recv,
        send,
        unexamined,
    )
if "open_import_paths" not in globals():  # likewise _import_view.py
    from stream_reward.scoring.sandbox._import_view import open_import_paths


def stub_functions(prompt):
    """Names of the prompt's stubs: functions whose body is only a docstring / pass /
    ``...`` / ``raise NotImplementedError``, and classes (LeetCode's starter
    ``class Solution``) whose body is only such methods."""
    try:
        tree = ast.parse(prompt)
    except SyntaxError:
        return set()
    return {node.name for node in tree.body if _stub(node)}


def _stub(node):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return all(_placeholder(s) for s in node.body)
    if isinstance(node, ast.ClassDef):
        return any(isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) for s in node.body) and all(
            _placeholder(s) or _stub(s) for s in node.body
        )
    return False


def _placeholder(s):
    if isinstance(s, ast.Raise) and s.cause is None:
        exc = s.exc.func if isinstance(s.exc, ast.Call) else s.exc
        return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"
    return isinstance(s, ast.Pass) or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))


def candidate_entry(entry_point):
    """The function ``check`` is given: the response's function of that name, or for
    ``Class().method`` (LeetCode's starter code) that method of a fresh instance."""
    cls, sep, method = entry_point.partition("().")
    if sep:
        return getattr(RemoteClass(cls)(), method)
    return RemoteFunction(entry_point)


def run_case(prompt, form, test, entry_point, names):
    new_case()
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
    # An assert test runs in the program's globals, as MBPP's do; a name there that is
    # a builtin (``sorted``) is the response's only as its entry point.
    own = {entry_point, *stubs} if form == "check" else {entry_point}
    tree = parsed(test)
    try:
        read = names_read(tree)
        names = {
            name: kind
            for name, kind in names.items()
            if type(name) is str and name.isidentifier() and type(kind) is str and name not in g
            if ((name in own) if form == "check" else (name in own or not hasattr(builtins, name)))
        }
        # A class or function the program took from a module is that module's own here:
        # ``from math import isclose`` gives the test the real isclose, whatever the
        # program's object is (or says it is).
        # Only under its own name: the test's ``isclose`` bound to another function
        # (``from operator import ne as isclose``) would be the program choosing its judge.
        real = {}
        for name, kind in names.items():
            base, _, origin = kind.partition(":")
            if base in ("class", "function") and origin and name in read and name not in own:
                found = module_attribute(origin)
                if found is not None and getattr(found, "__name__", None) == name:
                    real[name] = found
        judging = judges(tree, names, real, entry_point) if form == "assert" else set()
        for name, kind in names.items():
            base = kind.partition(":")[0]
            if name in real:
                g[name] = real[name]
            elif name in judging:
                g[name] = refused_judge(name)
            elif base == "class":
                g[name] = RemoteClass(name)
            elif base == "function":
                g[name] = RemoteFunction(name)
            elif name in read:
                program_global(g, name, kind)
        exec(compile(test if tree is None else tree, "test.py", "exec"), g)  # a SyntaxError fails the case
        if form == "check":
            g["check"](candidate_entry(entry_point))
        why = unexamined()
        return ("verdict", "failed", why) if why else ("verdict", "passed", "")
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


def parsed(test):
    """The test's syntax tree, parsed once for the rules below and the run; None when
    it does not parse (then compiling it fails the case)."""
    try:
        return ast.parse(test, "test.py")
    except SyntaxError:
        return None


def names_read(tree):
    """The names the test reads: only those of the program's other globals reach it."""
    if tree is None:
        return set()
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}


def judges(tree, names, real, entry_point):
    """The program's own callables that an assert test hands the function under test
    (or what it returned): ``isclose(area(1), 3.14)``, ``same(area, 1, 3.14)``. The
    function under test is the task's entry point, or with none given any function
    of the program's own (a class's, through its instances' attributes)."""
    if tree is None:
        return set()
    callables = {n for n, k in names.items() if n not in real and k.partition(":")[0] in ("class", "function")}
    if entry_point:
        functions, classes = {entry_point}, set()
    else:
        functions = {n for n in callables if names[n].partition(":")[0] == "function"}
        classes = callables - functions
    functions |= _holders(tree, functions, classes)
    found = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        judge = node.func.id
        if judge not in callables or judge == entry_point:
            continue
        for arg in [*node.args, *(k.value for k in node.keywords)]:
            if _hands(arg, functions - {judge}, classes - {judge}):
                found.add(judge)
    return found


def _holders(tree, functions, classes):
    """The test's names that hold the function under test or what it returned
    (``r = area(1)``, ``for r in area(1)``), to a fixed point: ``isclose(r, 3.14)``
    hands it over as surely as ``isclose(area(1), 3.14)``."""
    held: set = set()
    while True:
        before = len(held)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.NamedExpr)):
                pairs = [(t, node.value) for t in getattr(node, "targets", [getattr(node, "target", None)])]
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                pairs = [(node.target, node.iter)]
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                pairs = [(i.optional_vars, i.context_expr) for i in node.items]
            else:
                continue
            for target, value in pairs:
                if target is not None and value is not None and _hands(value, functions | held, classes):
                    held |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        if len(held) == before:
            return held


def _hands(arg, functions, classes):
    for node in ast.walk(arg):
        if isinstance(node, ast.Name) and node.id in functions:
            return True
        if isinstance(node, ast.Attribute) and any(
            isinstance(n, ast.Name) and n.id in classes for n in ast.walk(node.value)
        ):
            return True
    return False


def refused_judge(name):
    """What the test gets for a judge only the response defines: the case fails."""

    def refused(*args, **kwargs):
        raise CandidateFault(f"the test's check {name} is the response's own")

    return refused


# Modules whose import does something (opens a browser, prints, starts a GUI, runs
# the regression test suite: ``test.autotest``); so does any package's ``__main__``
# (``unittest.__main__`` runs test discovery, ``ensurepip.__main__`` installs pip).
_NO_IMPORT = frozenset(
    {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "__hello__", "__phello__", "test"}
)


def real_module(module):
    if type(module) is not str or not module or module.split(".")[0] in _NO_IMPORT:
        return None
    if "__main__" in module.split("."):
        return None
    import importlib

    try:
        return importlib.import_module(module)
    except BaseException:
        return None


def module_attribute(origin):
    """The object ``<module>:<qualname>`` names, from the real module; None if it has none."""
    module, _, qualname = origin.partition(":")
    obj = real_module(module)
    if obj is None or not qualname:
        return None
    try:
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except BaseException:
        return None
    return obj


def program_global(g, name, kind):
    """A global of the program's that the test reads, as MBPP runs its asserts in the
    program's own globals: a module the program imported is imported here under the
    program's name for it (the real one, never the candidate's copy: ``import os as
    math`` gives the test the real os), any other value is fetched from the candidate
    as data: one that is not plain data (an object, a function inside a dict) fails
    the case."""
    if kind.startswith("module:"):
        module = real_module(kind[len("module:") :])
        if module is not None:
            g[name] = module
    elif kind == "value":
        value = _rpc("global", name, None, (), {})
        if not _plain(value):
            # An object whose methods the test would call (``math = SimpleNamespace(
            # isclose=lambda *a, **k: True)``) would be the program judging itself.
            raise CandidateFault(f"the program's global {name} is not plain data")
        g[name] = value


def _plain(value):
    # the wire's types only, no reference anywhere inside (wire.loads bounds the depth)
    t = type(value)
    if t in (list, tuple, set, frozenset):
        return all(_plain(v) for v in value)
    if t is dict:
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return t in (type(None), bool, int, float, str, bytes)


# How a sample's child ends when the scorer is done with it. Any other end (a
# signal, an exit, even ``os._exit(0)`` from a dataset's test) is reported as a
# crash: the scorer must not wait for a verdict that will never come.
FINISHED = 86


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
            os._exit(FINISHED)
        # a stray "reply"/"gone" (the case already ended) is ignored


def main():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)  # dies with the scorer's process
    private_frames()
    # The tests need no privilege: with root, each sample's child runs as nobody.
    uid = 65534 if os.geteuid() == 0 else None
    # Loaded once here rather than in every sample's child (its own imports: resource,
    # importlib for the program's modules).
    for name in (
        "math",
        "re",
        "collections",
        "itertools",
        "functools",
        "random",
        "copy",
        "string",
        "typing",
        "resource",
        "importlib",
    ):
        __import__(name)
    import gc

    gc.collect()
    gc.freeze()  # each sample's child shares these pages instead of copying them
    send(("ready",))
    importable = set()
    while True:
        msg = recv()
        if msg[0] != "sample":
            continue  # leftovers of a sample whose child was killed
        _, prompt, sys_path, memory_mb = msg
        wanted = {*sys.path, *sys_path, sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
        if uid is not None and not wanted <= importable:
            # before nobody runs anything: the import paths, readable wherever they live
            importable |= wanted
            open_import_paths(sorted(importable))
        pid = os.fork()
        if pid == 0:
            sample_child(prompt, sys_path, uid, memory_mb)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != FINISHED:
            send(("crashed", status))


if __name__ == "__main__":
    main()
