"""Entry point of a worker pool: ``stream-reward worker`` and ``python -m workers``.

With ``--processes 1`` this process is the worker; with more, it becomes the
supervisor of that many worker processes (see ``workers.supervisor``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from typing import Any

from stream_reward.config import ConsumerConfig
from stream_reward.errors import ConfigError, StreamRewardError
from stream_reward.keys import DEFAULT_GROUP, DEFAULT_NAMESPACE
from stream_reward.managers import ManagerConfig, build_scorer

__all__ = ["add_worker_arguments", "main", "run_worker"]

log = logging.getLogger("workers")


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis", required=True, help="Redis URL (redis://, rediss://, unix://)")
    parser.add_argument("--namespace", default=DEFAULT_NAMESPACE)
    parser.add_argument("--group", default=DEFAULT_GROUP, help="consumer group (one per scorer pool)")
    parser.add_argument("--partitions", type=int, default=1)
    parser.add_argument("--scorer", default="rules", help="rules | python:FILE.py:FUNC | module.path:FUNC")
    parser.add_argument("--manager", default="naive", help="naive, dapo, batch, prime, remote, rate_limited, or module.path:builder")
    parser.add_argument("--processes", type=int, default=1, help="worker processes on this host")
    parser.add_argument("--concurrency", type=int, default=256, help="samples in flight per process")
    parser.add_argument("--read-count", type=int, default=256)
    parser.add_argument("--block-ms", type=int, default=200)
    parser.add_argument("--reclaim-idle-ms", type=int, default=30_000)
    parser.add_argument("--max-deliveries", type=int, default=5)
    parser.add_argument("--drain-timeout-s", type=float, default=10.0)
    parser.add_argument("--timeout-s", type=float, default=30.0, help="per-sample scorer timeout")
    parser.add_argument("--num-processes", type=int, default=None, help="scorer processes per worker for sync scorers")
    parser.add_argument("--reward-kwargs", type=json.loads, default={}, help="JSON object passed to compute_score")
    parser.add_argument("--manager-kwargs", type=json.loads, default={},
                        help='JSON object of manager options by verl key, e.g. {"overlong_buffer_cfg": {...}, "max_resp_len": 4096}')
    parser.add_argument("--max-rpm", type=float, default=None, help="global requests/minute for the verifier")
    parser.add_argument("--max-tpm", type=float, default=None, help="global tokens/minute for the verifier")
    parser.add_argument("--max-inflight", type=int, default=None, help="global max requests in flight for the verifier")
    parser.add_argument("--retries", type=int, default=5, help="attempts after the first, for infrastructure faults")
    parser.add_argument("--quota-key", default=None, help="name of the shared quota (default: the scorer spec)")
    parser.add_argument("--consumer", default=None, help="consumer name (default host-pid)")
    parser.add_argument("--burst", action="store_true", help="exit once the stream holds nothing more")
    parser.add_argument("--log-level", default="INFO")


def consumer_config(args: argparse.Namespace) -> ConsumerConfig:
    config = ConsumerConfig(
        namespace=args.namespace, group=args.group, partitions=args.partitions,
        concurrency=args.concurrency, read_count=args.read_count, block_ms=args.block_ms,
        reclaim_idle_ms=args.reclaim_idle_ms, max_deliveries=args.max_deliveries,
        drain_timeout_s=args.drain_timeout_s,
    )
    if args.consumer:
        config.consumer = args.consumer
    return config


def manager_config(args: argparse.Namespace) -> ManagerConfig:
    config = ManagerConfig(
        manager=args.manager, scorer=args.scorer, reward_kwargs=args.reward_kwargs,
        timeout=args.timeout_s, num_processes=args.num_processes, redis_url=args.redis, namespace=args.namespace,
        max_rpm=args.max_rpm, max_tpm=args.max_tpm, max_concurrent=args.max_inflight, retries=args.retries,
        quota_key=args.quota_key,
    )
    for key, value in args.manager_kwargs.items():
        if key not in ManagerConfig.__dataclass_fields__:
            raise ConfigError(key, f"unknown manager option; known: {', '.join(sorted(ManagerConfig.__dataclass_fields__))}")
        setattr(config, key, value)
    return config


async def run_worker(args: argparse.Namespace, *, handle_signals: bool = True) -> None:
    from workers.consumer import Worker

    stop = asyncio.Event()
    if handle_signals:
        _install_signal_handlers(stop)
    scorer = build_scorer(manager_config(args))
    worker = Worker(args.redis, scorer, consumer_config(args))
    try:
        await worker.run(stop, burst=args.burst)
    finally:
        close = getattr(scorer, "aclose", None)
        if close is not None:
            await close()
        await worker.aclose()


def _install_signal_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            # Second signal: the operator means it.
            log.warning("second %s: exiting now", signal.Signals(signum).name)
            os._exit(1)
        log.info("%s: draining in-flight samples, then exiting", signal.Signals(signum).name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stream-reward worker", description="Run a pool of reward workers.")
    add_worker_arguments(parser)
    args = parser.parse_args(argv)
    return run_from_args(args)


def run_from_args(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    try:
        if args.processes > 1:
            from workers.supervisor import supervise

            return supervise(args)
        asyncio.run(run_worker(args))
    except StreamRewardError as exc:
        log.error("%s", exc)
        return 2
    return 0


def child_argv(args: argparse.Namespace, **overrides: Any) -> list[str]:
    """The command line of one worker process with the same settings as ``args``."""
    values = {**vars(args), **overrides}
    template = argparse.ArgumentParser(add_help=False)
    add_worker_arguments(template)
    argv = [sys.executable, "-m", "workers"]
    for action in template._actions:
        value = values.get(action.dest)
        if action.dest == "processes" or value is None or value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            argv.append(flag)
        else:
            argv += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return argv
