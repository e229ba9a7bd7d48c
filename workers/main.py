"""Entry point of a worker pool: ``stream-reward worker`` and ``python -m workers``.

With ``--processes 1`` this process is the worker; with more, it becomes the
supervisor of that many worker processes (see ``workers.supervisor``).

Every setting can come from a config file (``--config``), the environment
(``STREAM_REWARD_*``) or a flag, in that order of precedence (see
``stream_reward.settings``). Flags therefore default to None here, meaning "not
given"; ``resolve_args`` fills the effective values back into the namespace.
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

from redis.exceptions import RedisError

from stream_reward.config import ConsumerConfig
from stream_reward.errors import ConfigError, StreamRewardError
from stream_reward.logs import LOG_FORMATS
from stream_reward.logs import configure_logging as _configure_logging
from stream_reward.managers import ManagerConfig, build_scorer
from stream_reward.settings import Settings, load_settings, schema

__all__ = ["add_worker_arguments", "main", "run_worker", "resolve_args", "check_health", "FLAG_KEYS"]

log = logging.getLogger(__name__)

# Worker flag (argparse dest) -> settings key. Flags not listed here are not
# config-file settings (--consumer, --burst, --check, ...).
FLAG_KEYS: dict[str, str] = {
    "redis": "connection.redis",
    "namespace": "connection.namespace",
    "group": "connection.group",
    "partitions": "connection.partitions",
    "scorer": "reward.scorer",
    "manager": "reward.manager",
    "timeout_s": "reward.timeout",
    "num_processes": "reward.num_processes",
    "reward_kwargs": "reward.reward_kwargs",
    "retries": "reward.retries",
    "max_rpm": "quota.max_rpm",
    "max_tpm": "quota.max_tpm",
    "max_inflight": "quota.max_concurrent",
    "quota_key": "quota.quota_key",
    "processes": "worker.processes",
    "concurrency": "consumer.concurrency",
    "read_count": "consumer.read_count",
    "block_ms": "consumer.block_ms",
    "reclaim_idle_ms": "consumer.reclaim_idle_ms",
    "max_deliveries": "consumer.max_deliveries",
    "drain_timeout_s": "consumer.drain_timeout_s",
    "metrics_port": "worker.metrics_port",
    "metrics_addr": "worker.metrics_addr",
    "log_level": "worker.log_level",
    "log_format": "worker.log_format",
}
# --manager-kwargs keys that are not reward/quota keys of the config file.
_MANAGER_KWARG_KEYS = {"redis_url": "connection.redis", "namespace": "connection.namespace"}


def _default(dotted: str) -> Any:
    section, _, key = dotted.partition(".")
    return schema()[section][key].default


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    def d(dotted: str) -> str:
        return f" (default: {_default(dotted)})"

    parser.add_argument(
        "--config", default=None, help="config file (TOML, YAML or JSON); default: $STREAM_REWARD_CONFIG"
    )
    parser.add_argument(
        "--redis", default=None, help="Redis URL (redis://, rediss://, unix://); required here or in the config"
    )
    parser.add_argument("--namespace", default=None, help="key namespace" + d("connection.namespace"))
    parser.add_argument("--group", default=None, help="consumer group, one per scorer pool" + d("connection.group"))
    parser.add_argument("--partitions", type=int, default=None, help=d("connection.partitions").strip())
    parser.add_argument(
        "--scorer", default=None, help="rules | python:FILE.py:FUNC | module.path:FUNC" + d("reward.scorer")
    )
    parser.add_argument(
        "--manager",
        default=None,
        help="naive, dapo, batch, prime, remote, rate_limited, or module.path:builder" + d("reward.manager"),
    )
    parser.add_argument(
        "--processes", type=int, default=None, help="worker processes on this host" + d("worker.processes")
    )
    parser.add_argument(
        "--concurrency", type=int, default=None, help="samples in flight per process" + d("consumer.concurrency")
    )
    parser.add_argument("--read-count", type=int, default=None, help=d("consumer.read_count").strip())
    parser.add_argument("--block-ms", type=int, default=None, help=d("consumer.block_ms").strip())
    parser.add_argument("--reclaim-idle-ms", type=int, default=None, help=d("consumer.reclaim_idle_ms").strip())
    parser.add_argument("--max-deliveries", type=int, default=None, help=d("consumer.max_deliveries").strip())
    parser.add_argument("--drain-timeout-s", type=float, default=None, help=d("consumer.drain_timeout_s").strip())
    parser.add_argument("--timeout-s", type=float, default=None, help="per-sample scorer timeout" + d("reward.timeout"))
    parser.add_argument("--num-processes", type=int, default=None, help="scorer processes per worker for sync scorers")
    parser.add_argument("--reward-kwargs", type=json.loads, default=None, help="JSON object passed to compute_score")
    parser.add_argument(
        "--manager-kwargs",
        type=json.loads,
        default={},
        help='JSON object of manager options by verl key, e.g. {"overlong_buffer_cfg": {...}, "max_resp_len": 4096}',
    )
    parser.add_argument("--max-rpm", type=float, default=None, help="global requests/minute for the verifier")
    parser.add_argument("--max-tpm", type=float, default=None, help="global tokens/minute for the verifier")
    parser.add_argument("--max-inflight", type=int, default=None, help="global max requests in flight for the verifier")
    parser.add_argument(
        "--retries",
        type=int,
        default=None,
        help="attempts after the first, for infrastructure faults" + d("reward.retries"),
    )
    parser.add_argument("--quota-key", default=None, help="name of the shared quota (default: the scorer spec)")
    parser.add_argument("--consumer", default=None, help="consumer name (default host-pid)")
    parser.add_argument("--burst", action="store_true", help="exit once the stream holds nothing more")
    parser.add_argument("--log-level", default=None, help=d("worker.log_level").strip())
    parser.add_argument(
        "--log-format", choices=LOG_FORMATS, default=None, help="text or json lines" + d("worker.log_format")
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this port (0: any free port; with --processes N, process i uses port+i)",
    )
    parser.add_argument(
        "--metrics-addr", default=None, help="address of the metrics endpoint" + d("worker.metrics_addr")
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="health check: exit 0 if a worker of the namespace (or --consumer) has a fresh heartbeat, else 1",
    )


def resolve_args(args: argparse.Namespace) -> Settings:
    """The effective settings for ``args`` (file < env < flags), written back into ``args``.

    Idempotent. The flags as given are kept in ``args.given_flags``, so that
    child processes get the same command line and resolve the same way.
    """
    settings: Settings | None = getattr(args, "settings", None)
    if settings is not None:
        return settings
    given = {dest: getattr(args, dest) for dest in FLAG_KEYS if getattr(args, dest, None) is not None}
    flags = {FLAG_KEYS[dest]: value for dest, value in given.items()}
    sections = schema()
    for key, value in (getattr(args, "manager_kwargs", None) or {}).items():
        if key in sections["reward"]:
            flags[f"reward.{key}"] = value
        elif key in sections["quota"]:
            flags[f"quota.{key}"] = value
        elif key in _MANAGER_KWARG_KEYS:
            flags[_MANAGER_KWARG_KEYS[key]] = value
        else:
            raise ConfigError(
                key, f"unknown manager option; known: {', '.join(sorted(ManagerConfig.__dataclass_fields__))}"
            )
    settings = load_settings(getattr(args, "config", None), flags=flags)
    for dest, dotted in FLAG_KEYS.items():
        setattr(args, dest, settings[dotted])
    args.given_flags = given
    args.settings = settings
    return settings


def consumer_config(args: argparse.Namespace) -> ConsumerConfig:
    return resolve_args(args).consumer_config(args.consumer)


def manager_config(args: argparse.Namespace) -> ManagerConfig:
    return resolve_args(args).manager_config()


async def run_worker(args: argparse.Namespace, *, handle_signals: bool = True) -> None:
    from workers.consumer import Worker

    settings = resolve_args(args)
    url = settings.require_redis()
    stop = asyncio.Event()
    if handle_signals:
        _install_signal_handlers(stop)
    manager = settings.manager_config()
    scorer = build_scorer(manager)
    config = settings.consumer_config(args.consumer)
    metrics = None
    port = settings["worker.metrics_port"]
    if port is not None:
        from workers.metrics import WorkerMetrics

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
        if refresher is not None:
            refresher_stop.set()
            try:
                await asyncio.wait_for(asyncio.shield(refresher), 5)
            except TimeoutError:
                refresher.cancel()
        if metrics is not None:
            metrics.close()
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


def configure_logging(level: str, fmt: str = "text") -> None:
    _configure_logging(level, fmt)


# ---------------------------------------------------------------------- health
async def check_health(settings: Settings, *, consumer: str | None = None) -> tuple[bool, str]:
    """(healthy, one-line reason): a worker of the namespace (this ``consumer``, this
    group when one was configured) heartbeat within 3 heartbeat intervals."""
    from stream_reward.broker import TRANSIENT_ERRORS, connect, mask_url
    from stream_reward.keys import Keys
    from stream_reward.status import ALIVE_FACTOR, read_heartbeats

    url = settings.require_redis()
    interval = settings["consumer.heartbeat_interval_s"]
    group = settings["connection.group"] if settings.is_set("connection.group") else None
    client = connect(url, socket_timeout=5)
    try:
        beats = await read_heartbeats(client, Keys(settings.namespace), interval_s=interval)
    except (RedisError, *TRANSIENT_ERRORS) as exc:
        return False, f"cannot read heartbeats from {mask_url(url)}: {type(exc).__name__}"
    finally:
        await client.aclose()
    matching = {
        name: b
        for name, b in beats.items()
        if (consumer is None or name == consumer) and (group is None or b.get("group") == group)
    }
    alive = {name: b for name, b in matching.items() if b["alive"]}
    what = (
        f"consumer {consumer!r}"
        if consumer
        else f"namespace {settings.namespace!r}" + (f" group {group!r}" if group else "")
    )
    if alive:
        freshest = min(b["age_s"] for b in alive.values())
        return True, f"ok: {len(alive)} live worker(s) in {what}; freshest heartbeat {freshest:.1f}s ago"
    if matching:
        freshest = min(b["age_s"] for b in matching.values())
        return False, (
            f"unhealthy: no live worker in {what}; freshest heartbeat {freshest:.1f}s ago "
            f"(limit {ALIVE_FACTOR * interval:g}s)"
        )
    return False, f"unhealthy: no worker heartbeat in {what}"


# ---------------------------------------------------------------------- entry points
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stream-reward worker", description="Run a pool of reward workers.")
    add_worker_arguments(parser)
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
    try:
        if args.check:
            healthy, message = asyncio.run(check_health(settings, consumer=args.consumer))
            print(message, file=sys.stdout if healthy else sys.stderr)
            return 0 if healthy else 1
        settings.require_redis()
        if settings["worker.processes"] > 1:
            from workers.supervisor import supervise

            return supervise(args)
        asyncio.run(run_worker(args))
    except StreamRewardError as exc:
        log.error("%s", exc)
        return 2
    return 0


def child_argv(args: argparse.Namespace, **overrides: Any) -> list[str]:
    """The command line of one worker process with the same settings as ``args``.

    Config-backed flags are passed as the operator gave them (with ``--config``
    and the inherited environment the child resolves the same settings), so a
    password from the environment never lands on a command line.
    """
    slot = overrides.pop("slot", None)
    values = {**vars(args), **overrides}
    given = getattr(args, "given_flags", None)
    if given is not None:
        values.update({dest: given.get(dest) for dest in FLAG_KEYS})
        values.update({k: v for k, v in overrides.items() if k in FLAG_KEYS})
        settings: Settings = args.settings
        port = settings["worker.metrics_port"]
        if port and slot is not None and "metrics_port" not in overrides:
            values["metrics_port"] = port + int(slot)
    template = argparse.ArgumentParser(add_help=False)
    add_worker_arguments(template)
    argv = [sys.executable, "-m", "workers"]
    if given is not None:
        # The config file or environment may ask for several processes: a child is one.
        argv += ["--processes", "1"]
    for action in template._actions:
        value = values.get(action.dest)
        if action.dest == "processes" or value is None or value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            argv.append(flag)
        else:
            argv += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return argv
