"""Memory and process limits per sandbox slot, through the cgroup controllers.

Rlimits are per process: three forks of 900 MB fit under a 1 GB RLIMIT_AS, and
pages of a memfd or a tmpfs file are in no process's address space at all. A
memory cgroup counts all of it (anonymous memory of every process, page cache,
shmem, tmpfs and memfd pages) and the pids controller counts every task, for
root and non-root alike (RLIMIT_NPROC is ignored for root).

One ``SlotCgroups`` per sandbox slot: a ``memory`` and a ``pids`` group created
under this process's own groups (so whatever limits the host put on us still
hold), with ``memory_mb`` (and the same for memory+swap on v1) and ``max_procs``.
The harness receives open descriptors of their ``cgroup.procs`` files and moves
itself in once at boot, so that every case process is born in the groups (a move
per case would wait for an RCU grace period, ~10 ms, each time); each case makes
itself the OOM killer's first pick (``oom_score_adj`` 1000) so that a case at the
memory limit never takes the harness. It reads the OOM-kill counter through
another descriptor to tell "memory" from a crash. The caller sizes the groups for
the harness too (one more task, its buffers of a case's output).

cgroup v2 is used when the unified hierarchy has both controllers, else v1's
``memory`` and ``pids`` hierarchies. Without either (no permission, not
mounted), ``open_slot`` returns None and the caller falls back to rlimits only:
RLIMIT_AS per process, RLIMIT_NPROC per uid (not for root), and /tmp's size;
``docs/sandbox.md`` lists what that leaves open.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

__all__ = ["SlotCgroups", "open_slot"]

logger = logging.getLogger(__name__)
_warned: list[bool] = []  # warn once per process


def _mounts() -> list[tuple[str, str, set[str]]]:
    out = []
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 4 and parts[2] in ("cgroup", "cgroup2"):
                    out.append((parts[1], parts[2], set(parts[3].split(","))))
    except OSError:
        pass
    return out


def _own_paths() -> dict[str, str]:
    """controller (or "" for v2) -> this process's group path."""
    out: dict[str, str] = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for c in controllers.split(",") if controllers else [""]:
                    out[c] = path
    except (OSError, ValueError):
        pass
    return out


def _bases() -> tuple[str, str, str] | None:
    """("v1"|"v2", memory dir, pids dir) of this process's own groups, or None."""
    own = _own_paths()
    for mnt, kind, _ in _mounts():
        if kind == "cgroup2" and "" in own:
            base = mnt + own[""].rstrip("/")
            try:
                with open(os.path.join(base, "cgroup.controllers")) as f:
                    have = set(f.read().split())
            except OSError:
                continue
            if {"memory", "pids"} <= have:
                return "v2", base, base
    mem = pids = None
    for mnt, kind, opts in _mounts():
        if kind != "cgroup":
            continue
        if "memory" in opts and "memory" in own:
            mem = mnt + own["memory"].rstrip("/")
        if "pids" in opts and "pids" in own:
            pids = mnt + own["pids"].rstrip("/")
    if mem and pids:
        return "v1", mem, pids
    return None


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


@dataclass
class SlotCgroups:
    """The groups of one slot and the descriptors the harness gets."""

    version: str
    dirs: tuple[str, ...]  # the groups we created (removed by close)
    procs_fds: tuple[int, ...]  # write b"0" to join (memory, pids)
    oom_fd: int  # memory.events (v2) or memory.oom_control (v1): has "oom_kill N"

    def fds(self) -> list[int]:
        return [*self.procs_fds, self.oom_fd]

    def close(self) -> None:
        for fd in self.fds():
            try:
                os.close(fd)
            except OSError:
                pass
        for d in self.dirs:
            try:
                os.rmdir(d)
            except OSError:
                pass  # still busy or gone: a leftover empty group costs nothing


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


# Group names: PREFIX + "<owner pid>-<scorer>-<slot>". The PID namespace is part
# of the prefix so that a sweep only ever judges owners it can see.
PREFIX = f"stream-reward-{_pid_namespace()}-"


def _sweep(base: str) -> None:
    """Remove empty groups left by scorer processes that died without closing."""
    try:
        names = [n for n in os.listdir(base) if n.startswith(PREFIX)]
    except OSError:
        return
    for name in names:
        try:
            os.kill(int(name[len(PREFIX) :].split("-", 1)[0]), 0)
            continue  # its owner is alive
        except ProcessLookupError:
            pass
        except (ValueError, OSError):
            continue
        try:
            os.rmdir(os.path.join(base, name))
        except OSError:
            pass


def open_slot(name: str, memory_mb: int, max_procs: int) -> SlotCgroups | None:
    """Create and limit the groups of one slot; None when cgroups are unusable here."""
    bases = _bases()
    if bases is None:
        if not _warned:
            _warned.append(True)
            logger.warning("no memory+pids cgroup hierarchy: sandbox limits fall back to rlimits")
        return None
    version, mem_base, pids_base = bases
    for base in {mem_base, pids_base}:
        _sweep(base)
    created: list[str] = []
    fds: list[int] = []
    try:
        if version == "v2":
            d = os.path.join(mem_base, name)
            os.makedirs(d, exist_ok=True)
            created.append(d)
            _write(os.path.join(d, "memory.max"), str(memory_mb << 20))
            try:
                _write(os.path.join(d, "memory.swap.max"), "0")
            except OSError:
                pass  # no swap accounting: nothing to escape into either
            _write(os.path.join(d, "pids.max"), str(max_procs))
            procs = [os.path.join(d, "cgroup.procs")]
            oom = os.path.join(d, "memory.events")
        else:
            m = os.path.join(mem_base, name)
            p = os.path.join(pids_base, name)
            for d in (m, p):
                os.makedirs(d, exist_ok=True)
                created.append(d)
            _write(os.path.join(m, "memory.limit_in_bytes"), str(memory_mb << 20))
            try:
                _write(os.path.join(m, "memory.memsw.limit_in_bytes"), str(memory_mb << 20))
            except OSError:
                pass
            _write(os.path.join(p, "pids.max"), str(max_procs))
            procs = [os.path.join(m, "cgroup.procs"), os.path.join(p, "cgroup.procs")]
            oom = os.path.join(m, "memory.oom_control")
        for path in procs:
            fds.append(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
        fds.append(os.open(oom, os.O_RDONLY | os.O_CLOEXEC))
    except OSError as exc:
        if not _warned:
            _warned.append(True)
            logger.warning("cgroups unusable (%s): sandbox memory and process limits fall back to rlimits", exc)
        for fd in fds:
            os.close(fd)
        for d in reversed(created):
            try:
                os.rmdir(d)
            except OSError:
                pass
        return None
    return SlotCgroups(version, tuple(created), tuple(fds[:-1]), fds[-1])
