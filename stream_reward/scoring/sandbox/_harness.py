"""The in-sandbox harness: a pre-imported interpreter that runs candidate programs,
one fresh process per test case, and judges nothing.

It starts once per sandbox slot (``python -I -S -c BOOT`` inside bwrap or
unshare), reads a boot job, imports the common modules, and then serves cases
for as long as the slot lives, so a case costs a clone() instead of an
interpreter start. It runs as root (in the sandbox); candidate processes never
do. The host sends ``wire`` and ``_serve`` (the calls of the
check, assert and call forms) in front of this source; nothing from
stream_reward is importable here.

Wire: frames of a 4-byte little-endian length and a body, on stdin (host ->
harness, ``marshal``; the host is trusted) and stdout (harness -> host, JSON;
the host parses it as untrusted text).

Per case the harness clones a child into new namespaces (when the sandbox
allows it), born in the slot's memory and pids cgroups (the harness joined them
at boot): the child (in new PID, mount, IPC and network namespaces) makes itself
the OOM killer's first pick over the harness, mounts a fresh read-only /proc and
fresh /tmp and /dev/shm, sets rlimits, drops to the slot's unprivileged uid (or
drops every capability without root), sets no_new_privs, installs the seccomp
filter, reports "setup done" on a private pipe that it then
closes, and only then runs the program. Being PID 1 of its namespace, its death
takes every process it started with it; it cannot see the harness at all.

Modes of a case:

``stdin``  run the program with the case's stdin; report exit status and output.
``calls``  load the program, then call functions with plain-data arguments the
           host sent (the call form); report each reply (``sandbox_wire`` bytes).
``serve``  load the program, report its top-level functions and classes, then
           serve calls relayed from the trusted checker until the host says
           ``end`` (the check and assert forms).

Nothing the candidate writes is a verdict: replies are data the trusted side
decodes and judges; the candidate's exit code means only "exited".
"""

# Startup cost is per slot, not per sample, but keep the import list to the stdlib.
import _signal as signal  # type: ignore[import-not-found]  # signal would import enum
import builtins
import ctypes
import fcntl
import gc
import json as _json
import marshal
import os
import resource
import select
import sys
import time

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWIPC, CLONE_NEWNET, SIGCHLD = 0x00020000, 0x20000000, 0x08000000, 0x40000000, 17
# A case's own IPC namespace too: SysV shared memory and message queues outlive
# their processes, and would carry state (and memory charges) into later cases.
# The network namespace is the harness's, shared by its cases while they leave
# nothing in it: with the seccomp filter a case can make only unix sockets, and
# those die with its processes, except one left in flight (sent over a socket that
# is itself in flight), which outlives them until the kernel's collector gets to
# it. After a case that left any, the harness moves to a fresh namespace
# (``fresh_network``): a new one per case would cost ~1 ms of setup and teardown
# each. Without the filter (IP sockets: TIME_WAIT ports, packet counters) every
# case gets its own.
CASE_NAMESPACES = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC
SYS_CLONE = {"x86_64": 56, "aarch64": 220}
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 38, 22, 4, 36
PR_CAPBSET_DROP = 24

if "Server" not in globals():  # run on its own; the host normally sends wire.py and _serve.py ahead
    from stream_reward.scoring.sandbox._serve import Server, global_names, reply
PRELOAD = ("collections", "itertools", "functools", "heapq", "bisect", "math", "re", "string", "typing", "traceback")

_libc = ctypes.CDLL(None, use_errno=True)
_pylibc = ctypes.PyDLL(None, use_errno=True)  # holds the GIL across clone()
_pylibc.syscall.restype = ctypes.c_long


def _sys(name, *args):
    if getattr(_libc, name)(*args) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{name}: {os.strerror(e)}")


def _b(s):
    return None if s is None else s.encode()


def _mount(src, dst, fstype, flags, data=None):
    _sys("mount", _b(src), _b(dst), _b(fstype), ctypes.c_ulong(flags), _b(data))


# ---------------------------------------------------------------- frames


def read_exact(fd, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def read_frame(fd):
    head = read_exact(fd, 4)
    if head is None:
        return None
    return read_exact(fd, int.from_bytes(head, "little"))


def write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def frame(data):
    return len(data).to_bytes(4, "little") + data


def send(obj):
    write_all(1, frame(_json.dumps(obj).encode()))


def text(raw):
    return raw.decode("utf-8", "surrogateescape")


# ---------------------------------------------------------------- the unshare backend's root


def enter_new_root(boot):
    # unshare backend: build a minimal read-only root like bwrap's, then chroot.
    if os.stat("/proc/self/ns/mnt").st_ino == boot["host_mntns"]:
        raise SystemExit("refusing to mount: not in a private mount namespace")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    os.umask(0o022)
    sources = []
    for path in boot["binds"]:
        if os.path.islink(path):
            sources.append((path, os.readlink(path), None))
        elif os.path.exists(path):
            sources.append((path, None, os.open(path, os.O_PATH)))
    devs = [(d, os.open(d, os.O_PATH)) for d in boot["devices"]]
    new = "/tmp"  # any directory: the mount is private to this namespace
    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    # /tmp and /dev/shm first: a bind below them (a venv in a temporary directory)
    # then lands on top of their tmpfs instead of under it.
    for d in ("/tmp", "/dev/shm"):
        os.makedirs(new + d, exist_ok=True)
        _mount("tmpfs", new + d, "tmpfs", MS_NOSUID | MS_NODEV, f"size={boot['tmp_mb']}m,mode=1777")
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
    for name, target in boot["dev_links"]:
        os.symlink(target, new + name)
    os.makedirs(new + "/proc", exist_ok=True)
    _mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount(None, new, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    os.chroot(new)
    os.chdir("/")


# ---------------------------------------------------------------- main loop


def main():
    boot = marshal.loads(read_frame(0))
    if boot["isolation"] == "unshare":
        enter_new_root(boot)
    sys.path[:0] = boot["sys_path"]
    # An import path under /tmp or /dev/shm (a venv in a temporary directory, as on a
    # CI runner) would be hidden by each case's own tmpfs there: each case binds it
    # again inside its tmpfs, or a right answer that imports numpy would score 0.
    boot["hidden_paths"] = [
        path for path in boot["sys_path"] if path.startswith(("/tmp/", "/dev/shm/")) and os.path.isdir(path)
    ]
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    # Candidates of a non-root sandbox share our uid: not dumpable keeps our fds
    # and memory out of their reach even if they could name our pid.
    _sys("prctl", PR_SET_DUMPABLE, 0, 0, 0, 0)
    _sys("prctl", PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans come back to us (no-namespace mode)
    if boot["per_case_ns"] and os.uname().machine not in SYS_CLONE:
        boot["per_case_ns"] = False
    # What site would have given a program (the slot runs ``-S``): ``exit()`` and
    # ``quit()`` end a program as they do under a plain ``python solution.py``.
    import _sitebuiltins

    builtins.exit = _sitebuiltins.Quitter("exit", "Ctrl-D (i.e. EOF)")
    builtins.quit = _sitebuiltins.Quitter("quit", "Ctrl-D (i.e. EOF)")
    # The first ``compile()`` of an interpreter builds its ~120 AST node types (in
    # 3.11 about a millisecond, a fifth of a short case's CPU): built here once, each
    # case inherits them.
    compile("", "solution.py", "exec")
    gc.collect()
    gc.freeze()  # children share these pages instead of copying them
    # Into the slot's memory and pids groups once, here, so that each case is born in
    # them: moving a process into a cgroup waits for an RCU grace period (~10 ms) unless
    # moves come back to back, a stall every case longer than a few milliseconds paid
    # when each case moved itself. What we loaded so far stays charged where it was.
    for fd in boot.get("cgroup_fds", ()):
        os.write(fd, b"0")
    send({"ev": "ready", "per_case_ns": boot["per_case_ns"]})
    while True:
        raw = read_frame(0)
        if raw is None:
            os._exit(0)
        msg = marshal.loads(raw)
        if msg["op"] == "case":
            try:
                unstage(msg)
                send(run_case(boot, msg))
                fresh_network(boot)
            except OSError as exc:  # pipe/clone/reap failed: the host's fault, not the program's
                send({"ev": "infra", "error": f"{type(exc).__name__}: {exc}", "errno": exc.errno or 0})
        elif msg["op"] == "exit":
            os._exit(0)
        # a late "call"/"end" for a case that already ended: nothing to do


# The last compiled program's files, kept between its cases (and samples): the host
# sends a program's artifact once per slot, not once per case.
STAGED: dict[str, list] = {}


def unstage(msg):
    """An ``exec`` case names its files by ``stage`` (keep them) or ``staged`` (the
    kept ones); the host tracks which program this harness keeps."""
    job = msg.get("exec")
    if not job:
        return
    if "stage" in job:
        STAGED.clear()
        STAGED[job["stage"]] = job["files"]
    elif "staged" in job:
        if job["staged"] not in STAGED:
            raise OSError(0, "no staged program " + str(job["staged"])[:16])
        job["files"] = STAGED[job["staged"]]


def oom_kills(boot):
    fd = boot.get("oom_fd")
    if fd is None:
        return 0
    try:
        os.lseek(fd, 0, 0)
        for line in os.read(fd, 4096).decode().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def spawn(boot):
    if boot["per_case_ns"]:
        flags = CASE_NAMESPACES if boot.get("seccomp") else CASE_NAMESPACES | CLONE_NEWNET
        pid = _pylibc.syscall(SYS_CLONE[os.uname().machine], ctypes.c_ulong(flags | SIGCHLD), 0, 0, 0, 0)
        if pid < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"clone: {os.strerror(e)}")
        return pid
    return os.fork()


def fresh_network(boot):
    """After a case whose processes are all gone: a unix socket still in our network
    namespace is one the case left in flight, so the next case gets a new namespace."""
    if not (boot["per_case_ns"] and boot.get("seccomp")):
        return  # no namespaces to make, or each case has a namespace of its own
    try:
        with open("/proc/self/net/unix", "rb") as f:
            left = f.read().count(b"\n") > 1  # a header line, then one line per socket
    except OSError:
        left = True
    if left:
        _sys("unshare", CLONE_NEWNET)


def run_case(boot, msg):
    stdin_fd = os.memfd_create("stdin")
    write_all(stdin_fd, msg.get("stdin", b""))
    os.lseek(stdin_fd, 0, 0)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    set_r, set_w = os.pipe()
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    ooms = oom_kills(boot)
    if not boot["per_case_ns"]:  # no mount namespace: a fresh directory stands in for /tmp
        import tempfile

        msg["workdir"] = tempfile.mkdtemp(prefix="stream-reward-case-")
        if boot["uid"] is not None:
            os.chown(msg["workdir"], boot["uid"], boot["uid"])
    sys.stdout.flush()
    pid = spawn(boot)
    if pid == 0:
        candidate(boot, msg, stdin_fd, out_w, err_w, set_w, req_r, rep_w)
    for fd in (stdin_fd, out_w, err_w, set_w, req_r, rep_w):
        os.close(fd)
    try:
        return supervise(boot, msg, pid, out_r, err_r, set_r, req_w, rep_r, ooms)
    finally:
        for fd in (out_r, err_r, set_r, req_w, rep_r):
            try:
                os.close(fd)
            except OSError:
                pass
        if "workdir" in msg:
            import shutil

            shutil.rmtree(msg["workdir"], ignore_errors=True)


def supervise(boot, msg, pid, out_r, err_r, set_r, req_w, rep_r, ooms):
    lim = msg["limits"]
    cap = lim["max_output_bytes"]
    mode = msg["mode"]
    deadline = time.monotonic() + msg["timeout_s"]
    # setup first: its failure is ours (infra), whatever the exit code
    setup = b""
    while True:
        ready, _, _ = select.select([set_r], [], [], max(0.0, deadline + 5 - time.monotonic()))
        if not ready:
            break
        chunk = os.read(set_r, 4096)
        if not chunk:
            break
        setup += chunk
    if setup[:1] != b"K":
        kill_case(boot, pid)
        os.wait4(pid, 0)
        if setup[:1] == b"E":
            raise OSError(0, "case setup failed: " + setup[1:].decode("utf-8", "replace"))
        raise OSError(0, "case process died during setup")
    bufs = {out_r: bytearray(), err_r: bytearray()}
    rep_buf = bytearray()
    replies = []
    # A cap per stream: what a program writes to stderr must not cost it its stdout.
    totals = {out_r: 0, err_r: 0, rep_r: 0}
    pending = bytearray()  # requests for the candidate not yet written
    os.set_blocking(req_w, False)
    pidfd = os.pidfd_open(pid)
    poller = select.poll()
    for fd in (out_r, err_r, rep_r, pidfd):
        poller.register(fd, select.POLLIN)
    if mode == "serve":
        poller.register(0, select.POLLIN)
    status, exited, ended = None, False, False
    try:
        while status is None and not exited and not ended:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                status = "timeout"
                break
            for fd, _ in poller.poll(max(1, int(remaining * 1000) + 1)):
                if fd == pidfd:
                    exited = True
                elif fd == 0:
                    raw = read_frame(0)
                    if raw is None:
                        os._exit(0)  # the host is gone
                    cmd = marshal.loads(raw)
                    if cmd["op"] == "end":
                        ended = True
                    elif cmd["op"] == "call":
                        pending += frame(cmd["data"])
                        poller.register(req_w, select.POLLOUT)
                elif fd == req_w:
                    try:
                        del pending[: os.write(req_w, pending)]
                    except BlockingIOError:
                        pass
                    except OSError:
                        pending.clear()  # the candidate closed its end: it will be reported gone
                    if not pending:
                        poller.unregister(req_w)
                else:
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        poller.unregister(fd)
                        continue
                    totals[fd] += len(chunk)
                    if totals[fd] > cap:
                        status = "output_limit"
                        break
                    if fd != rep_r:
                        bufs[fd] += chunk
                        continue
                    rep_buf += chunk
                    while len(rep_buf) >= 4 and len(rep_buf) >= 4 + int.from_bytes(rep_buf[:4], "little"):
                        n = int.from_bytes(rep_buf[:4], "little")
                        body = bytes(rep_buf[4 : 4 + n])
                        del rep_buf[: 4 + n]
                        if mode == "serve":
                            send({"ev": "msg", "data": text(body)})
                        else:
                            replies.append(text(body))
    finally:
        os.close(pidfd)
    kill_case(boot, pid)
    _, wstatus, usage = os.wait4(pid, 0)
    reap_orphans(boot)
    for fd in bufs:  # every writer is dead now: what is left in the pipes is finite
        os.set_blocking(fd, False)
        while status is None:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            totals[fd] += len(chunk)
            if totals[fd] > cap:
                status = "output_limit"
            bufs[fd] += chunk
    if status is None and oom_kills(boot) > ooms:
        status = "memory"
    err = text(bytes(bufs[err_r][-4096:]))
    report = {"ev": "done", "status": status, "stdout": text(bytes(bufs[out_r])), "err": err, "replies": replies}
    if status is None and not ended:
        if os.WIFSIGNALED(wstatus):
            sig = os.WTERMSIG(wstatus)
            cpu = usage.ru_utime + usage.ru_stime
            if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= lim["cpu_s"] - 0.05):
                report["status"] = "timeout"
            report["signal"] = sig
        else:
            report["exit"] = os.WEXITSTATUS(wstatus)
    return report


def kill_case(boot, pid):
    # With a namespace per case the child is its PID 1: killing it ends them all.
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
    if not boot["per_case_ns"]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        for other in descendants(os.getpid()):
            try:
                os.kill(other, signal.SIGKILL)
            except OSError:
                pass


def descendants(root):
    found, todo = [], [root]
    while todo:
        parent = todo.pop()
        try:
            for task in os.listdir(f"/proc/{parent}/task"):
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    kids = [int(k) for k in f.read().split()]
                found += kids
                todo += kids
        except (OSError, ValueError):
            pass
    return found


def reap_orphans(boot):
    if boot["per_case_ns"]:
        return
    deadline = time.monotonic() + 5
    while True:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return
        if time.monotonic() > deadline:
            raise OSError(0, "sandboxed processes survived SIGKILL")
        for other in descendants(os.getpid()):
            try:
                os.kill(other, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.0005)


# ---------------------------------------------------------------- the candidate process


def setlimit(kind, soft, hard=None):
    hard = soft if hard is None else hard
    _, cur_hard = resource.getrlimit(kind)
    if cur_hard != resource.RLIM_INFINITY:
        soft, hard = min(soft, cur_hard), min(hard, cur_hard)
    resource.setrlimit(kind, (soft, hard))


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_all_caps():
    # Root inside a user namespace (the non-root sandbox) cannot change uid: it
    # gives up every capability instead (and the bounding set where it may:
    # that needs CAP_SETPCAP; no_new_privs already keeps exec from granting any).
    for cap in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == 22:  # EINVAL: no such cap
            break
    header = _CapHeader(0x20080522, 0)
    data = (_CapData * 2)()
    _sys("capset", ctypes.byref(header), ctypes.byref(data))


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def install_seccomp(prog):
    fprog = _SockFprog(len(prog) // 8, prog)
    _sys("prctl", PR_SET_SECCOMP, 2, ctypes.byref(fprog), 0, 0)


def candidate(boot, msg, stdin_fd, out_w, err_w, set_w, req_r, rep_w):
    try:
        tmp_opts = f"size={boot['tmp_mb']}m,mode=1777"
        if boot.get("cgroup_fds"):
            # The harness shares the slot's groups: at the memory limit the OOM killer
            # must take the case's processes, never the harness. Written through the
            # harness's /proc: a process may lower it back to the harness's floor
            # without privilege (only CAP_SYS_RESOURCE moves the floor), so the case's
            # own /proc is read-only and none of its processes can write it.
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")
        if boot["per_case_ns"]:
            _mount(None, "/", None, MS_REC | MS_PRIVATE)
            _mount("proc", "/proc", "proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
            # held open in this namespace (a bind's source must be a mount of the caller's)
            hidden = [(path, os.open(path, os.O_PATH)) for path in boot.get("hidden_paths", ())]
            for d in ("/tmp", "/dev/shm"):
                _mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, tmp_opts)
            for path, fd in hidden:
                os.makedirs(path, exist_ok=True)
                _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
                _mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
            os.chdir("/tmp")
        else:
            os.setsid()
            os.chdir(msg["workdir"])
        # Lift every source above the targets first, so no dup2 closes a source
        # that has not been moved yet.
        sources = [fcntl.fcntl(fd, fcntl.F_DUPFD, 64) for fd in (stdin_fd, out_w, err_w, req_r, rep_w, set_w)]
        for target, fd in enumerate(sources):
            os.dup2(fd, target)
        os.closerange(6, 1 << 16)
        lim = msg["limits"]
        cpu = max(1, int(lim["cpu_s"] + 0.999))
        setlimit(resource.RLIMIT_CPU, cpu, cpu + 1)
        if lim.get("address_space", True):
            setlimit(resource.RLIMIT_AS, lim["memory_mb"] << 20)
        setlimit(resource.RLIMIT_FSIZE, lim["max_file_mb"] << 20)
        setlimit(resource.RLIMIT_CORE, 0)
        if not boot.get("cgroup_fds"):
            # Without a pids cgroup: RLIMIT_NPROC, per real uid (the slot's own when
            # root, where it is honoured; the worker's user otherwise).
            setlimit(resource.RLIMIT_NPROC, lim["max_procs"])
        uid = boot["uid"]
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            if os.geteuid() != uid or os.getuid() != uid:
                raise OSError("uid drop failed")
        elif boot["drop_caps"]:
            drop_all_caps()
        _sys("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        if boot.get("seccomp"):
            install_seccomp(boot["seccomp"])
        sys.stdin = open(0, encoding="utf-8", errors="replace", closefd=False)
        sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        sys.argv = ["solution.py"]
        import atexit

        atexit._clear()  # the harness's, if it had any: not the program's to run
        os.write(5, b"K")
        os.close(5)
    except BaseException as exc:
        try:
            os.write(5, b"E" + f"{type(exc).__name__}: {exc}".encode()[:500])
        finally:
            os._exit(1)
    code = 1
    try:
        code = execute(msg)
    except BaseException:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(code)


def shut_down(code):
    """The end of a plain ``python solution.py`` run, as the interpreter's own
    finalisation does it: wait for the threads that are not daemons, then the
    ``atexit`` handlers; what they print is the program's output. A thread that
    never ends keeps the case running until its time limit, as it would keep the
    program. Only the program's own handlers run: the harness registered none (it
    clears the table it inherited, to be sure)."""
    threading = sys.modules.get("threading")
    if threading is not None:
        try:
            threading._shutdown()
        except SystemExit as exc:
            code = exit_code(exc)
        except BaseException:
            report_error()
    import atexit

    atexit._run_exitfuncs()  # prints what a handler raises, as the interpreter does
    return code


def exit_code(exc):
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def report_error():
    import traceback

    traceback.print_exc()


def execute(msg):
    mode = msg["mode"]
    if mode == "exec":
        return run_exec(msg["exec"])
    g = {"__name__": "__main__" if mode == "stdin" else "solution", "__builtins__": builtins}
    here = os.getcwd()
    if msg.get("files") and not put_files(msg["files"]):
        return 1
    code = None
    if mode == "stdin" and hasattr(sys, "set_int_max_str_digits"):
        # As on the judges the tasks come from (and LiveCodeBench's harness): printing
        # a 5,000-digit answer is no error. Only the program's own process is affected.
        sys.set_int_max_str_digits(0)
    try:
        exec(compile(msg["program"], "solution.py", "exec"), g)
    except SystemExit as exc:
        code = exit_code(exc)
    except BaseException:
        report_error()
        code = 1
    if mode == "stdin":
        return fetch_files(msg, here, shut_down(code or 0))
    if code is not None:  # the program ended before the tests could reach it
        return fetch_files(msg, here, code)
    server = Server(g, refs=mode == "serve")
    reply(("ready", global_names(g)))
    if mode == "calls":
        for fn_name, args in msg["calls"]:
            server.send(server.serve_one(("call", fn_name, None, args, {})))
        return 0
    server.serve()
    return 0


def run_exec(job):
    """``exec`` mode (compiled languages): write ``files`` (``(name, bytes, mode)``)
    and run ``steps`` (argv lists) in turn with ``env``. With ``collect`` (a compile),
    reply with every regular file of that directory once the steps succeed; a
    lone step without it replaces this process (a run: its exit is the case's)."""
    for name in job.get("dirs", ()):
        os.makedirs(name, exist_ok=True)
    for name, data, mode in job["files"]:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
        try:
            write_all(fd, data)
        finally:
            os.close(fd)
    for fd in (3, 4):  # the programs we start get no channel to the host
        os.set_inheritable(fd, False)
    env, steps, collect = job["env"], job["steps"], job.get("collect")
    if collect is None and len(steps) == 1:
        try:
            os.execve(steps[0][0], steps[0], env)
        except OSError as exc:
            os.write(2, f"cannot execute {steps[0][0]}: {exc}\n".encode())
            return 127
    for argv in steps:
        pid = os.fork()
        if pid == 0:
            try:
                os.execve(argv[0], argv, env)
            except OSError as exc:
                os.write(2, f"cannot execute {argv[0]}: {exc}\n".encode())
            os._exit(127)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 127 and not os.access(argv[0], os.X_OK):
                reply(("missing", argv[0]))  # the tool is not in the sandbox: the host's fault
            return os.WEXITSTATUS(status) if os.WIFEXITED(status) and os.WEXITSTATUS(status) else 1
    if collect is not None:
        found = {}
        for name in sorted(os.listdir(collect)):
            path = os.path.join(collect, name)
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, "rb") as f:
                    found[name] = f.read()
        reply(("files", found))
    return 0


def put_files(files):
    """The request's files, written in the case's fresh working directory as the
    candidate's uid (the host checked the names: relative, no "..")."""
    for name, data in files:
        try:
            parent = os.path.dirname(name)
            if parent:
                os.makedirs(parent, exist_ok=True)
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            try:
                write_all(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:
            os.write(2, f"cannot write {name}: {exc}\n".encode())
            return False
    return True


def fetch_files(msg, here, code):
    """After the program ended (returned, exit() or an exception; not os._exit, a
    kill or the deadline): the regular files it was asked for, as a reply."""
    names = msg.get("fetch")
    if names:
        found = {}
        for name in names:
            try:
                # non-blocking: a FIFO of that name must not hang the case
                fd = os.open(os.path.join(here, name), os.O_RDONLY | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                if (os.fstat(fd).st_mode & 0o170000) == 0o100000:  # S_IFREG
                    chunks = []
                    while True:
                        chunk = os.read(fd, 1 << 20)
                        if not chunk:
                            break
                        chunks.append(chunk)
                    found[name] = b"".join(chunks)
            except OSError:
                pass
            finally:
                os.close(fd)
        try:
            reply(("files", found))
        except OSError:
            pass
    return code


if __name__ == "__main__":
    main()
