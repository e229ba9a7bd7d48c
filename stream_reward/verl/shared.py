"""The job's shared actor: one server and one worker pool for every RewardLoopWorker.

Created by the first manager (``stream_reward.verl.server``), found by name by the
others. What it promises:

* **It ends with its holders.** Every manager joins with its process (pid, start time,
  node). A holder on this node is watched directly: once its process is gone (verl's
  RewardLoopWorker ended, ray.kill, a crash) its hold ends within ``_POLL_S``. A holder
  elsewhere renews a lease; ``leave`` ends a hold at once (a manager's close). When the
  last hold ends the actor stops its workers and server, removes its temp dir and
  leaves with ``ray.actor.exit_actor()``: Ray records an intended exit, not a
  SYSTEM_ERROR, and frees the name. An actor nobody ever joined goes after one lease.
* **What it started dies with it**, however it dies. Redis and the workers get SIGTERM
  from PR_SET_PDEATHSIG; a ``Reaper`` of its own session terminates their process
  groups (scorer children included) and removes the temp dir when the actor process is
  gone: a SIGKILL, or ``ray.shutdown()`` taking the node down.
* **A dead actor is replaced, not restarted by Ray**: the next manager that needs it
  finds the name free and creates a new one (a new server: a new URL); managers re-push
  what was in flight (``stream_reward.verl.loop``). An actor whose Redis or every
  worker exited retires the same way, with that cause, so it is replaced too.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from typing import Any

from stream_reward.errors import WorkersDiedError
from stream_reward.ops.pipeline import LocalPipeline
from stream_reward.ops.reaper import Reaper, start_time

__all__ = ["SharedPipeline", "STOPPING"]

log = logging.getLogger(__name__)

STOPPING = "stopping"  # join's error while the actor retires: the manager waits and creates a new one
_POLL_S = 0.25
_EXIT_FALLBACK_S = 10.0  # exit_actor() never ran (the self-call was lost): leave anyway


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class SharedPipeline:
    """The body of the job's shared actor: a password-protected server and a worker pool."""

    def __init__(self, worker_args: list[str], processes: int, namespace: str, host: str, lease_s: float) -> None:
        import ray  # type: ignore[import-not-found]

        from stream_reward.ops.embedded import EmbeddedServer

        self._lock = threading.Lock()
        self._leases: dict[str, float] = {}  # client -> lease end (monotonic)
        self._local: dict[str, tuple[int, str]] = {}  # client -> (pid, start time) of a holder on this node
        self._lease_s = lease_s
        self._started = time.monotonic()
        self._stopping = False
        self._ever_held = False
        self._retiring = threading.Event()
        self._cause = ""  # why it retires, for the managers holding it
        self._error = ""
        self._server: Any = None
        self._pipeline: LocalPipeline | None = None
        self.node_id = ray.get_runtime_context().get_node_id()
        # First, so that everything after it is covered.
        self._reaper = Reaper()
        password = secrets.token_urlsafe(24)
        try:
            port = _free_port(host)
            self._server = EmbeddedServer(
                extra_args=["--port", str(port), "--bind", host, "--requirepass", password, "--maxclients", "10000"]
            ).start()
            self._reaper.directory(self._server.temp_dir)
            self._reaper.group(self._server.pid)
            bracketed = f"[{host}]" if ":" in host else host
            self.url = f"redis://:{password}@{bracketed}:{port}/0"
            args = list(worker_args)
            if "--drain-timeout-s" not in args:
                # The server goes with this actor: a drain would hand samples back to nobody.
                args += ["--drain-timeout-s", "0"]
            self._pipeline = LocalPipeline(self.url, processes=processes, namespace=namespace, worker_args=args)
            self._pipeline.start()
            for proc in self._pipeline.workers:
                self._reaper.group(proc.pid)
        except Exception as exc:  # reported to every joining manager, not lost in the actor's log
            self._error = f"{type(exc).__name__}: {exc}"
            self.url = ""
        threading.Thread(target=self._watch, name="stream-reward-holders", daemon=True).start()

    # ------------------------------------------------------------ what managers call
    def join(self, client: str, holder: dict[str, Any] | None = None) -> dict[str, Any]:
        """Hold the pipeline (again: after a renewal gap, the same call)."""
        with self._lock:
            if self._stopping:
                return {"url": "", "node_id": self.node_id, "error": STOPPING}
            self._leases[client] = time.monotonic() + self._lease_s
            if holder and holder.get("node_id") == self.node_id and holder.get("start"):
                self._local[client] = (int(holder["pid"]), str(holder["start"]))
        return {"url": self.url, "node_id": self.node_id, "error": self._error}

    def renew(self, client: str, holder: dict[str, Any] | None = None) -> None:
        self.join(client, holder)

    def leave(self, client: str) -> None:
        with self._lock:
            self._leases.pop(client, None)
            self._local.pop(client, None)

    def info(self) -> dict[str, Any]:
        with self._lock:
            clients = len(self._leases)
        workers = self._pipeline.workers if self._pipeline else []
        return {
            "clients": clients,
            "workers": len(workers),
            "workers_alive": sum(proc.poll() is None for proc in workers),
            "pid": os.getpid(),
            "server_pid": self._server.pid if self._server else None,
            "temp_dir": self._server.temp_dir if self._server else None,
            "reaper_pid": self._reaper.pid,
            "node_id": self.node_id,
        }

    def hold(self) -> str:
        """Returns why the actor retires; a manager's pending call fails the moment the
        actor dies: how managers learn of either within a second, whatever Redis does."""
        self._retiring.wait()
        return self._cause

    def exit(self) -> None:
        """Called by the actor on itself once it cleaned up: an intended exit for Ray."""
        import ray

        ray.actor.exit_actor()

    # ------------------------------------------------------------ retiring
    def _broken(self) -> str:
        """Why this actor can score nothing any more, or "" while it can: its Redis or
        every worker exited (SIGKILLed, the OOM killer, a scorer crashing each worker)."""
        if self._error or self._server is None or self._pipeline is None:
            return ""  # never started: every join reports that instead
        code = self._server.returncode
        if code is not None:
            return f"its Redis server exited (code {code})"
        try:
            self._pipeline.check_workers()
        except WorkersDiedError as exc:
            return str(exc)
        return ""

    def _held(self, now: float) -> bool:
        broken = self._broken()
        if broken:
            # Replaced rather than repaired: the samples it held went with its Redis or
            # its workers, and the managers re-send them to whichever actor comes next.
            with self._lock:
                self._stopping = True
                self._cause = broken
            return False
        with self._lock:
            for client, (pid, start) in list(self._local.items()):
                if start_time(pid) != start:  # that process is gone: its hold ends now
                    del self._local[client]
                    self._leases.pop(client, None)
            self._leases = {c: t for c, t in self._leases.items() if t > now or c in self._local}
            if self._leases:
                self._ever_held = True
                return True
            if self._ever_held or now - self._started > self._lease_s:
                self._stopping = True
                self._cause = "no manager holds it"
                return False
            return True

    def _watch(self) -> None:
        while self._held(time.monotonic()):
            time.sleep(_POLL_S)
        log.warning("the job's shared stream-reward server stops: %s", self._cause)
        self._retire()

    def _retire(self) -> None:
        import ray

        self._retiring.set()
        start = time.monotonic()
        # Nothing in flight is worth waiting for (nobody holds the pipeline, or it is
        # broken): a worker not gone half a second after its SIGTERM is killed.
        if self._pipeline is not None:
            self._pipeline.stop(timeout_s=0.5)
        if self._server is not None:
            self._server.stop()
        self._reaper.close()
        log.warning(
            "the shared server, its workers and temp dir are gone (%.2f s); the actor exits", time.monotonic() - start
        )
        ray.get_runtime_context().current_actor.exit.remote()
        time.sleep(_EXIT_FALLBACK_S)
        os._exit(0)
