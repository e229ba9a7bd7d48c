"""The ``stream-reward`` command. Thin: each subcommand parses, then calls the library.

Adding a subcommand: write ``cmd_NAME(args) -> int`` and register it in
``build_parser`` with ``_add_common(p)`` for the shared connection, config and
logging flags; ``_settings(args)`` gives the effective settings (config file <
environment < flags), already resolved before the command runs. A command with
sub-actions (``config show``) gets its own subparsers via ``_actions(sub, ...)``.
"""

from __future__ import annotations

import os
import sys

from stream_reward.ops import early_signals

# A Ctrl-C in the imports below is kept, not raised as a traceback: main() stops on it at
# once. Only when this module is the program (`stream-reward`, `python -m
# stream_reward.cli`): a program that imports it keeps its own signals.
if __name__ == "__main__" or os.path.basename(sys.argv[0]) == "stream-reward":
    early_signals.keep()

import argparse
import asyncio
import json
import logging
import signal
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from stream_reward._version import __version__
from stream_reward.errors import StreamRewardError
from stream_reward.ops.health import check_health
from stream_reward.ops.logs import LOG_FORMATS, configure_logging, progress_bar
from stream_reward.ops.settings import Settings
from stream_reward.ops.worker_cli import (
    DeprecationLines,
    add_allow_eviction,
    add_deprecated_flag,
    add_worker_arguments,
    resolve_args,
    resolve_flags,
    worker_command,
)
from stream_reward.wire.connection import set_default_timeout

__all__ = ["main", "build_parser"]

log = logging.getLogger(__name__)

# How far past a command's --timeout its own bound fires (see _bounded).
_TIMEOUT_SLACK_S = 1.0


class _TimedOut(StreamRewardError):
    """A command ran out its --timeout before the library could say more."""


# Flags shared by the commands (argparse dest) -> settings key.
CLI_FLAG_KEYS = {
    "redis": "connection.redis",
    "namespace": "connection.namespace",
    "allow_eviction": "connection.allow_eviction",
    "redis_timeout_s": "connection.timeout_s",
    "scorer": "reward.scorer",
    "manager": "reward.manager",
    "log_level": "worker.log_level",
    "log_format": "worker.log_format",
}


def _add_logging(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default=None, help="default: WARNING (INFO for worker)")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=None, help="text (default) or json lines")


def _add_common(parser: argparse.ArgumentParser, *, redis_required: bool = False) -> None:
    where = "required, no default: here," if redis_required else "default: a private embedded server; or"
    parser.add_argument(
        "--redis",
        default=None,
        help=f"Redis URL: redis://, rediss://, unix://, redis+cluster:// ({where} "
        "in the config / $STREAM_REWARD_CONNECTION_REDIS)",
    )
    parser.add_argument("--namespace", default=None, help="key namespace (default: sr)")
    parser.add_argument(
        "--redis-timeout-s",
        type=float,
        default=None,
        help="seconds a Redis round trip may take before it counts as a fault (default: 5; connection.timeout_s)",
    )
    add_allow_eviction(parser)
    parser.add_argument(
        "--config", default=None, help="config file (TOML, YAML or JSON); default: $STREAM_REWARD_CONFIG"
    )
    _add_logging(parser)
    parser.set_defaults(redis_required=redis_required)


def _actions(sub: Any, name: str, help: str) -> Any:
    """A command with sub-actions (``config show``, ``dlq list``): returns their subparsers."""
    parser = sub.add_parser(name, help=help)
    return parser.add_subparsers(dest=f"{name}_action", required=True)


def _settings(args: argparse.Namespace) -> Settings:
    """The effective settings of a command (config file < env < flags), written back into ``args``."""
    settings = resolve_flags(args, CLI_FLAG_KEYS)
    if getattr(args, "redis_required", False):
        settings.require_redis()
    return settings


def _configure_logging(args: argparse.Namespace, settings: Any) -> None:
    level = getattr(args, "log_level", None)
    fmt = getattr(args, "log_format", None) or "text"
    if settings is not None:
        level = settings["worker.log_level"] if settings.is_set("worker.log_level") else None
        fmt = settings["worker.log_format"]
    configure_logging(level or "WARNING", fmt)


def _processes(args: argparse.Namespace, default: int = 2) -> int:
    """Worker processes for demo/score: the flag, else the config's, else ``default``."""
    if args.processes is not None:
        return int(args.processes)
    settings = _settings(args)
    return int(settings["worker.processes"]) if settings.is_set("worker.processes") else default


def _pipeline_worker_args(args: argparse.Namespace) -> list[str]:
    """What a local pipeline's workers are given: the same config file, and the flags given here."""
    settings = _settings(args)
    # Each local worker is one process, whatever the config says; and they cannot
    # share one metrics port, so they take free ones (logged by each worker).
    out = ["--processes", "1"]
    if args.config:
        out += ["--config", args.config]
    if settings["worker.metrics_port"] is not None:
        out += ["--metrics-port", "0"]
    for dest in ("scorer", "manager"):
        if hasattr(args, dest) and settings.source(CLI_FLAG_KEYS[dest]) == "flag":
            out += [f"--{dest}", getattr(args, dest)]
    if settings.source(CLI_FLAG_KEYS["allow_eviction"]) == "flag":
        out.append("--allow-eviction")
    if settings.source(CLI_FLAG_KEYS["redis_timeout_s"]) == "flag":
        out += ["--redis-timeout-s", repr(settings["connection.timeout_s"])]
    return out


async def _watch_batch(url: str, namespace: str, batch_id: str, progress: Any, poll_s: float = 0.2) -> None:
    """Advance ``progress`` as a batch's results land (HLEN of its ledgers: no re-reading results)."""
    from stream_reward.trainer.aggregator import RewardAggregator
    from stream_reward.wire.keys import Keys

    async with RewardAggregator(url, namespace=namespace) as agg:
        while True:
            try:
                meta = await agg.meta(batch_id)
                break
            except StreamRewardError:  # not opened yet
                await asyncio.sleep(poll_s)
        keys = Keys(namespace, meta.partitions)
        progress.update(0, total=meta.size)
        while True:
            done = 0
            for p in range(keys.partitions):
                done += int(await agg.client.hlen(keys.results(batch_id, p, meta.group)))
            progress.update(done)
            if done >= meta.size:
                return
            await asyncio.sleep(poll_s)


async def _with_watcher(coro: Any, watcher: Any) -> Any:
    task = asyncio.create_task(watcher) if watcher is not None else None
    try:
        return await coro
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _bounded(coro: Any, timeout_s: float | None, what: str, url: str | None) -> Any:
    """``coro`` under ``timeout_s`` in all, connection attempts included (a server that
    does not answer is retried inside, past any one command's timeout)."""
    if timeout_s is None:
        return await coro
    try:
        # A little past the timeout: a batch that times out on its own says how far it got.
        return await asyncio.wait_for(coro, timeout_s + _TIMEOUT_SLACK_S)
    except asyncio.TimeoutError:
        from stream_reward.wire.connection import mask_url

        where = f" (Redis at {mask_url(url)} not answering?)" if url else ""
        raise _TimedOut(f"{what}: no answer within the {timeout_s:g}s timeout{where}") from None


async def _produce(url: str, rollouts: Any, response_len: int, settings: Any, rate: float | None = None) -> None:
    """``rollouts.produce_rollouts`` with the configured failure policy and producer options."""
    from stream_reward.trainer.rollouts import produce_rollouts

    await produce_rollouts(
        url, rollouts, response_len, settings.producer_config(), settings.batch_policy(), rate_per_s=rate
    )


T = TypeVar("T")


# Signals the command was sent (SIGTERM, Ctrl-C), kept: their raise can be lost where it
# lands (see _on_signal), so the next safe point raises them again (_check_signals).
_received: list[int] = []


@dataclass
class _LoopSignals:
    """While _run_async runs a loop: its main task, which a signal cancels instead of
    raising inside the loop (where a raise in any task but the main one came out as
    "Task exception was never retrieved"). ``task`` is None in asyncio.run's set-up and
    tear-down, where a signal is only kept (raised there, it left the command's coroutine
    "never awaited", or the loop half closed)."""

    loop: asyncio.AbstractEventLoop | None = None
    task: asyncio.Task[Any] | None = None


_in_loop: _LoopSignals | None = None


class _Interrupted(KeyboardInterrupt):
    """Ctrl-C as the CLI raises it. Not a plain KeyboardInterrupt: Python marks one that
    leaves code run by exec() or eval() of source text (dataclasses' and namedtuple's
    generated methods, parts of torch's import) as unhandled for good, and under
    ``python -m`` killed itself with SIGINT at exit (status -2) after main() had caught
    it and returned 130. That mark is set for KeyboardInterrupt itself, not a subclass."""


def _signalled(signum: int) -> BaseException:
    return _Interrupted() if signum == signal.SIGINT else SystemExit(128 + signum)


def _on_signal(signum: int, frame: Any) -> None:
    """The CLI's SIGTERM and SIGINT handler, from main() to its return.

    Outside the event loop: unwind like Ctrl-C does, so the with-blocks stop the workers
    and the private server and remove the temp dir (a plain SIGTERM death would leave
    them). Some places drop what is raised there: torch's C extension (its own numpy
    import), the at-fork hooks subprocess runs after each fork. The signal is kept for
    _check_signals. Inside the loop: cancel the main task, as asyncio.run does for
    Ctrl-C (the first time; a second signal raises at once: the operator means it)."""
    _received.append(signum)
    state = _in_loop
    if state is None:
        raise _signalled(signum)
    if state.task is None:
        return  # asyncio.run's set-up or tear-down: _run_async raises it once out
    if len(_received) > 1:
        raise _signalled(signum)
    state.task.cancel()
    if state.loop is not None:
        state.loop.call_soon_threadsafe(lambda: None)  # wake a loop asleep in select()


def _check_signals() -> None:
    if _received:
        raise _signalled(_received[0])


def _quiet_lost_signal(unraisable: Any) -> None:
    """A raise of _on_signal that Python dropped, in an at-fork hook or a __del__: not a
    fault to print with a traceback; _check_signals raises it again."""
    if _received and isinstance(unraisable.exc_value, (KeyboardInterrupt, SystemExit)):
        return
    sys.__unraisablehook__(unraisable)


def _run_async(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run``, where a signal cancels the main task (so its ``finally`` blocks
    run) and surfaces once the loop is closed: SIGTERM as ``SystemExit(143)``, Ctrl-C as
    KeyboardInterrupt (see _on_signal). Signals stay with main()'s handler throughout:
    handing them to the loop (``add_signal_handler``) and back left SIG_DFL for a moment,
    where a SIGTERM killed the command without its clean-up."""
    global _in_loop
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != _on_signal:
        return asyncio.run(coro)  # not under main(): the caller's signals, as they are
    state = _LoopSignals()

    async def main() -> T:
        state.loop = asyncio.get_running_loop()
        state.task = asyncio.current_task()
        try:
            if _received:
                # One kept from before the loop ran the command (a lost raise: torch's
                # import, a fork; or asyncio.run's set-up): the command never starts.
                _discard(coro)
                raise asyncio.CancelledError
            return await coro
        finally:
            state.task = None

    previous, _in_loop = _in_loop, state
    try:
        result = asyncio.run(main())
    except asyncio.CancelledError:
        _check_signals()  # a signal's cancel, as the signal
        raise
    finally:
        _in_loop = previous
    _check_signals()  # the coroutine took the cancel and returned: still a signal
    return result


def _discard(coro: Any) -> None:
    """Close a coroutine that never started, and those it was given as arguments
    (``guard(run_demo(...))``): left to the garbage collector, each would warn
    "coroutine ... was never awaited"."""
    frame = getattr(coro, "cr_frame", None)
    args = list(frame.f_locals.values()) if frame is not None else []
    coro.close()
    for arg in args:
        if asyncio.iscoroutine(arg):
            _discard(arg)


def _import_torch_first(feature: str) -> None:
    """torch's import takes seconds, outside the event loop: a signal that comes during it
    waits for its end (see ``import_torch``) and then stops the command before the loop
    starts it."""
    from stream_reward.trainer.tensors import import_torch

    import_torch(feature)


# ---------------------------------------------------------------------- commands
def cmd_server(args: argparse.Namespace) -> int:
    stop = {"flag": False}

    def on_signal(signum: int, frame: Any) -> None:
        stop["flag"] = True

    # Handlers first, before the server's import (a SIGTERM there was a death by signal):
    # whoever reads the URL may signal us right away.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if early_signals.release():
        return 0  # stopped before it started, as a stop of a running server exits
    from stream_reward.ops.embedded import EmbeddedServer

    if args.dir is not None:
        os.makedirs(args.dir, exist_ok=True)
    # With --dir the data (AOF with --appendonly) lives there and outlives the server;
    # without it, in the server's temp dir, removed on exit.
    with EmbeddedServer(appendonly=args.appendonly, data_dir=os.path.abspath(args.dir) if args.dir else None) as server:
        print(server.url, flush=True)
        while not stop["flag"]:
            time.sleep(0.2)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    """Check the settings here (one clear line on a mistake), then become the worker program."""
    settings = resolve_args(args)
    if args.check:
        if early_signals.release():  # Python's handlers back for the check
            return 0
        healthy, message = _run_async(check_health(settings, consumer=args.consumer))
        print(message, file=sys.stdout if healthy else sys.stderr)
        return 0 if healthy else 1
    settings.require_redis()
    # Signals kept since the program's first instant (see main) end here: one that came is
    # a worker stopped before it started (0, as stream_reward.worker.main exits for one). From here
    # through the exec they are blocked, not lost: the worker program takes them at its
    # first instant (early_signals.keep unblocks them).
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM))
    if early_signals.release():
        return 0  # left blocked: the process is leaving
    # exec, not a child: signals from the terminal or a service manager reach the
    # worker itself, and the library never imports the runnable side.
    try:
        os.execv(sys.executable, worker_command(*args.worker_argv))
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
        raise
    return 0  # not reached


def cmd_produce(args: argparse.Namespace) -> int:
    from stream_reward.trainer.rollouts import read_rollouts

    settings = _settings(args)
    rollouts = read_rollouts(args.file, args.batch)
    for error in rollouts.bad_lines.values():
        print(f"{args.file}: {error}", file=sys.stderr)
    _run_async(_produce(args.redis, rollouts, args.response_len, settings, args.rate))
    print(json.dumps({"batch": args.batch, "pushed": len(rollouts.trajectories), "bad_lines": len(rollouts.bad_lines)}))
    return 0


def cmd_collect(args: argparse.Namespace) -> int:
    from stream_reward.trainer.aggregator import RewardAggregator

    with progress_bar(f"collecting {args.batch}", total=0, enabled=not args.json) as progress:

        async def run() -> Any:
            async with RewardAggregator(
                args.redis, namespace=args.namespace, allow_eviction=bool(args.allow_eviction)
            ) as agg:
                watcher = _watch_batch(args.redis, args.namespace, args.batch, progress) if progress.drawn else None
                return await _with_watcher(agg.collect(args.batch, timeout_s=args.timeout_s), watcher)

        rewards = _run_async(_bounded(run(), args.timeout_s, f"collect {args.batch!r}", args.redis))
    if args.out:
        from stream_reward.trainer.tensors import import_torch

        torch = import_torch("collect --out")

        torch.save(
            {
                "rm_scores": rewards.rm_scores,
                "valid": rewards.valid,
                "scores": rewards.scores,
                "status": rewards.status,
                "indices": rewards.indices,
                "reward_extra_info": rewards.reward_extra_info,
            },
            args.out,
        )
    summary = {
        "batch": args.batch,
        "n": rewards.n,
        "scores": rewards.scores,
        "status": rewards.status,
        "rm_scores_shape": list(rewards.rm_scores.shape),
        "reward_extra_info": rewards.reward_extra_info,
        "indices": rewards.indices,
        "errors": rewards.errors,
    }
    if args.json:
        print(json.dumps(summary, default=repr))
    else:
        counts = rewards.status_counts()
        print(f"batch {args.batch}: n={rewards.n} status={counts} rm_scores={tuple(rewards.rm_scores.shape)}")
        for index, score, status in zip(rewards.indices, rewards.scores, rewards.status):
            print(f"  {index:>6}  {status:<6}  {score:.4f}")
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    from stream_reward.ops.pipeline import LocalPipeline
    from stream_reward.trainer.aggregator import RewardAggregator
    from stream_reward.trainer.rollouts import read_rollouts, result_rows

    settings = _settings(args)
    batch_id = f"score-{int(time.time() * 1000)}"
    rollouts = read_rollouts(args.file, batch_id)
    for error in rollouts.bad_lines.values():
        print(f"{args.file}: {error}", file=sys.stderr)
    worker_args = _pipeline_worker_args(args)
    with (
        LocalPipeline(
            args.redis, processes=_processes(args), namespace=args.namespace, worker_args=worker_args
        ) as pipeline,
        progress_bar("scoring", total=rollouts.size) as progress,
    ):
        _import_torch_first("the reward tensors")

        async def run() -> Any:
            await _produce(pipeline.url, rollouts, args.response_len, settings)
            async with RewardAggregator(
                pipeline.url, namespace=args.namespace, allow_eviction=bool(args.allow_eviction)
            ) as agg:
                watcher = _watch_batch(pipeline.url, args.namespace, batch_id, progress) if progress.drawn else None
                return await _with_watcher(agg.collect(batch_id, timeout_s=args.timeout_s), watcher)

        # Workers that die (an unloadable scorer, a wrong password) fail the command
        # in seconds, naming the cause, instead of at --timeout.
        rewards = _run_async(pipeline.guard(run()))
    rows = result_rows(rewards)
    out = open(args.out, "w", encoding="utf-8") if args.out else sys.stdout
    try:
        for row in rows:
            out.write(json.dumps(row, default=repr) + "\n")
    finally:
        if args.out:
            out.close()
    if args.out:
        print(f"scored {len(rows)} samples: {rewards.status_counts()} -> {args.out}", file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from stream_reward.ops.demo import run_demo
    from stream_reward.ops.pipeline import LocalPipeline

    _settings(args)
    processes = _processes(args)
    with (
        LocalPipeline(
            args.redis, processes=processes, namespace=args.namespace, worker_args=_pipeline_worker_args(args)
        ) as pipeline,
        progress_bar("scoring as rollouts stream", total=args.n, enabled=not args.json) as progress,
    ):
        _import_torch_first("the demo's reward tensors")
        report = _run_async(
            pipeline.guard(
                run_demo(
                    pipeline.url,
                    args.n,
                    namespace=args.namespace,
                    generation_s=args.generation_s,
                    progress=progress if progress.drawn else None,
                )
            )
        )
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        print(f"stream-reward demo: {report.n} trajectories, {processes} worker processes")
        print(f"  status:      {report.status}")
        print(f"  accuracy:    {report.accuracy:.3f}")
        print(
            f"  throughput:  {report.throughput_traj_per_s:,.0f} trajectories/s (a burst of n, first push -> rm_scores)"
        )
        print(f"  generation:  {report.generation_s:.2f} s (last push)")
        print(f"  reward tail: {report.reward_tail_s * 1000:.1f} ms (last push -> rm_scores ready)")
        print(f"  rm_scores:   {report.rm_scores_shape} float32")
    return 0


def cmd_gateway(args: argparse.Namespace) -> int:
    """The HTTP gateway (``stream_reward/gateway/``) in front of a local pipeline, or only
    producing and collecting against ``--redis`` (workers elsewhere)."""
    import copy

    from stream_reward.gateway.serve import serve_forever
    from stream_reward.gateway.service import GatewayConfig
    from stream_reward.ops.pipeline import LocalPipeline
    from stream_reward.scoring.columns import parse_columns

    settings = _settings(args)
    extra_logs = parse_columns(args.extra_logs.split(",") if args.extra_logs else [], "--extra-logs")
    # With --redis the workers are the cluster's: none here unless asked for.
    processes = args.processes if args.processes is not None else (0 if args.redis else _processes(args))
    with LocalPipeline(
        args.redis, processes=processes, namespace=args.namespace, worker_args=_pipeline_worker_args(args)
    ) as pipeline:
        _import_torch_first("the gateway's result collection")
        config = GatewayConfig(
            pipeline.url,
            settings.producer_config(),
            data_source=args.data_source,
            on_failure=args.on_failure,
            timeout_s=args.timeout_s,
            max_body_bytes=int(args.max_body_mb * 1024 * 1024),
            max_samples=args.max_samples,
            extra_logs=extra_logs,
        )
        probed = copy.deepcopy(settings)
        probed.values["connection"]["redis"] = pipeline.url

        def ready(url: str) -> None:
            print(url, flush=True)

        serving = serve_forever(config, lambda: check_health(probed), host=args.host, port=args.port, ready=ready)
        _run_async(pipeline.guard(serving))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from stream_reward.ops.status import read_status, render_status

    settings = _settings(args)
    interval = settings["consumer.heartbeat_interval_s"]
    window = args.window_s if args.window_s is not None else 1.5 * interval
    partitions = args.partitions or (
        settings["connection.partitions"] if settings.is_set("connection.partitions") else None
    )
    quota = settings.values["quota"]
    limits = {}
    if quota.get("quota_key"):
        limits[quota["quota_key"]] = {
            "max_rpm": quota.get("max_rpm"),
            "max_tpm": quota.get("max_tpm"),
            "max_concurrent": quota.get("max_concurrent"),
            "estimated_tokens_per_request": quota.get("estimated_tokens_per_request"),
        }
    status = _run_async(
        read_status(
            args.redis,
            args.namespace,
            partitions=partitions,
            heartbeat_interval_s=interval,
            window_s=window,
            batch_limit=args.batches,
            quota_limits=limits,
        )
    )
    if args.json:
        print(json.dumps(status, default=repr))
    else:
        render_status(status)
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    from stream_reward.ops.settings import env_name

    settings = _settings(args)
    shown = settings.as_dict(masked=True)
    if args.json:
        print(
            json.dumps(
                {"file": settings.path, "config": shown, "sources": dict(sorted(settings.sources.items()))},
                default=repr,
            )
        )
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"effective config (file: {settings.path or 'none'}; precedence file < env < flag)", title_justify="left"
    )
    for col in ("key", "value", "from", "environment variable"):
        table.add_column(col)
    for section, values in shown.items():
        for key, value in values.items():
            dotted = f"{section}.{key}"
            text = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
            table.add_row(dotted, text, settings.source(dotted), env_name(dotted))
    Console().print(table)
    return 0


def cmd_dlq_list(args: argparse.Namespace) -> int:
    from stream_reward.ops.deadletters import list_dead_letters

    _settings(args)
    letters = _run_async(
        list_dead_letters(args.redis, namespace=args.namespace, partitions=args.partitions, count=args.count)
    )
    rows = [letter.summary() for letter in letters]
    if args.json:
        print(json.dumps({"namespace": args.namespace, "count": len(rows), "dead_letters": rows}))
        return 0
    if not rows:
        print(f"no dead letters in namespace {args.namespace!r}")
    for row in rows:
        print(
            f"{row['id']:>22}  p{row['partition']}  {row['reason']:<16} batch={row['batch']} index={row['index']} "
            f"deliveries={row['deliveries']}  {row['error']}"
        )
    return 0


def cmd_dlq_redrive(args: argparse.Namespace) -> int:
    from stream_reward.ops.deadletters import redrive_dead_letters

    _settings(args)
    moved = _run_async(
        redrive_dead_letters(args.redis, namespace=args.namespace, partitions=args.partitions, ids=args.ids or None)
    )
    print(json.dumps({"namespace": args.namespace, "redriven": moved}))
    return 0


BENCHES = (
    "throughput",
    "per_sample",
    "overlap",
    "latency",
    "memory",
    "vs_verl",
    "verl_loop",
    "quota",
    "sandbox",
    "faults",
    "scale",
    "composite",
    "math_verify",
    "gateway",
)


def cmd_bench(args: argparse.Namespace) -> int:
    """Each bench is ``stream_reward/bench/NAME.py`` with ``main(argv) -> int``. On a terminal a
    spinner runs meanwhile; a bench's own ``logs.progress_bar`` calls nest under it."""
    import importlib

    module = importlib.import_module(f"stream_reward.bench.{args.name}")
    with progress_bar(f"bench {args.name}", enabled="--json" not in args.rest):
        return int(module.main(args.rest) or 0)


# ---------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:

    parser = _Parser(prog="stream-reward", description="Async streaming reward pipeline for LLM RL.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks (also: --debug after the command)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="simulated rollout step scored as it streams (embedded server if no --redis)")
    _add_common(p)
    p.add_argument("--n", type=int, default=2000, help="samples in the simulated step (default: 2000)")
    p.add_argument("--processes", type=int, default=None, help="worker processes (default: the config's, else 2)")
    p.add_argument(
        "--generation-s", type=float, default=3.0, help="simulated generation time of the step (default: 3.0)"
    )
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("server", help="run an embedded server in the foreground; prints its URL first")
    p.add_argument("--appendonly", action="store_true", help="persist with AOF (kept across restarts only with --dir)")
    p.add_argument("--dir", default=None, help="data directory (AOF files); default: a temp dir removed on exit")
    _add_logging(p)
    p.set_defaults(func=cmd_server)

    p = sub.add_parser("worker", help="run a pool of worker processes (--check: health check)")
    add_worker_arguments(p)
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("produce", help="push a JSONL dump of rollouts as one batch")
    _add_common(p, redis_required=True)
    p.add_argument("--batch", required=True, help="batch id the rollouts are pushed as")
    p.add_argument(
        "--response-len", type=int, default=1024, help="width of the batch's rm_scores rows, in tokens (default: 1024)"
    )
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        help="replay at a steady R trajectories per second, this process's pace (default: as fast as it can)",
    )
    p.add_argument("file", help="JSONL rollout dump, one trajectory a line")
    p.set_defaults(func=cmd_produce)

    p = sub.add_parser("collect", help="wait for a batch and print / save its rewards")
    _add_common(p, redis_required=True)
    p.add_argument("--batch", required=True, help="batch id to wait for")
    p.add_argument(
        "--timeout-s",
        type=float,
        default=None,
        help="seconds to wait for the batch (default: no limit; the batch's deadline still applies)",
    )
    add_deprecated_flag(p, "--timeout", "--timeout-s", type=float)
    p.add_argument("--out", help="also save the tensors to FILE.pt, with torch (default: print only)")
    p.add_argument("--json", action="store_true", help="print the rewards as one JSON object")
    p.set_defaults(func=cmd_collect)

    p = sub.add_parser("score", help="score a JSONL dump of rollouts end to end; one JSON line per input line")
    _add_common(p)
    p.add_argument("file", help="JSONL rollout dump, one trajectory a line")
    p.add_argument("--out", help="write the JSON lines to FILE (default: stdout)")
    p.add_argument(
        "--scorer",
        default=None,
        help="rules | math-verify | python:FILE.py:FUNC | module.path:FUNC | http:URL | disrm:URL | genrm:URL | sandbox | "
        "sandbox-fusion:URL (default: the config's, else rules)",
    )
    p.add_argument(
        "--manager",
        default=None,
        help="naive, dapo, batch, prime, remote, rate_limited, or module.path:builder (default: the config's, else naive)",
    )
    p.add_argument("--processes", type=int, default=None, help="worker processes (default: the config's, else 2)")
    p.add_argument(
        "--response-len", type=int, default=1024, help="width of the rm_scores rows, in tokens (default: 1024)"
    )
    p.add_argument("--timeout-s", type=float, default=600.0, help="seconds to wait for the whole file (default: 600)")
    add_deprecated_flag(p, "--timeout", "--timeout-s", type=float)
    p.set_defaults(func=cmd_score)

    p = sub.add_parser(
        "gateway", help="HTTP reward service for OpenRLHF (/openrlhf) and slime (/slime); prints its URL first"
    )
    _add_common(p)
    p.add_argument(
        "--scorer",
        default=None,
        help="the local workers' scorer, as for score (default: the config's, else rules)",
    )
    p.add_argument("--manager", default=None, help="the local workers' reward manager (default: the config's)")
    p.add_argument(
        "--processes",
        type=int,
        default=None,
        help="local worker processes (default: 0 with --redis, else the config's, else 2)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on; 0 picks a free one (default: 8080)")
    p.add_argument(
        "--data-source",
        default=None,
        help="data_source of samples whose request names none (default: none, such a request is a 400)",
    )
    p.add_argument(
        "--on-failure",
        choices=("error", "zero"),
        default="error",
        help="a request with a failed sample: error = HTTP 503 naming it (default); zero = 0.0 for it, counted",
    )
    p.add_argument(
        "--extra-logs",
        default=None,
        metavar="KEY[,KEY...]",
        help="the scorer's numeric extra-info keys /openrlhf replies carry in extra_logs, in every reply "
        "(OpenRLHF needs the same keys in each; e.g. acc for --scorer rules; default: none)",
    )
    p.add_argument(
        "--timeout-s", type=float, default=100.0, help="seconds a request may take before a 504 (default: 100)"
    )
    p.add_argument("--max-body-mb", type=float, default=64.0, help="largest request body, MiB (default: 64; 413 over)")
    p.add_argument(
        "--max-samples", type=int, default=4096, help="most samples in one request (default: 4096; 413 over)"
    )
    p.set_defaults(func=cmd_gateway)

    p = sub.add_parser("status", help="streams, groups, workers, lag, throughput, dead letters, quota, open batches")
    _add_common(p, redis_required=True)
    p.add_argument("--partitions", type=int, default=None, help="default: discovered")
    p.add_argument(
        "--window-s",
        type=float,
        default=None,
        help="sample throughput over this many seconds (default 1.5 heartbeat intervals; 0: skip)",
    )
    p.add_argument("--batches", type=int, default=20, help="show this many newest open batches (default: 20)")
    p.add_argument("--json", action="store_true", help="print the status as one JSON object")
    p.set_defaults(func=cmd_status)

    actions = _actions(sub, "dlq", "dead letters: list them, or put them back on the stream")
    p = actions.add_parser("list", help="dead letters with their reason, error and batch")
    _add_common(p, redis_required=True)
    p.add_argument("--partitions", type=int, default=1, help="partitions of the namespace (default: 1)")
    p.add_argument("--count", type=int, default=100, help="at most this many per partition (default: 100)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_dlq_list)
    p = actions.add_parser("redrive", help="re-queue dead letters (all, or the given ids); results stay write-once")
    _add_common(p, redis_required=True)
    p.add_argument("--partitions", type=int, default=1, help="partitions of the namespace (default: 1)")
    p.add_argument("ids", nargs="*", help="dead-letter entry ids (default: all)")
    p.set_defaults(func=cmd_dlq_redrive)

    actions = _actions(sub, "config", "inspect the configuration")
    p = actions.add_parser(
        "show",
        help="the effective config (file < env < flags), secrets masked; "
        "takes the worker's flags to show what `worker` with them would use",
    )
    add_worker_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_config_show, resolve=resolve_args)

    p = sub.add_parser("bench", help="run a benchmark: " + ", ".join(BENCHES))
    p.add_argument("name", choices=BENCHES, help="which benchmark")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the bench's own flags (--json, --plot FILE.png, ...)")
    _add_logging(p)
    p.set_defaults(func=cmd_bench)
    return parser


class _Parser(argparse.ArgumentParser):
    """argparse, with a mistake in the flags given as one line (and exit 2)."""

    def error(self, message: str) -> Any:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _expected_fault(exc: BaseException) -> str | None:
    """The one line for a fault a user can cause and fix (None: a bug, show the traceback)."""
    from redis.exceptions import RedisError, ResponseError

    from stream_reward.wire.connection import TRANSIENT_ERRORS, is_permanent, permanent_error

    if isinstance(exc, StreamRewardError):
        return str(exc)
    if is_permanent(exc):
        return str(permanent_error(exc))
    if isinstance(exc, ResponseError):
        return f"Redis refused a command ({type(exc).__name__}: {exc})"
    if isinstance(exc, TRANSIENT_ERRORS) and isinstance(exc, (RedisError, ConnectionError, TimeoutError)):
        return f"Redis unreachable ({type(exc).__name__}: {exc})"
    if isinstance(exc, IsADirectoryError):
        return f"{exc.filename}: is a directory, not a file"
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    if isinstance(exc, (json.JSONDecodeError, UnicodeDecodeError)):
        return f"{type(exc).__name__}: {exc}"
    if isinstance(exc, RedisError):
        return f"Redis refused a command ({type(exc).__name__}: {exc})"
    return None


def _stopped_early(command: str, signum: int) -> int:
    """A signal before the command started. A worker exits as stream_reward.worker.main does for one:
    0 and quiet, since a stop with nothing in flight is a whole drain."""
    if command == "worker":
        return 0
    if signum == signal.SIGINT:
        print(f"stream-reward {command}: interrupted", file=sys.stderr)
        return 130
    return 128 + signum


def main(argv: list[str] | None = None) -> int:
    # An old flag or environment variable: one line of ours, not Python's warning.
    with DeprecationLines().catching() as deprecations:
        return _main(sys.argv[1:] if argv is None else list(argv), deprecations)


def _main(argv: list[str], deprecations: DeprecationLines) -> int:
    parser = build_parser()
    debug = "--debug" in argv or os.environ.get("STREAM_REWARD_DEBUG", "") not in ("", "0")
    args = parser.parse_args([a for a in argv if a != "--debug"])
    # `worker` (not --check) becomes the worker program, which says them itself.
    deprecations.name(f"stream-reward {args.command}", quiet=args.command == "worker" and not args.check)
    if args.command == "worker":
        args.worker_argv = argv[argv.index("worker") + 1 :]
    func: Callable[[argparse.Namespace], int] = args.func
    previous: dict[int, Any] = {}
    if args.command not in ("worker", "server") and threading.current_thread() is threading.main_thread():
        _received.clear()
        previous = {signum: signal.signal(signum, _on_signal) for signum in (signal.SIGTERM, signal.SIGINT)}
        previous_hook, sys.unraisablehook = sys.unraisablehook, _quiet_lost_signal
        _received.extend(early_signals.release())  # from the imports: the command never starts
    elif early_signals.pending():
        return _stopped_early(args.command, early_signals.release()[0])
    # `worker` and `server` take the kept signals once their own handlers are in.
    try:
        _check_signals()
        if args.command != "worker":  # the worker configures its own logging, from its settings
            resolve = getattr(args, "resolve", None) or (_settings if hasattr(args, "config") else None)
            settings = resolve(args) if resolve is not None else None
            _configure_logging(args, settings)
            if settings is not None:
                set_default_timeout(settings["connection.timeout_s"])
        code = func(args)
        _check_signals()  # one whose raise was lost in the command's last steps
        return code
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"stream-reward {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if _received and not debug:
            # A fault left by a signal whose raise was lost (torch's import, half done,
            # fails the next import of numpy): the signal is what stopped the command.
            if _received[0] == signal.SIGINT:
                print(f"stream-reward {args.command}: interrupted", file=sys.stderr)
                return 130
            return 128 + _received[0]
        line = _expected_fault(exc)
        if line is None or debug:
            raise
        print(f"stream-reward {args.command}: {line}", file=sys.stderr)
        return 2
    finally:
        if previous:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            sys.unraisablehook = previous_hook


if __name__ == "__main__":
    sys.exit(main())
