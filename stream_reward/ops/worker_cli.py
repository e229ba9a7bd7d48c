"""The worker's command line: its flags, how they resolve into settings, and the argv that starts one.

``stream-reward worker``, ``python -m stream_reward.worker``, the supervisor's children and the
local pipelines of ``demo`` / ``score`` / the verl integration all start workers;
this module is the one place that knows how. Every setting can come from a config
file (``--config``), the environment (``STREAM_REWARD_*``) or a flag, in that order
of precedence (see ``stream_reward.ops.settings``). Flags therefore default to None,
meaning "not given"; ``resolve_args`` fills the effective values back into the namespace.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from stream_reward.config import ManagerConfig
from stream_reward.errors import ConfigDeprecationWarning, ConfigError
from stream_reward.ops.logs import LOG_FORMATS
from stream_reward.ops.settings import Settings, load_settings, schema

__all__ = [
    "DeprecatedFlag",
    "add_deprecated_flag",
    "DeprecationLines",
    "FLAG_KEYS",
    "WORKER_MODULE",
    "worker_command",
    "add_worker_arguments",
    "resolve_args",
    "resolve_flags",
    "worker_argv",
]

# The worker program (``stream_reward.worker``, a later stage): started as a program, never imported here.
WORKER_MODULE = "stream_reward.worker"


def worker_command(*args: str) -> list[str]:
    """The argv of a worker program with ``args``: every caller starts workers through this."""
    return [sys.executable, "-m", WORKER_MODULE, *args]


# Worker flag (argparse dest) -> settings key. Flags not listed here are not
# config-file settings (--consumer, --burst, --check, ...).
FLAG_KEYS: dict[str, str] = {
    "redis": "connection.redis",
    "namespace": "connection.namespace",
    "group": "connection.group",
    "partitions": "connection.partitions",
    "allow_eviction": "connection.allow_eviction",
    "redis_timeout_s": "connection.timeout_s",
    "scorer": "reward.scorer",
    "manager": "reward.manager",
    "timeout_s": "reward.timeout",
    "num_processes": "reward.num_processes",
    "reward_kwargs": "reward.reward_kwargs",
    "retries": "reward.retries",
    "max_rpm": "quota.max_rpm",
    "max_tpm": "quota.max_tpm",
    "max_concurrent": "quota.max_concurrent",
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


class DeprecatedFlag(argparse.Action):
    """An old spelling of a flag: hidden from --help, stores into the new flag's dest, and
    warns (ConfigDeprecationWarning) naming the new spelling."""

    def __init__(self, option_strings: list[str], dest: str, *, new: str, **kwargs: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: Any = None
    ) -> None:
        warnings.warn(f"{option} is deprecated; use {self.new}", ConfigDeprecationWarning, stacklevel=2)
        setattr(namespace, self.dest, values)


def add_deprecated_flag(parser: argparse.ArgumentParser, old: str, new: str, **kwargs: Any) -> None:
    """Accept ``old`` as a hidden alias of the already added flag ``new``."""
    dest = next(a.dest for a in parser._actions if new in a.option_strings)
    parser.add_argument(old, dest=dest, action=DeprecatedFlag, new=new, **kwargs)


class DeprecationLines:
    """A program's deprecations as one line of its own each on stderr,
    ``stream-reward collect: --timeout is deprecated; use --timeout-s``, instead of
    Python's ``.../worker_cli.py:90: ConfigDeprecationWarning: ...`` and the source line.

    The library warns (``ConfigDeprecationWarning``: a caller catches it, or makes it an
    error); an entry point runs its command under ``catching()``, where each such warning
    is said once, whatever the warning filters say. Those that come before the program
    knows its name (the flags' own, while they parse) wait for ``name()``; a program with
    ``quiet=True`` leaves them to another that will say them (``stream-reward worker``
    execs the worker program, which parses the same flags again)."""

    def __init__(self) -> None:
        self.prog: str | None = None
        self.quiet = False
        self._held: list[str] = []
        self._said: set[str] = set()

    def name(self, prog: str, *, quiet: bool = False) -> None:
        """From now the lines start with ``prog``; those held until now are said."""
        self.prog, self.quiet = prog, quiet
        held, self._held = self._held, []
        for text in held:
            self._say(text)

    def _say(self, text: str) -> None:
        if self.prog is None:
            self._held.append(text)
        elif not self.quiet and text not in self._said:
            self._said.add(text)
            print(f"{self.prog}: {text}", file=sys.stderr, flush=True)

    @contextmanager
    def catching(self) -> Iterator[DeprecationLines]:
        with warnings.catch_warnings():
            warnings.simplefilter("always", ConfigDeprecationWarning)
            others = warnings.showwarning

            def show(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
                if issubclass(category, ConfigDeprecationWarning):
                    self._say(str(message))
                else:
                    others(message, category, *args, **kwargs)

            warnings.showwarning = show
            yield self


def _default(dotted: str) -> Any:
    section, _, key = dotted.partition(".")
    return schema()[section][key].default


def add_allow_eviction(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow-eviction",
        action="store_const",
        const=True,
        default=None,
        help="run on a Redis whose maxmemory-policy may evict keys (default: refuse it; evicted "
        "trajectories and results are lost without a word)",
    )


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    def d(dotted: str) -> str:
        return f" (default: {_default(dotted)})"

    parser.add_argument(
        "--config", default=None, help="config file (TOML, YAML or JSON); default: $STREAM_REWARD_CONFIG"
    )
    parser.add_argument(
        "--redis",
        default=None,
        help="Redis URL: redis://, rediss://, unix://, redis+cluster:// (required: here, in the config or "
        "$STREAM_REWARD_CONNECTION_REDIS; no default)",
    )
    parser.add_argument("--namespace", default=None, help="key namespace" + d("connection.namespace"))
    parser.add_argument("--group", default=None, help="consumer group, one per scorer pool" + d("connection.group"))
    parser.add_argument("--partitions", type=int, default=None, help=d("connection.partitions").strip())
    parser.add_argument(
        "--redis-timeout-s",
        type=float,
        default=None,
        help="seconds a Redis round trip may take before it counts as a fault" + d("connection.timeout_s"),
    )
    add_allow_eviction(parser)
    parser.add_argument(
        "--scorer",
        default=None,
        help="rules | math-verify | python:FILE.py:FUNC | module.path:FUNC | http:URL | disrm:URL | genrm:URL | sandbox | "
        "sandbox-fusion:URL" + d("reward.scorer"),
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
    parser.add_argument(
        "--num-processes",
        type=int,
        default=None,
        help="scorer processes inside each worker process, for sync scorers (verl's name; default: cores)",
    )
    parser.add_argument(
        "--reward-kwargs", type=json.loads, default=None, help="JSON object passed to compute_score (default: {})"
    )
    parser.add_argument(
        "--manager-kwargs",
        type=json.loads,
        default={},
        help='JSON object of manager options by verl key, e.g. {"overlong_buffer_cfg": {...}, "max_resp_len": 4096} '
        "(default: {})",
    )
    parser.add_argument(
        "--max-rpm", type=float, default=None, help="global requests/minute for the verifier (default: no limit)"
    )
    parser.add_argument(
        "--max-tpm", type=float, default=None, help="global tokens/minute for the verifier (default: no limit)"
    )
    parser.add_argument(
        "--max-concurrent",
        type=int,
        default=None,
        help="global requests in flight for the verifier (default: no limit)",
    )
    add_deprecated_flag(parser, "--max-inflight", "--max-concurrent", type=int)
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
        help="serve Prometheus metrics on this port (0: any free port; with --processes N, process i uses port+i; "
        "default: no endpoint)",
    )
    parser.add_argument(
        "--metrics-addr", default=None, help="address of the metrics endpoint" + d("worker.metrics_addr")
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="health check: exit 0 if a worker of the namespace (or --consumer) has a fresh heartbeat, else 1",
    )


def resolve_flags(
    args: argparse.Namespace, flag_keys: Mapping[str, str], extra: Mapping[str, Any] | None = None
) -> Settings:
    """The effective settings of a command (file < env < flags), written back into ``args``.

    ``flag_keys`` maps argparse dests to settings keys; ``extra`` holds settings
    given another way (``--manager-kwargs``). Idempotent. The flags as given are
    kept in ``args.given_flags``, so that child processes get the same command
    line and resolve the same way.
    """
    settings: Settings | None = getattr(args, "settings", None)
    if settings is not None:
        return settings
    given = {dest: getattr(args, dest) for dest in flag_keys if getattr(args, dest, None) is not None}
    flags = {**{flag_keys[dest]: value for dest, value in given.items()}, **(extra or {})}
    settings = load_settings(getattr(args, "config", None), flags=flags)
    for dest, dotted in flag_keys.items():
        if hasattr(args, dest):
            setattr(args, dest, settings[dotted])
    args.given_flags = given
    args.settings = settings
    return settings


def resolve_args(args: argparse.Namespace) -> Settings:
    """The effective settings of a worker command line; see ``resolve_flags``."""
    extra: dict[str, Any] = {}
    sections = schema()
    for key, value in (getattr(args, "manager_kwargs", None) or {}).items():
        if key in sections["reward"]:
            extra[f"reward.{key}"] = value
        elif key in sections["quota"]:
            extra[f"quota.{key}"] = value
        elif key in _MANAGER_KWARG_KEYS:
            extra[_MANAGER_KWARG_KEYS[key]] = value
        else:
            raise ConfigError(
                key, f"unknown manager option; known: {', '.join(sorted(ManagerConfig.__dataclass_fields__))}"
            )
    return resolve_flags(args, FLAG_KEYS, extra)


def worker_argv(args: argparse.Namespace, **overrides: Any) -> list[str]:
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
    argv = worker_command()
    if given is not None:
        # The config file or environment may ask for several processes: a child is one.
        argv += ["--processes", "1"]
    for action in template._actions:
        if isinstance(action, DeprecatedFlag):
            continue  # the child gets the current spelling
        value = values.get(action.dest)
        if action.dest == "processes" or value is None or value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreConstAction)):
            argv.append(flag)
        else:
            argv += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return argv
