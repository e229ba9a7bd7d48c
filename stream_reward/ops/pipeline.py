"""A whole pipeline on this host: an embedded server (when no URL is given) and
worker processes. Used by ``demo``, ``score``, the verl drop-in and the tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from stream_reward.config import DEFAULT_NAMESPACE
from stream_reward.errors import WorkersDiedError
from stream_reward.ops.embedded import EmbeddedServer, die_with_parent, own_group_and_die_with_parent
from stream_reward.ops.worker_cli import worker_command
from stream_reward.wire.connection import cancel_until_done

__all__ = ["LocalPipeline", "spawn_worker"]

log = logging.getLogger(__name__)

# How long a guarded task gets to honour its cancellation (see LocalPipeline.guard).
_CANCEL_WAIT_S = 5.0


def spawn_worker(
    redis_url: str, *args: str, namespace: str = DEFAULT_NAMESPACE, quiet: bool = True, stderr: int | None = None
) -> subprocess.Popen[bytes]:
    """Start one worker process (``python -m stream_reward.worker``) with extra CLI ``args``."""
    argv = worker_command("--redis", redis_url, "--namespace", namespace, *args)
    if quiet and "--log-level" not in args:
        argv += ["--log-level", "WARNING"]
    # A local worker belongs to this process: if we die without stopping it (a
    # SIGKILLed trainer or bench), the kernel stops it rather than leaving it
    # retrying against a private server that died with us.
    # In a group of its own when we relay its stderr (a LocalPipeline): a Ctrl-C
    # reaches us only, and we stop the workers in order (one drain each).
    preexec = own_group_and_die_with_parent if stderr is not None else die_with_parent
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=stderr, preexec_fn=preexec)


class _StderrRelay(threading.Thread):
    """Passes a worker's stderr on to ours, line by line, and keeps its last
    ERROR line: the cause to name if the worker dies."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        super().__init__(daemon=True, name=f"stderr-{proc.pid}")
        self.proc = proc
        self.last_error: str | None = None

    def run(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            if " ERROR " in line or " CRITICAL " in line:
                # "<date> <time> ERROR logger[pid]: message" -> the message
                self.last_error = line.split("]: ", 1)[-1]
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write(line + "\n")
                sys.stderr.flush()


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
    _relays: list[_StderrRelay] = field(default_factory=list, init=False, repr=False)

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
        worker_args = list(self.worker_args)
        if self.server is not None:
            # A drain hands in-flight samples back for other workers to score. A private
            # server goes with the pipeline: nobody is left to take them, and a stop (a
            # Ctrl-C, a SIGTERM) would wait out the drain for nothing.
            worker_args += ["--drain-timeout-s", "0"]
        for _ in range(self.processes):
            proc = spawn_worker(
                self.url, *worker_args, namespace=self.namespace, quiet=self.quiet, stderr=subprocess.PIPE
            )
            self.workers.append(proc)
            relay = _StderrRelay(proc)
            relay.start()
            self._relays.append(relay)
        return self

    def check_workers(self) -> None:
        """Raise WorkersDiedError, naming the cause, once every worker has exited."""
        if not self.workers or any(proc.poll() is None for proc in self.workers):
            return
        for relay in self._relays:
            relay.join(timeout=1.0)  # its last lines, written as the worker died
        codes = sorted({proc.returncode for proc in self.workers})
        causes = [r.last_error for r in self._relays if r.last_error]
        cause = f": {causes[-1]}" if causes else ""
        raise WorkersDiedError(
            f"all {len(self.workers)} worker processes exited (exit code {', '.join(map(str, codes))}) "
            f"before the work was done{cause}"
        )

    async def watch_workers(self, poll_s: float = 0.2) -> None:
        """Never returns while a worker lives; raises WorkersDiedError once none does."""
        while True:
            self.check_workers()
            await asyncio.sleep(poll_s)

    async def guard(self, coro: Any) -> Any:
        """Await ``coro``, failing within ``poll_s`` of the last worker's death instead
        of waiting out a timeout for results nobody will write."""
        main = asyncio.ensure_future(coro)
        watch = asyncio.ensure_future(self.watch_workers())
        try:
            await asyncio.wait({main, watch}, return_when=asyncio.FIRST_COMPLETED)
            if main.done():
                return main.result()
            return watch.result()  # raises WorkersDiedError
        finally:
            # The main task is mostly inside a blocking read, where a cancel can be swallowed.
            await cancel_until_done((main, watch), _CANCEL_WAIT_S)

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
        for relay in self._relays:
            relay.join(timeout=1.0)  # EOF follows the worker's exit
            if not relay.is_alive() and relay.proc.stderr is not None:
                relay.proc.stderr.close()
        self.workers.clear()
        self._relays.clear()
        if self.server is not None:
            self.server.stop()
            self.server = None

    def __enter__(self) -> LocalPipeline:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
