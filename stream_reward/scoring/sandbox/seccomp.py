"""The seccomp filter every candidate process runs under, as classic BPF bytes.

Written by hand (a few dozen instructions) rather than with libseccomp: the
Python binding is a Debian package a venv does not see and PyPI has no wheel of
it, and the filter is installed *inside* the sandbox by the harness, which may
import nothing but the stdlib. The harness installs the bytes with
``prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER)`` after ``PR_SET_NO_NEW_PRIVS``.

What it refuses (EPERM): the kernel keyrings (state that outlives a sample),
ptrace and cross-process memory access, mount and every new-namespace path
(``unshare``, ``setns``, ``clone`` with a CLONE_NEW* flag), io_uring (its
operations bypass seccomp), bpf, perf, userfaultfd, module and kexec loading,
clock setting, swap, accounting, quota, reboot, handle-based opens, syslog.
``clone3`` gets ENOSYS, so libc falls back to ``clone``, whose flags the filter
can see. ``socket`` and ``socketpair`` of any family but AF_UNIX get EAFNOSUPPORT
(what a kernel without that family says): what IP leaves in a network namespace
outlives the case (ports in TIME_WAIT, the packet counters of /proc/net/snmp);
each case's own namespace (CLONE_NEWNET, from the harness) keeps that from the
next one, and this rule keeps it from depending on that alone. A syscall of a
foreign ABI (x32, or a different architecture) kills the process. Architectures
without a table here (anything but x86_64 and aarch64) get no filter;
``filter_bytes`` returns None and the scorer logs it once.
"""

from __future__ import annotations

import platform
import struct

__all__ = ["filter_bytes", "DENIED"]

DENIED = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_getfd",
    "kcmp",
    "keyctl",
    "add_key",
    "request_key",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "unshare",
    "setns",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "fanotify_init",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "open_by_handle_at",
    "name_to_handle_at",
    "syslog",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "personality",
    "vhangup",
)

# name -> number, per architecture (from the kernel's syscall tables).
_X86_64 = dict(
    ptrace=101, process_vm_readv=310, process_vm_writev=311, pidfd_getfd=438, kcmp=312,
    keyctl=250, add_key=248, request_key=249, mount=165, umount2=166, pivot_root=155, chroot=161,
    unshare=272, setns=308, open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432,
    fspick=433, mount_setattr=442, io_uring_setup=425, io_uring_enter=426, io_uring_register=427,
    bpf=321, perf_event_open=298, userfaultfd=323, fanotify_init=300, kexec_load=246,
    kexec_file_load=320, init_module=175, finit_module=313, delete_module=176, reboot=169,
    swapon=167, swapoff=168, acct=163, quotactl=179, open_by_handle_at=304, name_to_handle_at=303,
    syslog=103, settimeofday=164, clock_settime=227, clock_adjtime=305, adjtimex=159,
    personality=135, vhangup=153, clone=56, clone3=435, socket=41, socketpair=53,
)  # fmt: skip
_AARCH64 = dict(
    ptrace=117, process_vm_readv=270, process_vm_writev=271, pidfd_getfd=438, kcmp=272,
    keyctl=219, add_key=217, request_key=218, mount=40, umount2=39, pivot_root=41, chroot=51,
    unshare=97, setns=268, open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432,
    fspick=433, mount_setattr=442, io_uring_setup=425, io_uring_enter=426, io_uring_register=427,
    bpf=280, perf_event_open=241, userfaultfd=282, fanotify_init=262, kexec_load=104,
    kexec_file_load=294, init_module=105, finit_module=273, delete_module=106, reboot=142,
    swapon=224, swapoff=225, acct=89, quotactl=60, open_by_handle_at=265, name_to_handle_at=264,
    syslog=116, settimeofday=170, clock_settime=112, clock_adjtime=266, adjtimex=171,
    personality=92, vhangup=58, clone=220, clone3=435, socket=198, socketpair=199,
)  # fmt: skip
_ARCHES = {"x86_64": (0xC000003E, _X86_64), "aarch64": (0xC00000B7, _AARCH64)}

# classic BPF opcodes and seccomp return values
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_KILL_PROCESS, _ERRNO, _ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_EPERM, _ENOSYS, _EAFNOSUPPORT = 1, 38, 97
_AF_UNIX = 1
_X32_BIT = 0x40000000
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
_CLONE_NEW = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80
_NR, _ARCH, _ARG0 = 0, 4, 16  # offsets in struct seccomp_data (little-endian: low word of args[0])


def filter_bytes(machine: str | None = None) -> bytes | None:
    """The filter for ``machine`` (default: this one) as packed ``sock_filter``s."""
    arch = _ARCHES.get(machine or platform.machine())
    if arch is None:
        return None
    audit_arch, nr = arch
    prog: list[tuple[int, int, int, int]] = [
        (_LD_W_ABS, 0, 0, _ARCH),
        (_JEQ_K, 1, 0, audit_arch),
        (_RET_K, 0, 0, _KILL_PROCESS),
        (_LD_W_ABS, 0, 0, _NR),
    ]
    if audit_arch == 0xC000003E:
        prog += [(_JGE_K, 0, 1, _X32_BIT), (_RET_K, 0, 0, _KILL_PROCESS)]
    for name in DENIED:
        prog += [(_JEQ_K, 0, 1, nr[name]), (_RET_K, 0, 0, _ERRNO | _EPERM)]
    prog += [
        # socket/socketpair: AF_UNIX (args[0]) or EAFNOSUPPORT
        (_JEQ_K, 1, 0, nr["socket"]),
        (_JEQ_K, 0, 4, nr["socketpair"]),
        (_LD_W_ABS, 0, 0, _ARG0),
        (_JEQ_K, 0, 1, _AF_UNIX),
        (_RET_K, 0, 0, _ALLOW),
        (_RET_K, 0, 0, _ERRNO | _EAFNOSUPPORT),
        (_JEQ_K, 0, 1, nr["clone3"]),
        (_RET_K, 0, 0, _ERRNO | _ENOSYS),
        (_JEQ_K, 0, 3, nr["clone"]),
        (_LD_W_ABS, 0, 0, _ARG0),
        (_JSET_K, 0, 1, _CLONE_NEW),
        (_RET_K, 0, 0, _ERRNO | _EPERM),
        (_RET_K, 0, 0, _ALLOW),
    ]
    return b"".join(struct.pack("<HBBI", *ins) for ins in prog)
