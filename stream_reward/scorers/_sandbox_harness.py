"""The in-sandbox harness: runs one sample's program against its test cases.

Trusted code, but it runs *inside* the sandbox, so it imports nothing from
stream_reward and only cheap stdlib modules. The host never imports this
module: ``sandbox.py`` reads its source, sends it (precompiled when the
sandbox runs the host's interpreter) on stdin ahead of the job, and a tiny
``python -I -S -c`` bootstrap execs it as ``__main__``. Run directly,
``python -I -S _sandbox_harness.py`` reads just the marshalled job on stdin.

The job (a marshalled dict, see ``SandboxScorer._job``) holds the program,
the cases, the limits and, for the unshare backend, what to show of the host.
The reply on stdout is a ``repr()`` the host ``literal_eval``s:
``{"results": [(status, detail), ...]}`` or ``{"infra": message, "errno": n}``.

Every top-level ``_sr_*`` function is also pasted into the stand-alone
programs of ``sandbox.case_script()``, so both judge answers alike: keep them
self-contained.
"""

# Startup cost is per sample: stdlib modules only, and no json/re/traceback (the
# job arrives as marshal, results leave as a repr() the host literal_evals).
import _signal as signal  # type: ignore[import-not-found]  # signal would import enum: 4 ms per sample
import builtins
import gc
import marshal
import math
import os
import resource
import select
import sys
import time


# ---------------------------------------------------------------- judging answers
# Only exact plain types compare equal: an object whose __eq__ always returns True
# (a known reward hack) never matches.
def _sr_plain(x):
    if type(x) is tuple or type(x) is list:
        return [_sr_plain(v) for v in x]
    if type(x) is dict:
        return {k: _sr_plain(v) for k, v in x.items()}
    return x


def _sr_eq(a, b):
    ta, tb = type(a), type(b)
    if ta is list and tb is list:
        return len(a) == len(b) and all(_sr_eq(x, y) for x, y in zip(a, b))
    if ta is dict and tb is dict:
        return len(a) == len(b) and all(k in a and _sr_eq(a[k], b[k]) for k in b)
    if ta not in (bool, int, float, str, type(None)) or tb not in (bool, int, float, str, type(None)):
        return False
    if ta in (int, float) and tb in (int, float) and float in (ta, tb):
        return a == b or abs(a - b) <= 1e-9 + 1e-6 * abs(b)
    return ta is tb and a == b


def _sr_same(result, expected):
    result = _sr_plain(result)
    if _sr_eq(result, expected):
        return True
    return type(expected) is list and len(expected) > 0 and _sr_eq(result, expected[0])


def _sr_function(g, name):
    fn = g.get(name)
    if fn is None and isinstance(g.get("Solution"), type):
        fn = getattr(g["Solution"](), name, None)
    if fn is None:
        raise NameError(f"the program defines no function {name!r}")
    return fn


# ---------------------------------------------------------------- the harness
EXIT_MEMORY, EXIT_SETUP = 86, 87
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PRELOAD = ("collections", "itertools", "functools", "heapq", "bisect")  # cheap, and common in solutions
_libc = None


def _sys(name, *args):
    import ctypes

    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if getattr(_libc, name)(*args) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{name}{args[:2]}: {os.strerror(e)}")


def _b(s):
    return None if s is None else s.encode()


def _mount(src, dst, fstype, flags, data=None):
    import ctypes

    _sys("mount", _b(src), _b(dst), _b(fstype), ctypes.c_ulong(flags), _b(data))


def enter_new_root(job):
    # unshare backend: build a minimal read-only root like bwrap's, then chroot.
    if os.stat("/proc/self/ns/mnt").st_ino == job["host_mntns"]:
        raise SystemExit("refusing to mount: not in a private mount namespace")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    os.umask(0o022)
    sources = []
    for path in job["binds"]:
        if os.path.islink(path):
            sources.append((path, os.readlink(path), None))
        elif os.path.exists(path):
            sources.append((path, None, os.open(path, os.O_PATH)))
    devs = [(d, os.open(d, os.O_PATH)) for d in job["devices"]]
    new = "/tmp"  # any directory: the mount is private to this namespace
    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path, link, fd in sources:
        dst = new + path
        if link is not None:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.symlink(link, dst)
            continue
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(dst, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            open(dst, "w").close()
        _mount(f"/proc/self/fd/{fd}", dst, None, MS_BIND | MS_REC)
        _mount(None, dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
        os.close(fd)
    os.makedirs(new + "/dev", exist_ok=True)
    for dev, fd in devs:
        open(new + dev, "w").close()
        _mount(f"/proc/self/fd/{fd}", new + dev, None, MS_BIND)
        _mount(None, new + dev, None, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NOEXEC)
        os.close(fd)
    for name, target in job["dev_links"]:
        os.symlink(target, new + name)
    for d in ("/proc", "/tmp", "/dev/shm"):
        os.makedirs(new + d, exist_ok=True)
    _mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for d in ("/tmp", "/dev/shm"):
        _mount("tmpfs", new + d, "tmpfs", MS_NOSUID | MS_NODEV, f"size={job['tmp_mb']}m,mode=1777")
    _mount(None, new, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    os.chroot(new)
    os.chdir("/")


def emit(obj):
    sys.stdout.write(repr(obj))
    sys.stdout.flush()


def main():
    job = marshal.load(sys.stdin.buffer)  # follows the harness itself on stdin
    if job["isolation"] == "unshare":
        enter_new_root(job)
    os.chdir(job["workdir"])
    sys.path[:0] = job["sys_path"]
    if len(job["cases"]) > 1:
        for name in PRELOAD:
            __import__(name)
    gc.freeze()  # forked children then share these pages instead of copying them
    results = []
    for case in job["cases"]:
        try:
            results.append(run_case(job, case))
        except OSError as exc:  # pipe/fork/reap failed: the host is out of resources
            emit({"infra": f"{type(exc).__name__}: {exc}", "errno": exc.errno or 0})
            return
    emit({"results": results})


def run_case(job, case):
    stdin_fd = os.memfd_create("stdin")
    data = case.get("stdin", "").encode()
    view = memoryview(data)
    while view:
        view = view[os.write(stdin_fd, view) :]
    os.lseek(stdin_fd, 0, 0)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    ver_r, ver_w = os.pipe()
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        child(job, case, stdin_fd, out_w, err_w, ver_w)
    for fd in (stdin_fd, out_w, err_w, ver_w):
        os.close(fd)
    try:
        return supervise(job, case, pid, out_r, err_r, ver_r)
    finally:
        for fd in (out_r, err_r, ver_r):
            os.close(fd)


def supervise(job, case, pid, out_r, err_r, ver_r):
    lim = job["limits"]
    cap = lim["max_output_bytes"]
    bufs = {out_r: bytearray(), err_r: bytearray(), ver_r: bytearray()}
    total = 0
    pidfd = os.pidfd_open(pid)
    poller = select.poll()
    for fd in (out_r, err_r, ver_r, pidfd):
        poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + lim["timeout_s"]
    status, exited = None, False
    try:
        while status is None and not exited:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                status = "timeout"
                break
            for fd, _ in poller.poll(max(1, int(remaining * 1000) + 1)):
                if fd == pidfd:
                    exited = True
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    poller.unregister(fd)
                    continue
                total += len(chunk)
                if total > cap:
                    status = "output_limit"
                    break
                bufs[fd] += chunk
    finally:
        os.close(pidfd)
    if not exited:
        os.kill(pid, signal.SIGKILL)
    _, wstatus, usage = os.wait4(pid, 0)
    kill_all(job, pid)
    for fd in bufs:  # every writer is dead now: what is left in the pipes is finite
        os.set_blocking(fd, False)
        while status is None:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            total += len(chunk)
            if total > cap:
                status = "output_limit"
            bufs[fd] += chunk
    err = bytes(bufs[err_r][-4096:]).decode("utf-8", "replace")
    if status is not None:
        return status, ""
    detail = (err.strip().splitlines() or [""])[-1][:300]
    if os.WIFSIGNALED(wstatus):
        sig = os.WTERMSIG(wstatus)
        cpu = usage.ru_utime + usage.ru_stime
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= math.ceil(lim["cpu_s"]) - 0.05):
            return "timeout", "cpu time limit"
        return "runtime_error", f"killed by signal {sig}"
    code = os.WEXITSTATUS(wstatus)
    if code == EXIT_SETUP:
        raise OSError(0, "the case process could not set its limits or drop privileges")
    if code == EXIT_MEMORY or "MemoryError" in err:
        return "memory", detail
    if code != 0:
        return "runtime_error", detail
    if job["form"] == "stdin":
        ok = normalize(bytes(bufs[out_r])) == normalize(case["stdout"].encode())
        return ("passed", "") if ok else ("failed", "wrong answer")
    verdict = bytes(bufs[ver_r])
    if verdict[:1] == b"P":
        return "passed", ""
    if verdict[:1] == b"F":
        return "failed", verdict[1:].decode("utf-8", "replace")[:300]
    return "failed", "the program exited before the tests ran"


def normalize(raw):
    lines = [line.rstrip() for line in raw.decode("utf-8", "replace").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def kill_all(job, pid):
    if not job["pidns"]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        return
    # kill(-1) reaches every process of this PID namespace we may signal (all case
    # processes, setsid'd or not) but never init or ourselves.
    me, deadline = str(os.getpid()), time.monotonic() + 5
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        if not [p for p in os.listdir("/proc") if p.isdigit() and p != "1" and p != me]:
            return
        if time.monotonic() > deadline:
            raise OSError(0, "sandboxed processes survived SIGKILL")
        time.sleep(0.0005)


def child(job, case, stdin_fd, out_w, err_w, ver_w):
    try:
        os.setsid()
        os.dup2(stdin_fd, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.dup2(ver_w, 3, inheritable=False)
        os.closerange(4, 1 << 16)
        lim = job["limits"]
        cpu = math.ceil(lim["cpu_s"])
        setlimit(resource.RLIMIT_CPU, cpu, cpu + 1)
        setlimit(resource.RLIMIT_AS, lim["memory_mb"] << 20)
        setlimit(resource.RLIMIT_FSIZE, lim["max_file_mb"] << 20)
        setlimit(resource.RLIMIT_CORE, 0)
        if job["pidns"]:
            setlimit(resource.RLIMIT_NPROC, lim["max_procs"])
        uid = job["uid"]
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            if os.geteuid() != uid or os.getuid() != uid:
                raise OSError("uid drop failed")
        if job["isolation"] == "unshare":
            _sys("prctl", 38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS (bwrap sets it itself)
        sys.stdin = open(0, encoding="utf-8", errors="replace", closefd=False)
        sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        sys.argv = ["solution.py"]
    except BaseException:
        os._exit(EXIT_SETUP)
    code = 1
    try:
        code = execute(job, case)
        sys.stdout.flush()
        sys.stderr.flush()
    except MemoryError:
        code = EXIT_MEMORY
    except BaseException:
        pass
    os._exit(code)


def setlimit(kind, soft, hard=None):
    hard = soft if hard is None else hard
    _, cur_hard = resource.getrlimit(kind)
    if cur_hard != resource.RLIM_INFINITY:
        soft, hard = min(soft, cur_hard), min(hard, cur_hard)
    resource.setrlimit(kind, (soft, hard))


def exit_code(exc):
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def execute(job, case):
    form = job["form"]
    g = {"__name__": "__main__" if form == "stdin" else "solution", "__builtins__": builtins}
    try:
        try:
            exec(compile(job["program"], "solution.py", "exec"), g)
        except SystemExit as exc:
            code = exit_code(exc)
            if form == "stdin" or code:
                return code
        if form == "stdin":
            return 0
        try:
            if form == "call":
                result = _sr_function(g, case["fn_name"])(*case["args"])
                ok = _sr_same(result, case["expected"])
                message = "" if ok else f"expected {case['expected']!r:.120}, got {result!r:.120}"
            elif form == "assert":
                exec(compile(case["assert"], "test.py", "exec"), g)
                ok, message = True, ""
            else:
                exec(compile(case["test"], "test.py", "exec"), g)
                g["check"](g[case["entry_point"]])
                ok, message = True, ""
        except AssertionError as exc:
            ok, message = False, f"assertion failed {exc}".strip()
        os.write(3, (b"P" if ok else b"F") + message.encode("utf-8", "replace")[:300])
        return 0
    except SystemExit as exc:
        return exit_code(exc)
    except MemoryError:
        return EXIT_MEMORY
    except BaseException:
        import traceback

        traceback.print_exc()
        return 1


if __name__ == "__main__":
    main()
    os._exit(0)  # skip interpreter teardown: nothing is left to clean up
