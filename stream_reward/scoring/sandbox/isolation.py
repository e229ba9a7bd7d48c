"""Keeping a sandbox apart from the host: the backend and its command line, the
environment, per-case uids, and teardown.

Backends, detected once per process (``choose_backend``):

``bwrap``
    ``bwrap --unshare-pid --unshare-net --unshare-ipc --unshare-uts
    --unshare-cgroup-try --die-with-parent --new-session`` with a minimal root
    (read-only binds of /usr, a few /etc files, the Python prefixes; a fresh
    /proc; /dev with null, zero, full, random, urandom only; size-capped tmpfs
    on /tmp and /dev/shm; the root itself remounted read-only) and, when we are
    root, ``--cap-drop ALL`` plus only CAP_SETUID/CAP_SETGID/CAP_KILL/
    CAP_SYS_ADMIN for the harness (it mounts a fresh /proc, /tmp and /dev/shm in
    a new PID and mount namespace per case; case processes keep none of them).
    As root we deliberately do *not* create a user namespace: bwrap would map
    sandbox uid 0 to host uid 0, and the sandboxed program could read root-only
    files. Without root, bwrap runs unprivileged with ``--unshare-user --uid 0``
    and CAP_SYS_ADMIN inside that namespace; case processes drop every
    capability, and their own PID namespace keeps the harness out of their reach.
``unshare``
    util-linux ``unshare --pid --fork --kill-child --mount --net --ipc --uts``;
    the harness (root inside) builds the same minimal read-only root itself with
    mount(2) and chroot(2), from ``root_spec()``. Needs root.
``none``
    No isolation at all; only with ``unsafe_no_isolation``.

Each sandbox slot's case processes run under an exclusive uid leased from
``uid_base .. uid_base + uid_count`` (``UIDS``: flock'd lock files, so
concurrent sandboxes, scorers and worker processes never share one): without a
pids cgroup, RLIMIT_NPROC counts processes per uid, so a fork bomb in one
sandbox cannot starve the others. Killing the backend's process group takes the
namespace down with it.

Every sandboxed process carries ``MARKER`` in its command line and the scorer's
pid in ``$STREAM_REWARD_SANDBOX_OWNER`` (``OWNER_ENV``), so leaks are easy to
look for.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from stream_reward.config import SandboxConfig
from stream_reward.errors import ConfigError, VerifierError

__all__ = [
    "MARKER",
    "OWNER_ENV",
    "OUT_OF_RESOURCES",
    "sandbox_env",
    "choose_backend",
    "wrap_command",
    "root_spec",
    "UIDS",
    "kill_tree",
    "uid_alive",
]

MARKER = "stream-reward-sandbox"  # in every sandboxed process's cmdline; tests look for it
OWNER_ENV = "STREAM_REWARD_SANDBOX_OWNER"  # the scorer's pid, in every sandboxed process's environment
OUT_OF_RESOURCES = {errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE}  # errnos of a host, not a sandbox, fault

_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
_DEV_LINKS = (
    ("/dev/fd", "/proc/self/fd"),
    ("/dev/stdin", "/proc/self/fd/0"),
    ("/dev/stdout", "/proc/self/fd/1"),
    ("/dev/stderr", "/proc/self/fd/2"),
)
# All the sandbox sees of /etc (each bind costs ~0.1 ms a sample; add more with
# SandboxConfig.extra_ro_binds).
_ETC = ("/etc/ld.so.cache", "/etc/localtime", "/etc/passwd", "/etc/group")


def sandbox_env() -> dict[str, str]:
    # Nothing of the host's environment (API keys!) reaches the sandbox.
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": "/tmp",
        "PYTHONHASHSEED": "0",
        OWNER_ENV: str(os.getpid()),
    }


# ---------------------------------------------------------------- backend selection

_PROBED: dict[tuple[Any, ...], str | None] = {}  # backend probe results, once per process


def choose_backend(config: SandboxConfig, *, root: bool, probe: Callable[[str], str | None]) -> str:
    """The first usable backend ``config`` allows. ``probe(backend)`` runs a real
    program in it and returns what went wrong, or None; its answer is kept for
    the life of the process."""
    wanted = ["bwrap", "unshare"] if config.backend == "auto" else [config.backend]
    problems = []
    for backend in wanted:
        if backend == "none":
            break
        problem = _problem(config, backend, root, probe)
        if problem is None:
            return backend
        problems.append(f"{backend}: {problem}")
    if config.unsafe_no_isolation:
        return "none"
    raise ConfigError(
        "backend",
        "no sandbox is available to run untrusted code ("
        + ("; ".join(problems) or "backend 'none' requested")
        + "). Install bubblewrap or run as root for the unshare backend; "
        "unsafe_no_isolation=True runs code unsandboxed.",
    )


def _problem(config: SandboxConfig, backend: str, root: bool, probe: Callable[[str], str | None]) -> str | None:
    tool = config.bwrap_path if backend == "bwrap" else config.unshare_path
    if shutil.which(tool) is None:
        return f"{tool!r} not found"
    if backend == "unshare" and not root:
        return "needs root"
    key = (backend, tool, config.python, root)
    if key not in _PROBED:
        _PROBED[key] = probe(backend)
    return _PROBED[key]


# ---------------------------------------------------------------- command lines


def _ro_binds(config: SandboxConfig) -> list[str]:
    paths = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", *_ETC]
    python_dirs = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(os.path.realpath(config.python)))}
    if os.path.dirname(config.python) not in ("/usr/bin", "/bin"):
        python_dirs.add(os.path.dirname(os.path.abspath(config.python)))
    for extra in sorted(p for p in python_dirs if p and p != "/"):
        if not any(extra == p or extra.startswith(p.rstrip("/") + "/") for p in paths):
            paths.append(extra)
    return paths + list(config.extra_ro_binds)


def root_spec(config: SandboxConfig) -> dict[str, Any]:
    """What the harness needs to build the unshare backend's root itself."""
    return {
        "binds": _ro_binds(config),
        "devices": _DEVICES,
        "dev_links": _DEV_LINKS,
        "tmp_mb": config.tmp_mb,
        "host_mntns": os.stat("/proc/self/ns/mnt").st_ino,  # the harness refuses to mount in it
    }


def wrap_command(config: SandboxConfig, backend: str, command: list[str], *, root: bool) -> list[str]:
    """``command`` run inside ``backend``."""
    if backend == "none":
        return command
    if backend == "unshare":
        return [
            config.unshare_path,
            "--pid",
            "--fork",
            "--kill-child",
            "--mount",
            "--propagation",
            "private",
            "--net",
            "--ipc",
            "--uts",
            "--",
            *command,
        ]
    argv = [
        config.bwrap_path,
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--new-session",
    ]
    if root:
        # SYS_ADMIN: the harness mounts a fresh /proc, /tmp and /dev/shm per case in
        # a new mount and PID namespace; case processes drop every capability.
        argv += ["--cap-drop", "ALL"]
        for cap in ("CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_SYS_ADMIN"):
            argv += ["--cap-add", cap]
    else:
        # Root of a user namespace of our own, for the same per-case namespaces;
        # case processes give up every capability (they cannot change uid here).
        argv += ["--unshare-user", "--uid", "0", "--gid", "0", "--cap-add", "CAP_SYS_ADMIN"]
    # /tmp and /dev/shm first: a bind below them (a venv in a temporary directory, as on
    # a CI runner) then lands on top of their tmpfs instead of being hidden by it.
    for tmp in ("/tmp", "/dev/shm"):
        argv += ["--size", str(config.tmp_mb << 20), "--perms", "1777", "--tmpfs", tmp]
    binds = _ro_binds(config)
    # bwrap creates missing parents of a bind target 0700 (as root), which would
    # hide e.g. /root/.pyenv/... from the sandbox uid: create them 0755 first.
    parents = {os.path.dirname(p.rstrip("/")) for p in binds}
    ancestors = {a for p in parents for a in _ancestors(p)}
    for path in sorted(ancestors, key=lambda a: a.count("/")):
        argv += ["--perms", "0755", "--dir", path]
    for path in binds:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        else:
            argv += ["--ro-bind-try", path, path]
    # A hand-made /dev: bwrap's --dev (devpts, mqueue, ...) costs ~1-2 ms more per sample.
    argv += ["--proc", "/proc", "--perms", "0755", "--dir", "/dev"]
    for dev in _DEVICES:
        argv += ["--dev-bind", dev, dev]
    for name, target in _DEV_LINKS:
        argv += ["--symlink", target, name]
    argv += ["--remount-ro", "/", "--chdir", "/tmp", "--hostname", "sandbox", "--", *command]
    return argv


def _ancestors(path: str) -> list[str]:
    out = []
    while path not in ("", "/"):
        out.append(path)
        path = os.path.dirname(path)
    return out


# ---------------------------------------------------------------- uids


class _UidPool:
    """Exclusive uids for sandbox runs, shared by every scorer and process on the host.

    A uid is ours while we hold an flock on its lock file; within this process the
    ``busy`` set is authoritative (flock is per open file, so re-locking our own fd
    would succeed).
    """

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}
        self._busy: set[int] = set()
        self._dir: str | None = None
        self._pid = os.getpid()

    def _lock_dir(self) -> str:
        if self._dir is None:
            path = os.path.join(
                "/run" if os.access("/run", os.W_OK) else tempfile.gettempdir(),
                f"stream-reward-sandbox-uids-{os.geteuid()}",
            )
            os.makedirs(path, mode=0o700, exist_ok=True)
            st = os.lstat(path)
            if st.st_uid != os.geteuid() or not os.path.isdir(path) or os.path.islink(path):
                raise VerifierError(f"uid lock directory {path} is not ours", reason="sandbox_unavailable")
            self._dir = path
        return self._dir

    def acquire(self, base: int, count: int) -> int:
        if self._pid != os.getpid():
            # A forked child shares our lock files' open descriptions, so flock would
            # not keep it from the parent's uids: it opens its own.
            for inherited in self._fds.values():
                os.close(inherited)
            self._fds, self._busy, self._pid = {}, set(), os.getpid()
        for uid in range(base, base + count):
            if uid in self._busy:
                continue
            fd = self._fds.get(uid)
            if fd is None:
                fd = os.open(
                    os.path.join(self._lock_dir(), str(uid)),
                    os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o600,
                )
                self._fds[uid] = fd
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            self._busy.add(uid)
            return uid
        raise VerifierError(f"all {count} sandbox uids from {base} are in use", reason="sandbox_unavailable")

    def release(self, uid: int) -> None:
        fcntl.flock(self._fds[uid], fcntl.LOCK_UN)
        self._busy.discard(uid)


UIDS = _UidPool()


# ---------------------------------------------------------------- teardown


def kill_tree(proc: subprocess.Popen[bytes], uid: int | None) -> None:
    """Kill a sandbox (the backend process ``proc`` and everything below it) and
    wait until it is gone."""
    # The backend leads its process group; its child is the namespace's init,
    # whose death takes every sandboxed process with it. Without a namespace
    # (unsafe mode) the case processes have their own sessions: kill them by pid.
    victims = _descendants(proc.pid)
    for pid in victims:
        _sigkill(pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.kill()
    proc.wait()
    # The namespace is torn down asynchronously; wait until it is gone, so that
    # its uid is empty before another sandbox leases it.
    end = time.monotonic() + 5
    while time.monotonic() < end and (not all(map(_dead, victims)) or (uid is not None and uid_alive(uid))):
        time.sleep(0.002)


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = []
        try:
            for task in os.listdir(f"/proc/{parent}/task"):
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    kids += [int(k) for k in f.read().split()]
        except (OSError, ValueError):
            pass
        found += kids
        todo += kids
    return found


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def _sigkill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def uid_alive(uid: int) -> bool:
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    return True
            except OSError:
                pass
    return False
