"""Where a verl job's worker processes run (``StreamRewardLoopManager``).

verl 0.9.1 starts ``reward.num_workers`` RewardLoopWorker actors (default 8), each
building its own reward manager. A server and a worker pool per actor would split a
quota eight ways and start eight times the processes, so:

* ``reward_kwargs.redis_url`` set: the manager only pushes and awaits; the workers run
  anywhere (``stream-reward worker``), or ``num_workers`` local ones per manager.
* Ray running (the verl job): one server and one worker pool for the whole job. The
  first manager creates a named detached actor (``SharedPipeline``, named by the job
  id and the worker options) that starts the server on TCP with a random password and
  ``num_workers`` worker processes (default 2); every other manager finds it by name.
  Each manager holds a lease it renews from a thread; when no lease is renewed for
  ``server_lease_s`` (the job ended, every RewardLoopWorker is gone) the actor stops
  its workers and server and exits. Detached, so it does not die with whichever actor
  happened to create it; the lease, not Ray's ownership, ties it to the job.
  It listens on ``server_host`` (default loopback) of the node where it started: a
  multi-node job sets ``server_host`` to an address other nodes reach (or a redis_url).
* No Ray (in-process use, tests): a private server on a unix socket and local workers,
  stopped by ``close()``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stream_reward.errors import ConfigError, StreamRewardError
from stream_reward.ops.pipeline import LocalPipeline
from stream_reward.verl.options import LoopOptions

__all__ = ["Placement", "attach", "SharedPipeline", "RAY_NAMESPACE"]

log = logging.getLogger(__name__)

RAY_NAMESPACE = "stream_reward"
_DEFAULT_PROCESSES = 2


@dataclass
class Placement:
    """The server a manager talks to, and how to let go of it."""

    url: str
    kind: str  # "external" | "shared" | "private"
    release: Callable[[], None]
    workers_alive: Callable[[], bool] = lambda: True


def attach(options: LoopOptions) -> Placement:
    if options.redis_url:
        pipeline = LocalPipeline(
            options.redis_url,
            processes=options.num_workers or 0,
            namespace=options.namespace,
            worker_args=options.worker_args(),
        ).start()
        return Placement(options.redis_url, "external", pipeline.stop, _alive(pipeline))
    if _ray_running():
        return _attach_shared(options)
    processes = _DEFAULT_PROCESSES if options.num_workers is None else options.num_workers
    if processes < 1:
        raise ConfigError("reward.reward_kwargs.num_workers", "a private server needs local workers (>= 1)")
    pipeline = LocalPipeline(None, processes=processes, namespace=options.namespace, worker_args=options.worker_args())
    pipeline.start()
    return Placement(pipeline.url, "private", pipeline.stop, _alive(pipeline))


def _alive(pipeline: LocalPipeline) -> Callable[[], bool]:
    # Local workers that all died (a bad scorer, a crash at start) would leave run_single
    # waiting for the deadline: the manager asks this and fails the sample at once.
    return lambda: not pipeline.workers or any(proc.poll() is None for proc in pipeline.workers)


def _ray_running() -> bool:
    ray = sys.modules.get("ray")  # never import Ray for a job that does not use it
    return ray is not None and ray.is_initialized()


def shared_name(options: LoopOptions, job_id: str) -> str:
    digest = hashlib.sha256(
        "\0".join([*options.worker_args(), options.namespace, str(options.num_workers), options.server_host]).encode()
    ).hexdigest()[:12]
    return f"stream-reward-{job_id}-{digest}"


def _attach_shared(options: LoopOptions) -> Placement:
    import ray  # type: ignore[import-not-found]
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # type: ignore[import-not-found]

    context = ray.get_runtime_context()
    node_id = context.get_node_id()
    actor = (
        ray.remote(SharedPipeline)
        .options(
            name=shared_name(options, context.get_job_id()),
            namespace=RAY_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_concurrency=16,
            # On this node: the server listens on this node's server_host.
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        )
        .remote(
            options.worker_args(),
            _DEFAULT_PROCESSES if options.num_workers is None else options.num_workers,
            options.namespace,
            options.server_host,
            options.server_lease_s,
        )
    )
    client = uuid.uuid4().hex
    info = ray.get(actor.join.remote(client))
    if info.get("error"):
        raise StreamRewardError(f"the job's shared stream-reward server failed to start: {info['error']}")
    if info["node_id"] != node_id and options.server_host in ("127.0.0.1", "localhost", "::1"):
        raise ConfigError(
            "reward.reward_kwargs.server_host",
            "the job's shared server listens on loopback of another node; in a multi-node job set "
            "server_host to an address every node reaches, or give a redis_url",
        )
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(options.server_lease_s / 4):
            with contextlib.suppress(Exception):
                ray.get(actor.renew.remote(client), timeout=options.server_lease_s / 2)

    threading.Thread(target=renew, name="stream-reward-lease", daemon=True).start()

    def release() -> None:
        stop.set()
        with contextlib.suppress(Exception):
            ray.get(actor.leave.remote(client), timeout=10)

    return Placement(info["url"], "shared", release)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class SharedPipeline:
    """The body of the job's shared actor: a password-protected server and a worker pool."""

    def __init__(self, worker_args: list[str], processes: int, namespace: str, host: str, lease_s: float) -> None:
        import ray

        from stream_reward.ops.embedded import EmbeddedServer

        self._lock = threading.Lock()
        self._leases: dict[str, float] = {}
        self._lease_s = lease_s
        self._started = time.monotonic()
        self._error = ""
        self._server: Any = None
        self._pipeline: LocalPipeline | None = None
        self.node_id = ray.get_runtime_context().get_node_id()
        password = secrets.token_urlsafe(24)
        try:
            port = _free_port(host)
            self._server = EmbeddedServer(
                extra_args=["--port", str(port), "--bind", host, "--requirepass", password, "--maxclients", "10000"]
            ).start()
            bracketed = f"[{host}]" if ":" in host else host
            self.url = f"redis://:{password}@{bracketed}:{port}/0"
            self._pipeline = LocalPipeline(
                self.url, processes=processes, namespace=namespace, worker_args=list(worker_args)
            ).start()
        except Exception as exc:  # reported to every joining manager, not lost in the actor's log
            self._error = f"{type(exc).__name__}: {exc}"
            self.url = ""
        threading.Thread(target=self._watch, name="stream-reward-leases", daemon=True).start()

    def join(self, client: str) -> dict[str, Any]:
        with self._lock:
            self._leases[client] = time.monotonic() + self._lease_s
        return {"url": self.url, "node_id": self.node_id, "error": self._error}

    def renew(self, client: str) -> None:
        with self._lock:
            self._leases[client] = time.monotonic() + self._lease_s

    def leave(self, client: str) -> None:
        with self._lock:
            self._leases.pop(client, None)

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
            "node_id": self.node_id,
        }

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self._lease_s / 4))
            now = time.monotonic()
            with self._lock:
                self._leases = {c: t for c, t in self._leases.items() if t > now}
                idle = not self._leases and now - self._started > self._lease_s
            if idle:
                break
        log.info("no stream-reward manager holds a lease any more: stopping the shared server")
        if self._pipeline is not None:
            self._pipeline.stop()
        if self._server is not None:
            self._server.stop()
        os._exit(0)  # the actor process ends; Ray marks the actor dead and frees its name
