"""One sandbox slot: a persistent harness inside the sandbox, its trusted checker
on the host, and the framed pipes to both.

A slot serves one sample at a time. ``start_harness`` leases the slot's uid and
cgroups and starts the backend with the harness source on stdin (behind
``sandbox_wire``, precompiled when the sandbox runs this interpreter);
``start_checker`` starts the checker the same way, unsandboxed. ``stop`` kills
both (and everything below them) and gives the uid and cgroups back.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import json
import logging
import marshal
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Protocol

from stream_reward.config import SandboxConfig
from stream_reward.errors import ConfigError, VerifierError
from stream_reward.scoring.sandbox.cgroups import PREFIX as CGROUP_PREFIX
from stream_reward.scoring.sandbox.cgroups import SlotCgroups, open_slot
from stream_reward.scoring.sandbox.isolation import MARKER, OUT_OF_RESOURCES, UIDS, kill_tree, sandbox_env, wrap_command


class SlotOwner(Protocol):
    """What a slot reads of the scorer that owns it (``SandboxScorer``)."""

    config: SandboxConfig
    backend: str
    root: bool
    checker_code: bytes
    harness_code: bytes

    def boot_base(self) -> dict[str, Any]: ...


__all__ = ["Slot", "SlotBroken", "Channel", "HARNESS_SOURCE", "CHECKER_SOURCE", "json_message", "kill_pid"]

logger = logging.getLogger(__name__)

_HERE = importlib.resources.files(__package__)
_WIRE = _HERE.joinpath("wire.py").read_text(encoding="utf-8")
HARNESS_SOURCE = "\n".join(
    [_WIRE] + [_HERE.joinpath(name).read_text(encoding="utf-8") for name in ("_serve.py", "_harness.py")]
)
CHECKER_SOURCE = "\n".join(
    [_WIRE]
    + [
        _HERE.joinpath(name).read_text(encoding="utf-8")
        for name in ("_import_view.py", "_values.py", "_remote.py", "_checker.py")
    ]
)

# The source travels as the first frame on stdin, precompiled when the sandbox
# runs this very interpreter.
_BOOT = (
    "import marshal, os\ndef _r(n):\n    b = b''\n    while len(b) < n:\n        c = os.read(0, n - len(b))\n"
    "        if not c:\n            raise SystemExit(1)\n        b += c\n    return b\n"
    "h = marshal.loads(_r(int.from_bytes(_r(4), 'little')))\n"
    "exec(compile(h, 'harness', 'exec') if type(h) is str else h)"
)


def _frame(data: bytes) -> bytes:
    return len(data).to_bytes(4, "little") + data


class Channel:
    """Length-prefixed frames to and from a child process over two pipes.

    Reads wait on the running loop (``add_reader`` per wait, so one channel serves
    several event loops in turn); writes are blocking: the peer is always reading
    when we write to it.
    """

    def __init__(self, write_fd: int, read_fd: int) -> None:
        self.write_fd, self.read_fd = write_fd, read_fd
        os.set_blocking(read_fd, False)
        self._buf = bytearray()

    def send(self, data: bytes) -> None:
        view = memoryview(_frame(data))
        os.set_blocking(self.write_fd, True)
        while view:
            view = view[os.write(self.write_fd, view) :]

    def _pop(self) -> bytes | None:
        if len(self._buf) >= 4:
            n = int.from_bytes(self._buf[:4], "little")
            if len(self._buf) >= 4 + n:
                body = bytes(self._buf[4 : 4 + n])
                del self._buf[: 4 + n]
                return body
        return None

    def _fill(self) -> bool:
        try:
            chunk = os.read(self.read_fd, 1 << 20)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        self._buf += chunk
        return True

    async def recv(self) -> bytes:
        while True:
            body = self._pop()
            if body is not None:
                return body
            if not self._fill():
                raise EOFError("the process closed its pipe")
            if self._pop_ready():
                continue
            loop = asyncio.get_running_loop()
            ready = loop.create_future()
            loop.add_reader(self.read_fd, _wake, ready)
            try:
                await ready
            finally:
                loop.remove_reader(self.read_fd)

    def _pop_ready(self) -> bool:
        return len(self._buf) >= 4 and len(self._buf) >= 4 + int.from_bytes(self._buf[:4], "little")

    def recv_sync(self, timeout_s: float) -> bytes:
        import select

        end = time.monotonic() + timeout_s
        while True:
            body = self._pop()
            if body is not None:
                return body
            left = end - time.monotonic()
            if left <= 0 or not select.select([self.read_fd], [], [], left)[0]:
                raise TimeoutError("no reply")
            if not self._fill():
                raise EOFError("the process closed its pipe")


def _wake(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)


class SlotBroken(Exception):
    """The slot's harness or checker misbehaved; the slot is torn down."""


class Slot:
    """One persistent sandbox (harness) and its trusted checker."""

    def __init__(self, scorer: SlotOwner, index: int) -> None:
        self.scorer, self.index = scorer, index
        self.harness: subprocess.Popen[bytes] | None = None
        self.checker: subprocess.Popen[bytes] | None = None
        self.h: Channel | None = None
        self.c: Channel | None = None
        self.uid: int | None = None
        self.cgroups: SlotCgroups | None = None
        self.checker_pid: int | None = None  # the checker's child for the current sample
        self.staged: str | None = None  # the compiled program whose files the harness keeps
        self.errors: Any = None

    # -- lifecycle

    def start_harness(self) -> None:
        s, cfg = self.scorer, self.scorer.config
        if s.backend != "none" and s.root:
            self.uid = UIDS.acquire(cfg.uid_base, cfg.uid_count)
        if cfg.cgroups != "off" and s.root:
            # The harness lives in the slot's groups too (its cases are born there): one
            # more task, and room for its own buffers of a case's output. Once the case
            # is gone it reports that output: as text and then JSON escapes, stdout and
            # replies at the cap in bytes that are not UTF-8 take ~16 times the cap
            # each, so the group holds at least that much whatever memory_mb is.
            out_mb = -(-cfg.max_output_bytes >> 20)
            memory_mb = max(cfg.memory_mb + 16 + 3 * out_mb, 16 + 36 * out_mb)
            self.cgroups = open_slot(
                f"{CGROUP_PREFIX}{os.getpid()}-{id(s):x}-{self.index}", memory_mb, cfg.max_procs + 1
            )
            if self.cgroups is None and cfg.cgroups == "required":
                self.stop()
                raise ConfigError("cgroups", "cgroups were required but this host does not let us create them")
        fds = self.cgroups.fds() if self.cgroups else []
        self.errors = tempfile.TemporaryFile()  # the backend's own complaints, for the error message
        argv = wrap_command(cfg, s.backend, [cfg.python, "-I", "-S", "-c", _BOOT, MARKER], root=s.root)
        try:
            self.harness = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.errors,
                env=sandbox_env(),
                pass_fds=fds,
                start_new_session=True,  # the backend leads its own group: one killpg ends it
            )
        except OSError as exc:
            self.stop()
            reason = "host_resources" if exc.errno in OUT_OF_RESOURCES else "sandbox_unavailable"
            raise VerifierError(f"cannot start the {s.backend} sandbox: {exc}", reason=reason) from exc
        assert self.harness.stdin is not None and self.harness.stdout is not None
        self.h = Channel(self.harness.stdin.fileno(), self.harness.stdout.fileno())
        boot = {
            **s.boot_base(),
            "uid": self.uid,
            "cgroup_fds": list(self.cgroups.procs_fds) if self.cgroups else [],
            "oom_fd": self.cgroups.oom_fd if self.cgroups else None,
            "per_case_ns": s.backend != "none",
            "drop_caps": s.backend == "bwrap" and not s.root,
        }
        try:
            self.h.send(s.harness_code)
            self.h.send(marshal.dumps(boot, 4))
        except OSError as exc:
            try:
                self.harness.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            why = self.stderr_tail() or exc
            self.stop()
            raise VerifierError(f"{s.backend} sandbox did not start: {why}", reason="sandbox_unavailable") from exc

    def stderr_tail(self) -> str:
        try:
            self.errors.seek(0)
            return self.errors.read()[-500:].decode("utf-8", "replace").strip()
        except (OSError, AttributeError, ValueError):
            return ""

    def ready(self, reply: bytes) -> None:
        msg = json_message(reply)
        if msg.get("ev") != "ready":
            raise SlotBroken(f"harness did not start: {reply[:200]!r}")

    def start_checker(self) -> None:
        self.checker = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _BOOT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=sandbox_env(),
            cwd="/",
            start_new_session=True,  # a terminal's Ctrl-C is for the worker; the checker dies with it anyway
        )
        assert self.checker.stdin is not None and self.checker.stdout is not None
        self.c = Channel(self.checker.stdin.fileno(), self.checker.stdout.fileno())
        self.c.send(self.scorer.checker_code)

    def stop(self) -> None:
        for proc in (self.harness, self.checker):
            if proc is None:
                continue
            kill_tree(proc, self.uid if proc is self.harness else None)
            for pipe in (proc.stdin, proc.stdout):
                try:
                    if pipe is not None:
                        pipe.close()
                except OSError:
                    pass
        if self.checker_pid is not None:
            kill_pid(self.checker_pid)
        self.harness = self.checker = None
        self.h = self.c = None
        self.checker_pid = None
        self.staged = None
        if self.uid is not None:
            UIDS.release(self.uid)
            self.uid = None
        if self.cgroups is not None:
            self.cgroups.close()
            self.cgroups = None
        if self.errors is not None:
            self.errors.close()
            self.errors = None


def json_message(raw: bytes) -> dict[str, Any]:
    try:
        msg = json.loads(raw)
    except ValueError as exc:
        raise SlotBroken(f"unreadable message from the harness: {exc}") from None
    if not isinstance(msg, dict):
        raise SlotBroken("unreadable message from the harness")
    return msg


def kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
