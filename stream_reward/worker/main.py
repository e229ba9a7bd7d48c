"""Entry point of a worker pool: ``stream-reward worker`` and ``python -m stream_reward.worker``.

With ``--processes 1`` this process is the worker; with more, it becomes the
supervisor of that many worker processes (see ``stream_reward.worker.supervisor``).

Every setting can come from a config file (``--config``), the environment
(``STREAM_REWARD_*``) or a flag, in that order of precedence (see
``stream_reward.ops.settings``). Flags therefore default to None here, meaning "not
given"; ``resolve_args`` fills the effective values back into the namespace.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
from typing import Any

from stream_reward.errors import ConfigError, StreamRewardError
from stream_reward.ops import early_signals
from stream_reward.ops.health import check_health
from stream_reward.ops.logs import configure_logging as _configure_logging
from stream_reward.ops.worker_cli import DeprecationLines, add_worker_arguments, resolve_args
from stream_reward.scoring.registry import build_scorer
from stream_reward.wire.connection import set_default_timeout
from stream_reward.worker.watchdog import LoopWatchdog

__all__ = ["main", "run_worker", "run_from_args"]

log = logging.getLogger(__name__)

# The event loop blocked this long by one callback is logged (see stream_reward.worker.watchdog).
_LOOP_BLOCK_WARN_S = 1.0


async def run_worker(args: argparse.Namespace, *, handle_signals: bool = True) -> None:
    from stream_reward.worker.consumer import Worker

    settings = resolve_args(args)
    url = settings.require_redis()
    set_default_timeout(settings["connection.timeout_s"])
    stop = asyncio.Event()
    config = settings.consumer_config(args.consumer)
    if handle_signals:
        _install_signal_handlers(stop, config.drain_timeout_s)
    manager = settings.manager_config()
    scorer = build_scorer(manager)
    metrics = None
    port = settings["worker.metrics_port"]
    if port is not None:
        from stream_reward.worker.metrics import WorkerMetrics

        metrics = WorkerMetrics(
            namespace=config.namespace,
            group=config.group,
            consumer=config.consumer,
            scorer=manager.scorer,
            manager=manager.manager,
            verifier=manager.quota_key,
            heartbeat_interval_s=config.heartbeat_interval_s,
        )
    worker = Worker(url, scorer, config, hooks=metrics)
    # An async scorer that blocks the loop is named, and its timeout still fires.
    watchdog = LoopWatchdog(warn_after_s=min(_LOOP_BLOCK_WARN_S, manager.timeout), timeout_s=manager.timeout)
    if handle_signals:
        watchdog.start()
    refresher: asyncio.Task[None] | None = None
    refresher_stop = asyncio.Event()
    try:
        if metrics is not None:
            metrics.bind(worker)
            addr = settings["worker.metrics_addr"]
            try:
                bound = metrics.serve(port, addr)
            except OSError as exc:
                raise ConfigError(
                    "worker.metrics_port", f"cannot listen on {addr}:{port}: {exc.strerror or exc}"
                ) from None
            log.info("metrics on http://%s:%d/metrics", addr, bound)
            refresher = asyncio.create_task(
                metrics.refresh_forever(url, worker.keys, settings["worker.metrics_refresh_s"], refresher_stop)
            )
        await worker.run(stop, burst=args.burst)
    finally:
        watchdog.stop()
        if refresher is not None:
            refresher_stop.set()
            try:
                await asyncio.wait_for(asyncio.shield(refresher), 5)
            except asyncio.TimeoutError:  # TimeoutError from 3.11 on; not yet on 3.10
                refresher.cancel()
        if metrics is not None:
            metrics.close()
        close = getattr(scorer, "aclose", None)
        if close is not None:
            await close()
        await worker.aclose()


# Past the drain deadline, what is still running (a scorer that ignores
# cancellation, a command to a server gone silent) gets this long before the
# process leaves on its own; its unwritten entries stay pending for other workers.
_EXIT_GRACE_S = 5.0


def _install_signal_handlers(stop: asyncio.Event, drain_timeout_s: float) -> None:
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            # Second signal: the operator means it.
            log.warning("second %s: exiting now", signal.Signals(signum).name)
            os._exit(1)
        log.info("%s: draining in-flight samples, then exiting", signal.Signals(signum).name)
        stop.set()
        # A hard bound on the whole shutdown, whatever state the loop is in.
        backstop = threading.Timer(max(0.0, drain_timeout_s) + _EXIT_GRACE_S, _exit_now, (drain_timeout_s,))
        backstop.daemon = True
        backstop.start()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    for kept in early_signals.release():  # kept since the program's first instant
        on_signal(kept)


def _exit_now(drain_timeout_s: float) -> None:
    log.error("shutdown took longer than the drain timeout (%gs) plus %gs; exiting", drain_timeout_s, _EXIT_GRACE_S)
    logging.shutdown()
    os._exit(1)


def configure_logging(level: str, fmt: str = "text") -> None:
    _configure_logging(level, fmt)


# ---------------------------------------------------------------------- entry points
async def _join_namespace(url: str, config: Any) -> None:
    from stream_reward.wire.connection import connect, mask_url, with_reconnect
    from stream_reward.wire.eviction import check_eviction
    from stream_reward.wire.keys import Keys
    from stream_reward.wire.namespace import join_namespace

    client = connect(url)
    try:
        keys = Keys(config.namespace, config.partitions)
        await with_reconnect(
            lambda: check_eviction(client, f"worker on {mask_url(url)}", allow=config.allow_eviction),
            what="read maxmemory-policy",
        )
        await with_reconnect(lambda: join_namespace(client, keys), what="join namespace")
    finally:
        await client.aclose()


async def _join_unless_stopped(url: str, config: Any) -> bool:
    """The supervisor's namespace join, which retries while Redis is away; False if a
    SIGINT or SIGTERM stopped it first (Python's Ctrl-C was a traceback out of
    asyncio.run here, a SIGTERM a death without a word)."""
    loop = asyncio.get_running_loop()
    join = asyncio.current_task()
    assert join is not None
    stopped: list[int] = []

    def on_signal(signum: int) -> None:
        stopped.append(signum)
        join.cancel()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    for kept in early_signals.release():
        on_signal(kept)
    try:
        await _join_namespace(url, config)
    except asyncio.CancelledError:
        if not stopped:
            raise
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
    if stopped:
        log.info("%s before the workers started: exiting", signal.Signals(stopped[0]).name)
        return False
    early_signals.keep()  # until the supervisor's own handlers are in (it releases them)
    return True


def main(argv: list[str] | None = None) -> int:
    """``python -m stream_reward.worker`` keeps SIGINT and SIGTERM from its first instant until the
    worker's (or the supervisor's) own handlers are in; those act on what was kept."""
    if early_signals.pending():
        # A stop before the worker started: nothing is in flight, so it exits as a drained
        # stop does, 0. Quietly: its logging is not set up, and a supervisor or a demo
        # stopping a worker that is still starting has nothing to report.
        early_signals.release()
        return 0
    parser = argparse.ArgumentParser(prog="stream-reward worker", description="Run a pool of reward workers.")
    add_worker_arguments(parser)
    # An old flag or environment variable: one line of ours, not Python's warning.
    with DeprecationLines().catching() as deprecations:
        deprecations.name(parser.prog)
        args = parser.parse_args(argv)
        return run_from_args(args)


def run_from_args(args: argparse.Namespace) -> int:
    try:
        settings = resolve_args(args)
    except ConfigError as exc:
        # Logging is not configured yet: its level and format are settings too.
        print(f"stream-reward worker: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings["worker.log_level"], settings["worker.log_format"])
    set_default_timeout(settings["connection.timeout_s"])  # every client this process builds
    try:
        if args.check:
            healthy, message = asyncio.run(check_health(settings, consumer=args.consumer))
            print(message, file=sys.stdout if healthy else sys.stderr)
            return 0 if healthy else 1
        url = settings.require_redis()
        if settings["worker.processes"] > 1:
            from stream_reward.worker.supervisor import supervise

            # Refuse a namespace of another protocol version here, once: a child
            # exiting 2 would otherwise be restarted by the supervisor forever.
            if not asyncio.run(_join_unless_stopped(url, settings.consumer_config(args.consumer))):
                return 0  # stopped: no worker to drain

            return supervise(args)
        asyncio.run(run_worker(args))
    except StreamRewardError as exc:
        log.error("%s", exc)
        return 2
    return 0
