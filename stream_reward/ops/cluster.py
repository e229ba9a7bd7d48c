"""A local Redis Cluster on loopback, run as our own child processes.

Used by the cluster tests and ``bench scale``; also handy to try a partitioned
namespace by hand (``with LocalCluster() as c: print(c.url)``). It is a test
cluster: masters only (no replicas), nothing on disk but the nodes' cluster
config files in a fresh 0700 temp dir, listening on 127.0.0.1 only.

The nodes are started with ``--cluster-enabled yes`` on free ports, then joined
the way ``redis-cli --cluster create ... --cluster-replicas 0`` would: each
master takes an equal range of the 16384 slots (CLUSTER ADDSLOTSRANGE) and
meets the first node (CLUSTER MEET); the cluster is ready once every node says
``cluster_state:ok`` and knows all the others. Doing it directly needs no
``redis-cli`` and takes well under a second. The nodes die with their parent,
as the embedded server does (PR_SET_PDEATHSIG, atexit, ``stop()``).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from stream_reward.errors import BrokerError
from stream_reward.ops.embedded import die_with_parent, find_server_binary, server_args

__all__ = ["LocalCluster", "HASH_SLOTS"]

log = logging.getLogger(__name__)

HASH_SLOTS = 16384
HOST = "127.0.0.1"
_BUS_OFFSET = 10000  # a node's cluster bus listens on its port + 10000


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def _free_ports(n: int, rng: random.Random) -> list[int]:
    """``n`` ports whose bus ports (port + 10000) are free too. Another process may
    take one between this check and the server's bind: start() then retries."""
    ports: list[int] = []
    while len(ports) < n:
        port = rng.randint(20000, 50000)
        if port not in ports and _port_free(port) and _port_free(port + _BUS_OFFSET):
            ports.append(port)
    return ports


def _command(port: int, *args: str, timeout_s: float = 2.0) -> bytes:
    """One command over a fresh connection, raw RESP: the reply's first line or bulk.

    Enough for the handful of admin commands run here, and keeps this module
    free of client-library event loops.
    """
    parts = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = arg.encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    with socket.create_connection((HOST, port), timeout=timeout_s) as sock:
        sock.sendall(b"".join(parts))
        buf = b""
        while b"\r\n" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                raise OSError("connection closed")
            buf += chunk
        head, _, rest = buf.partition(b"\r\n")
        if head.startswith(b"-"):
            raise BrokerError(f"node {port}: {' '.join(args[:2])}: {head[1:].decode(errors='replace')}")
        if head.startswith(b"$"):
            size = int(head[1:])
            while len(rest) < size + 2:
                chunk = sock.recv(65536)
                if not chunk:
                    raise OSError("connection closed")
                rest += chunk
            return rest[:size]
        return head[1:]


def _info_fields(text: bytes) -> dict[str, str]:
    fields = {}
    for line in text.decode(errors="replace").splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


@dataclass
class LocalCluster:
    """``with LocalCluster(masters=3) as cluster: cluster.url`` (``redis+cluster://...``)."""

    masters: int = 3
    binary: str | None = None
    appendonly: bool = False  # outage tests turn persistence on, so a restarted node keeps its data
    startup_timeout_s: float = 30.0
    extra_args: list[str] = field(default_factory=list)

    ports: list[int] = field(default_factory=list, init=False)
    _binary: str = field(default="", init=False, repr=False)
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list, init=False, repr=False)
    _tmp: str | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        if not self.ports:
            raise BrokerError("local cluster is not started")
        return f"redis+cluster://{HOST}:{self.ports[0]}"

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def start(self) -> LocalCluster:
        if self._procs:
            return self
        if self.masters < 1:
            raise BrokerError(f"a cluster needs at least one master, got {self.masters}")
        binary = self._binary = self.binary or find_server_binary()
        self._tmp = tempfile.mkdtemp(prefix="stream-reward-cluster-")
        os.chmod(self._tmp, 0o700)
        atexit.register(self.stop)
        rng = random.Random()
        try:
            for attempt in range(3):
                self.ports = _free_ports(self.masters, rng)
                self._procs = [self._spawn(binary, port) for port in self.ports]
                if self._wait_up():
                    break
                self._kill_all()  # a port was taken meanwhile: try others
                if attempt == 2:
                    raise BrokerError(f"cluster nodes did not start: {self._log_tail()}")
            self._join()
        except BaseException:
            self.stop()
            raise
        log.info("local cluster of %d masters on %s ports %s", self.masters, HOST, self.ports)
        return self

    def _spawn(self, binary: str, port: int) -> subprocess.Popen[bytes]:
        assert self._tmp is not None
        node_dir = os.path.join(self._tmp, str(port))
        os.makedirs(node_dir, exist_ok=True)
        args = [
            binary,
            "--port",
            str(port),
            "--bind",
            HOST,
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            os.path.join(node_dir, "nodes.conf"),
            "--cluster-node-timeout",
            "5000",
            *server_args(node_dir, os.path.join(node_dir, "server.log"), appendonly=self.appendonly),
            *self.extra_args,
        ]
        with open(os.path.join(node_dir, "stderr.log"), "ab") as err_file:
            return subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err_file, preexec_fn=die_with_parent
            )

    def _wait_up(self) -> bool:
        deadline = time.monotonic() + self.startup_timeout_s
        pending = set(self.ports)
        while pending and time.monotonic() < deadline:
            for proc, port in zip(self._procs, self.ports):
                if proc.poll() is not None:
                    return False
                if port in pending:
                    with contextlib.suppress(OSError, BrokerError):
                        if _command(port, "PING") == b"PONG":
                            pending.discard(port)
            time.sleep(0.01)
        return not pending

    def _join(self) -> None:
        n = len(self.ports)
        for k, port in enumerate(self.ports):
            first, last = k * HASH_SLOTS // n, (k + 1) * HASH_SLOTS // n - 1
            _command(port, "CLUSTER", "ADDSLOTSRANGE", str(first), str(last))
        for port in self.ports[1:]:
            _command(self.ports[0], "CLUSTER", "MEET", HOST, str(port))
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if all(self._node_ready(port) for port in self.ports):
                return
            time.sleep(0.02)
        raise BrokerError(f"cluster did not reach cluster_state:ok within {self.startup_timeout_s}s")

    def _node_ready(self, port: int) -> bool:
        try:
            info = _info_fields(_command(port, "CLUSTER", "INFO"))
        except (OSError, BrokerError):
            return False
        return (
            info.get("cluster_state") == "ok"
            and info.get("cluster_slots_ok") == str(HASH_SLOTS)
            and info.get("cluster_known_nodes") == str(len(self.ports))
        )

    def kill_node(self, index: int) -> None:
        """SIGKILL one master (its dir and cluster config stay, for ``restart_node``)."""
        proc = self._procs[index]
        proc.kill()
        proc.wait()

    def restart_node(self, index: int) -> None:
        """Start a killed master again on its port; it rejoins with its old slots
        (and, with ``appendonly``, its data). Returns once the cluster is ok again."""
        port = self.ports[index]
        self._procs[index] = self._spawn(self._binary, port)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._procs[index].poll() is not None:
                raise BrokerError(f"node {port} exited at restart: {self._log_tail()}")
            if all(self._node_ready(p) for p in self.ports):
                return
            time.sleep(0.02)
        raise BrokerError(f"cluster did not recover within {self.startup_timeout_s}s")

    def node_of_slot(self, slot: int) -> int:
        """The port of the master serving ``slot`` (slots are split evenly in port order)."""
        n = len(self.ports)
        for k, port in enumerate(self.ports):
            if slot <= (k + 1) * HASH_SLOTS // n - 1:
                return port
        raise ValueError(f"slot {slot} out of range")

    def _log_tail(self) -> str:
        text = ""
        for port in self.ports:
            for name in ("stderr.log", "server.log"):
                with contextlib.suppress(OSError):
                    text += Path(self._tmp or "", str(port), name).read_text(errors="replace")[-1000:]
        return text.strip()

    def _kill_all(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs = []

    def stop(self) -> None:
        self._kill_all()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        self.ports = []

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
