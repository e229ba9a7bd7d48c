"""Where a verl job's worker processes run (``StreamRewardLoopManager``).

verl 0.9.1 starts ``reward.num_workers`` RewardLoopWorker actors (default 8), each
building its own reward manager. A server and a worker pool per actor would split a
quota eight ways and start eight times the processes, so:

* ``reward_kwargs.redis_url`` set: the manager only pushes and awaits; the workers run
  anywhere (``stream-reward worker``), or ``num_workers`` local ones per manager.
* Ray running (the verl job): one server and one worker pool for the whole job. The
  first manager creates a named detached actor (``SharedPipeline``, named by the job
  id and the worker options, ``stream_reward.verl.shared``) that starts the server on
  TCP with a random password and ``num_workers`` worker processes (default 2); every
  other manager finds it by name. Detached, so it does not die with whichever actor
  happened to create it; its holders, not Ray's ownership, tie it to the job: it ends
  once the last manager is gone (its process, on this node; its lease of
  ``server_lease_s``, elsewhere; or its ``close()``). Each manager keeps a ``hold()``
  call pending on it and learns of its death within a second; it then joins or
  creates the next actor by the same name (``_SharedLease.recover``).
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
from stream_reward.verl.shared import STOPPING, SharedPipeline

__all__ = ["Placement", "attach", "SharedPipeline", "RAY_NAMESPACE"]

log = logging.getLogger(__name__)

RAY_NAMESPACE = "stream_reward"
_DEFAULT_PROCESSES = 2
_ATTACH_S = 45.0  # a new actor: Ray starts a process, the server and workers start (the 60 s budget)
_PROBE_S = 10.0  # does the actor still answer
_RETRY_S = 0.25


@dataclass
class Placement:
    """The server a manager talks to, and how to let go of it."""

    url: str
    kind: str  # "external" | "shared" | "private"
    release: Callable[[], None]
    # Why the pipeline under this manager is gone (every local worker exited, the shared
    # actor died), None while it runs: windows in flight fail at once instead of waiting
    # out their reads' retries.
    lost: Callable[[], str | None] = lambda: None
    # After a failure of the server: a new URL when the server was replaced (the shared
    # actor died and a new one runs), None when there is nothing to re-attach to.
    recover: Callable[[], str | None] = lambda: None


def attach(options: LoopOptions) -> Placement:
    if options.redis_url:
        pipeline = LocalPipeline(
            options.redis_url,
            processes=options.num_workers or 0,
            namespace=options.namespace,
            worker_args=options.worker_args(),
        ).start()
        return Placement(options.redis_url, "external", pipeline.stop, _lost(pipeline))
    if _ray_running():
        return _attach_shared(options)
    processes = _DEFAULT_PROCESSES if options.num_workers is None else options.num_workers
    if processes < 1:
        raise ConfigError("reward.reward_kwargs.num_workers", "a private server needs local workers (>= 1)")
    pipeline = LocalPipeline(None, processes=processes, namespace=options.namespace, worker_args=options.worker_args())
    pipeline.start()
    return Placement(pipeline.url, "private", pipeline.stop, _lost(pipeline))


def _lost(pipeline: LocalPipeline) -> Callable[[], str | None]:
    # Local workers that all died (a bad scorer, a crash at start) would leave run_single
    # waiting for the deadline: the manager asks this and fails the sample at once.
    def lost() -> str | None:
        if not pipeline.workers or any(proc.poll() is None for proc in pipeline.workers):
            return None
        return "every local worker process exited; see the workers' stderr"

    return lost


def _ray_running() -> bool:
    ray = sys.modules.get("ray")  # never import Ray for a job that does not use it
    return ray is not None and ray.is_initialized()


def shared_name(options: LoopOptions, job_id: str) -> str:
    digest = hashlib.sha256(
        "\0".join([*options.worker_args(), options.namespace, str(options.num_workers), options.server_host]).encode()
    ).hexdigest()[:12]
    return f"stream-reward-{job_id}-{digest}"


def _attach_shared(options: LoopOptions) -> Placement:
    lease = _SharedLease(options)
    url = lease.attach(time.monotonic() + _ATTACH_S)
    return Placement(url, "shared", lease.release, lost=lease.lost, recover=lease.recover)


class _SharedLease:
    """One manager's hold on the job's shared actor: joins (creating it if the name is
    free), renews from a thread, re-attaches when the actor died, leaves on release."""

    def __init__(self, options: LoopOptions) -> None:
        import ray  # type: ignore[import-not-found]

        from stream_reward.ops.reaper import start_time

        self._options = options
        context = ray.get_runtime_context()
        self._node_id = context.get_node_id()
        self._name = shared_name(options, context.get_job_id())
        self._client = uuid.uuid4().hex
        # The actor watches this process directly when it runs on the same node: a
        # RewardLoopWorker ended by ray.kill runs no cleanup, but its pid goes away.
        self._holder = {"pid": os.getpid(), "start": start_time(os.getpid()), "node_id": self._node_id}
        self._actor: Any = None
        self.url = ""
        self._generation = 0  # one per actor joined
        self._lost: dict[int, str] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def _create(self) -> Any:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # type: ignore[import-not-found]

        options = self._options
        return (
            ray.remote(SharedPipeline)
            .options(
                name=self._name,
                namespace=RAY_NAMESPACE,
                lifetime="detached",
                get_if_exists=True,
                num_cpus=0,
                # A thread per call: each manager keeps one hold() pending for the actor's life.
                max_concurrency=64,
                # On this node: the server listens on this node's server_host.
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=self._node_id, soft=False),
            )
            .remote(
                options.worker_args(),
                _DEFAULT_PROCESSES if options.num_workers is None else options.num_workers,
                options.namespace,
                options.server_host,
                options.server_lease_s,
            )
        )

    def attach(self, deadline: float) -> str:
        """Join the job's actor, creating it when the name is free; wait out one that is
        retiring or dead (its name is freed when Ray records the death)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError  # type: ignore[import-not-found]

        cause = "no answer"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StreamRewardError(
                    f"the job's shared stream-reward server ({self._name}) did not come up within {_ATTACH_S:.0f} s: "
                    f"{cause}"
                )
            actor = self._create()
            try:
                info = ray.get(actor.join.remote(self._client, self._holder), timeout=remaining)
            except RayActorError as exc:
                cause = f"its actor died: {_first_line(exc)}"
                time.sleep(_RETRY_S)
                continue
            except GetTimeoutError:
                continue
            if info.get("error") == STOPPING:
                cause = "the previous actor is still stopping"
                time.sleep(_RETRY_S)
                continue
            if info.get("error"):
                raise StreamRewardError(f"the job's shared stream-reward server failed to start: {info['error']}")
            break
        if info["node_id"] != self._node_id and self._options.server_host in ("127.0.0.1", "localhost", "::1"):
            raise ConfigError(
                "reward.reward_kwargs.server_host",
                "the job's shared server listens on loopback of another node; in a multi-node job set "
                "server_host to an address every node reaches, or give a redis_url",
            )
        with self._lock:
            first = self._actor is None
            self._actor, self.url = actor, info["url"]
            self._generation += 1
            generation = self._generation
        # Resolves (with an error) the moment Ray records the actor's death, and when it
        # retires: no polling, no thread.
        actor.hold.remote().future().add_done_callback(lambda done: self._on_lost(generation, done))
        if first:
            threading.Thread(target=self._renew, name="stream-reward-lease", daemon=True).start()
        return self.url

    def _on_lost(self, generation: int, done: Any) -> None:
        error = done.exception()
        cause = f"it died: {_first_line(error)}" if error is not None else f"it stopped: {done.result()}"
        with self._lock:
            self._lost[generation] = f"the job's shared stream-reward actor {self._name} is gone ({cause})"

    def lost(self) -> str | None:
        with self._lock:
            return self._lost.get(self._generation)

    def recover(self) -> str | None:
        """After the server failed under a manager: the URL of a new server when the
        actor hosting the old one is gone (a new actor, started here or by another
        manager), None when the actor lives on (the fault is not the actor's)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        with self._lock:
            actor, url = self._actor, self.url
        try:
            info = ray.get(actor.join.remote(self._client, self._holder), timeout=_PROBE_S)
            if info.get("url") == url and not info.get("error"):
                return None
        except (RayActorError, GetTimeoutError):
            pass
        log.warning("the job's shared stream-reward actor %s is gone: starting or joining a new one", self._name)
        return self.attach(time.monotonic() + _ATTACH_S)

    def _renew(self) -> None:
        import ray

        period = self._options.server_lease_s / 4
        while not self._stop.wait(period):
            with self._lock:
                actor = self._actor
            with contextlib.suppress(Exception):
                ray.get(actor.renew.remote(self._client, self._holder), timeout=self._options.server_lease_s / 2)

    def release(self) -> None:
        import ray

        self._stop.set()
        with self._lock:
            actor = self._actor
        if actor is not None:
            with contextlib.suppress(Exception):
                ray.get(actor.leave.remote(self._client), timeout=10)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
