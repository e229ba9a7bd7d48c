"""A whole pipeline on this host: an embedded server (when no URL is given) and
worker processes. Used by ``demo``, ``score``, the verl drop-in and the tests.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import time
from dataclasses import dataclass, field

from stream_reward.config import DEFAULT_NAMESPACE
from stream_reward.ops.embedded import EmbeddedServer, die_with_parent
from stream_reward.ops.worker_cli import worker_command

__all__ = ["LocalPipeline", "spawn_worker"]

log = logging.getLogger(__name__)


def spawn_worker(
    redis_url: str, *args: str, namespace: str = DEFAULT_NAMESPACE, quiet: bool = True
) -> subprocess.Popen[bytes]:
    """Start one worker process (``python -m workers``) with extra CLI ``args``."""
    argv = worker_command("--redis", redis_url, "--namespace", namespace, *args)
    if quiet and "--log-level" not in args:
        argv += ["--log-level", "WARNING"]
    # A local worker belongs to this process: if we die without stopping it (a
    # SIGKILLed trainer or bench), the kernel stops it rather than leaving it
    # retrying against a private server that died with us.
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)


@dataclass
class LocalPipeline:
    """``with LocalPipeline(processes=2) as p: p.url``. Starts a private server if
    ``redis_url`` is None, and ``processes`` workers with ``worker_args``."""

    redis_url: str | None = None
    processes: int = 2
    namespace: str = DEFAULT_NAMESPACE
    worker_args: list[str] = field(default_factory=list)
    quiet: bool = True

    server: EmbeddedServer | None = field(default=None, init=False)
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list, init=False)

    @property
    def url(self) -> str:
        if self.redis_url is not None:
            return self.redis_url
        if self.server is None:
            raise RuntimeError("pipeline not started")
        return self.server.url

    def start(self) -> LocalPipeline:
        if self.redis_url is None and self.server is None:
            self.server = EmbeddedServer().start()
        for _ in range(self.processes):
            self.workers.append(spawn_worker(self.url, *self.worker_args, namespace=self.namespace, quiet=self.quiet))
        return self

    def stop(self, timeout_s: float = 15.0) -> None:
        for proc in self.workers:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in self.workers:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.workers.clear()
        if self.server is not None:
            self.server.stop()
            self.server = None

    def __enter__(self) -> LocalPipeline:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
