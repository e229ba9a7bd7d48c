"""One config file for a deployment, with environment and flag overrides.

Precedence, lowest first: built-in defaults < the config file < ``STREAM_REWARD_*``
environment variables < command-line flags. The file is TOML (``.toml``, read
with ``tomllib``, ``tomli`` before 3.11), YAML (``.yaml``/``.yml``) or JSON, with these sections::

    [connection]   redis, namespace, group, partitions, allow_eviction, timeout_s
    [reward]       ManagerConfig, by verl's key names: manager, scorer, timeout,
                   retries, reward_kwargs, overlong_buffer_cfg, max_resp_len, ...
    [[reward.components]]  name, scorer, weight, timeout_s, required, skip_unless,
                   quota, reward_kwargs, sandbox, retries, columns: a composite reward
    [quota]        max_concurrent, max_rpm, max_tpm, estimated_tokens_per_request, quota_key
    [consumer]     ConsumerConfig: concurrency, block_ms, reclaim_idle_ms, ...
    [policy]       BatchPolicy: on_failure, fallback_score, deadline_s
    [producer]     ProducerConfig: max_backlog, on_backlog, backlog_poll_s
    [worker]       processes, metrics_port, metrics_addr, metrics_refresh_s, log_level, log_format

The reward, quota, consumer, policy and producer sections are the fields of the
library's dataclasses, read from them, so a field added there is configurable
here without touching this module. Each key has one environment variable,
``STREAM_REWARD_<SECTION>_<KEY>`` (``STREAM_REWARD_QUOTA_MAX_RPM``); dict values are
JSON there. The section-less names of 0.1 (``STREAM_REWARD_MAX_RPM``) still work, with a
``ConfigDeprecationWarning``. ``STREAM_REWARD_CONFIG``
names the file when no ``--config`` is given.

Every value is checked when loaded: a bad one raises ``ConfigError`` naming the
key (``quota.max_rpm``, or the environment variable) and the reason. Secrets
(the Redis URL's password; any key named like ``password``, ``api_key``,
``access_token``, ``secret``, ``Authorization``, at any depth) are masked by
``as_dict()`` and never appear in error messages.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import re
import sys
import types
import typing
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal, Union

from stream_reward.config import (
    BatchPolicy,
    ConsumerConfig,
    ManagerConfig,
    OverlongConfig,
    ProducerConfig,
    check_namespace,
)
from stream_reward.errors import ConfigDeprecationWarning, ConfigError
from stream_reward.wire.connection import mask_url
from stream_reward.wire.keys import DEFAULT_GROUP, DEFAULT_NAMESPACE

__all__ = ["Settings", "load_settings", "env_name", "mask_secrets", "schema", "CONFIG_ENV", "ENV_PREFIX"]

log = logging.getLogger(__name__)

ENV_PREFIX = "STREAM_REWARD_"
CONFIG_ENV = "STREAM_REWARD_CONFIG"
MASK = "***"

_QUOTA_KEYS = ("max_concurrent", "max_rpm", "max_tpm", "estimated_tokens_per_request", "quota_key")
_URL_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_SECRET_WORDS = frozenset(
    {"password", "passwd", "secret", "token", "apikey", "authorization", "auth", "credential", "credentials", "bearer"}
)


@dataclass(frozen=True, slots=True)
class _Key:
    hint: Any
    default: Any


@dataclass(slots=True)
class _WorkerSection:
    """Settings of the worker process itself (not of the library's dataclasses)."""

    processes: int = 1
    metrics_port: int | None = None  # None: no metrics endpoint; 0: any free port
    metrics_addr: str = "0.0.0.0"
    metrics_refresh_s: float = 5.0  # how often stream lag / pending are read from Redis
    log_level: str = "INFO"
    log_format: Literal["text", "json"] = "text"


@dataclass(slots=True)
class _ConnectionSection:
    redis: str | None = None  # None: commands that can start an embedded server do
    namespace: str = DEFAULT_NAMESPACE
    group: str = DEFAULT_GROUP
    partitions: int = 1
    allow_eviction: bool = False  # run on a server whose maxmemory-policy may evict keys
    timeout_s: float = 5.0  # a Redis round trip not answered within this is a fault (blocking reads: BLOCK on top)


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # an annotation only importable under TYPE_CHECKING: that field takes any value
        module = vars(__import__(cls.__module__, fromlist=["_"]))
        hints = {}
        for f in dataclasses.fields(cls):
            try:
                hints[f.name] = eval(f.type, module) if isinstance(f.type, str) else f.type  # noqa: S307 - our own annotations
            except Exception:
                hints[f.name] = Any
        return hints


def _keys_of(cls: type, *, only: tuple[str, ...] | None = None, skip: tuple[str, ...] = ()) -> dict[str, _Key]:
    hints = _hints(cls)
    out: dict[str, _Key] = {}
    for f in dataclasses.fields(cls):
        if f.name in skip or (only is not None and f.name not in only):
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        out[f.name] = _Key(hints[f.name], default)
    return out


@cache
def schema() -> dict[str, dict[str, _Key]]:
    """Section -> key -> (type, default). Built from the library's dataclasses."""
    return {
        "connection": _keys_of(_ConnectionSection),
        "reward": _keys_of(ManagerConfig, skip=("redis_url", "namespace", *_QUOTA_KEYS)),
        "quota": _keys_of(ManagerConfig, only=_QUOTA_KEYS),
        "consumer": _keys_of(ConsumerConfig, skip=("namespace", "group", "partitions", "consumer", "allow_eviction")),
        "policy": _keys_of(BatchPolicy),
        "producer": _keys_of(ProducerConfig, only=("max_backlog", "on_backlog", "backlog_poll_s", "samples_per_entry")),
        "worker": _keys_of(_WorkerSection),
    }


@cache
def _env_names() -> dict[str, str]:
    """Dotted key -> its environment variable, always with its section: a key added to another
    section can then never rename an existing variable."""
    return {
        f"{section}.{key}": f"{ENV_PREFIX}{section}_{key}".upper() for section, keys in schema().items() for key in keys
    }


@cache
def _legacy_env_names() -> dict[str, str]:
    """Dotted key -> the variable of releases before 0.2, which dropped the section unless two
    sections shared the key. Still read, with a ConfigDeprecationWarning."""
    counts: dict[str, int] = {}
    for keys in schema().values():
        for key in keys:
            counts[key] = counts.get(key, 0) + 1
    names = {}
    for section, keys in schema().items():
        for key in keys:
            plain = key if counts[key] == 1 else f"{section}_{key}"
            names[f"{section}.{key}"] = ENV_PREFIX + plain.upper()
    return names


def env_name(dotted: str) -> str:
    return _env_names()[dotted]


def is_secret(name: str) -> bool:
    """By whole words of the key: ``api_key``, ``X-Api-Key``, ``access_token``, ``password``
    (but not ``max_tokens`` or ``estimated_tokens_per_request``)."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]
    return any(w in _SECRET_WORDS for w in words) or any(a == "api" and b == "key" for a, b in zip(words, words[1:]))


def mask_secrets(value: Any, name: str = "") -> Any:
    """A copy of ``value`` with secrets replaced: secret-named keys at any depth, URL passwords."""
    if name and is_secret(name) and value not in (None, ""):
        return MASK
    if isinstance(value, Mapping):
        return {k: mask_secrets(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [mask_secrets(v) for v in value]
    if isinstance(value, str) and "://" in value:
        return mask_url(value)
    return value


# ---------------------------------------------------------------------- coercion
def _shown(value: Any, secret: bool) -> str:
    return "(hidden)" if secret else repr(mask_secrets(value))


def _coerce(key: str, value: Any, hint: Any, *, from_env: bool, secret: bool = False) -> Any:
    """``value`` as type ``hint``; environment values are strings and parsed here."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if type(None) in args and (value is None or (from_env and str(value).strip().lower() in ("", "none", "null"))):
            return None
        errors = []
        for alternative in (a for a in args if a is not type(None)):
            try:
                return _coerce(key, value, alternative, from_env=from_env, secret=secret)
            except ConfigError as exc:
                errors.append(exc)
        raise errors[0]
    if origin is Literal:
        if value not in args:
            raise ConfigError(key, f"must be one of {', '.join(map(repr, args))}, got {_shown(value, secret)}")
        return value
    if hint is Any:
        return value
    base = origin or hint
    if from_env:
        return _parse_env(key, value, base, secret)
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if (base in (int, float) and isinstance(value, bool)) or not isinstance(value, base):
        raise ConfigError(key, f"must be {_type_name(base)}, got {type(value).__name__} {_shown(value, secret)}")
    return copy.deepcopy(value)


def _parse_env(key: str, text: str, base: type, secret: bool) -> Any:
    text = text.strip() if base is not str else text
    try:
        if base is bool:
            lowered = text.lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if base in (dict, list):
            value = json.loads(text)
            if not isinstance(value, base):
                raise ValueError
            return value
        return base(text)
    except ValueError:
        raise ConfigError(
            key, f"must be {_type_name(base)}{' as JSON' if base in (dict, list) else ''}, got {_shown(text, secret)}"
        ) from None


def _type_name(base: type) -> str:
    return {
        int: "an integer",
        float: "a number",
        bool: "true or false",
        str: "a string",
        dict: "a table/mapping",
        list: "a list",
    }.get(base, base.__name__)


# ---------------------------------------------------------------------- loading
def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError("config", f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    suffix = path.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        elif suffix == ".json":
            data = json.loads(text)
        else:
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # the same parser, as a package before 3.11
                import tomli as tomllib

            data = tomllib.loads(text)
    except Exception as exc:  # each parser has its own error type; all mean the same here
        kind = {".yaml": "YAML", ".yml": "YAML", ".json": "JSON"}.get(suffix, "TOML")
        raise ConfigError("config", f"{str(path)!r} is not valid {kind}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError("config", f"{str(path)!r} must hold a table of sections, got {type(data).__name__}")
    return data


@dataclass
class Settings:
    """The effective configuration: ``values[section][key]``, and where each came from."""

    values: dict[str, dict[str, Any]]
    sources: dict[str, str] = field(default_factory=dict)  # dotted key -> default | file | env | flag
    path: str | None = None

    def __getitem__(self, dotted: str) -> Any:
        section, _, key = dotted.partition(".")
        return self.values[section][key]

    def source(self, dotted: str) -> str:
        return self.sources.get(dotted, "default")

    def is_set(self, dotted: str) -> bool:
        """Given by the file, the environment or a flag (not a built-in default)."""
        return self.source(dotted) != "default"

    @property
    def redis(self) -> str | None:
        return self["connection.redis"]

    @property
    def namespace(self) -> str:
        return self["connection.namespace"]

    def require_redis(self) -> str:
        if not self.redis:
            raise ConfigError(
                "connection.redis",
                f"required: give --redis, {env_name('connection.redis')}, "
                "or redis under [connection] in the config file",
            )
        return self.redis

    def manager_config(self) -> ManagerConfig:
        return ManagerConfig(
            **copy.deepcopy(self.values["reward"]),
            **copy.deepcopy(self.values["quota"]),
            redis_url=self.redis,
            namespace=self.namespace,
        )

    def consumer_config(self, consumer: str | None = None) -> ConsumerConfig:
        conn = self.values["connection"]
        config = ConsumerConfig(
            namespace=conn["namespace"],
            group=conn["group"],
            partitions=conn["partitions"],
            allow_eviction=conn["allow_eviction"],
            **self.values["consumer"],
        )
        if consumer:
            config.consumer = consumer
        return config

    def batch_policy(self) -> BatchPolicy:
        return BatchPolicy(**self.values["policy"])

    def producer_config(self) -> ProducerConfig:
        conn = self.values["connection"]
        return ProducerConfig(
            namespace=conn["namespace"],
            partitions=conn["partitions"],
            group=conn["group"],
            allow_eviction=conn["allow_eviction"],
            # One limit for both ends of the stream: a producer must not push what workers refuse.
            max_message_bytes=self.values["consumer"]["max_message_bytes"],
            **self.values["producer"],
        )

    def as_dict(self, *, masked: bool = True) -> dict[str, dict[str, Any]]:
        values = copy.deepcopy(self.values)
        return mask_secrets(values) if masked else values


def load_settings(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> Settings:
    """Defaults < file (``path``, else ``$STREAM_REWARD_CONFIG``) < ``env`` < ``flags``.

    ``flags`` maps dotted keys (``"quota.max_rpm"``) to values already parsed by
    argparse; None values count as "flag not given".
    """
    env = os.environ if env is None else env
    if path is None:
        path = env.get(CONFIG_ENV) or None
    values = {section: {key: copy.deepcopy(k.default) for key, k in keys.items()} for section, keys in schema().items()}
    sources: dict[str, str] = {}
    if path is not None:
        data = _read_file(Path(path))
        for section, table in data.items():
            if section not in values:
                raise ConfigError(str(section), f"unknown section; known: {', '.join(values)}")
            if not isinstance(table, dict):
                raise ConfigError(section, f"must be a table of keys, got {type(table).__name__}")
            for key, value in table.items():
                try:
                    _set(values, sources, f"{section}.{key}", value, "file", from_env=False)
                except ConfigError as exc:
                    raise ConfigError(exc.key, f"{exc.reason} (in {str(path)!r})") from None
    legacy = _legacy_env_names()
    for dotted, name in _env_names().items():
        old = legacy[dotted]
        if name not in env and old != name and old in env:
            warnings.warn(f"${old} is deprecated; set ${name} instead", ConfigDeprecationWarning, stacklevel=2)
            name = old
        if name in env:
            try:
                _set(values, sources, dotted, env[name], "env", from_env=True)
            except ConfigError as exc:
                raise ConfigError(exc.key, f"{exc.reason} (from ${name})") from None
    for dotted, value in (flags or {}).items():
        if value is not None:
            _set(values, sources, dotted, value, "flag", from_env=False)
    settings = Settings(values, sources, str(path) if path is not None else None)
    _validate(settings)
    return settings


def _set(
    values: dict[str, dict[str, Any]], sources: dict[str, str], dotted: str, value: Any, source: str, *, from_env: bool
) -> None:
    section, _, key = dotted.partition(".")
    keys = schema()[section]
    if key not in keys:
        raise ConfigError(dotted, f"unknown key; known in [{section}]: {', '.join(keys)}")
    if value is None and source == "file":
        value = keys[key].default  # YAML null: back to the default
    else:
        value = _coerce(dotted, value, keys[key].hint, from_env=from_env, secret=is_secret(key))
    values[section][key] = value
    sources[dotted] = source


# ---------------------------------------------------------------------- validation
def _validate(settings: Settings) -> None:
    v = settings.values
    conn = v["connection"]
    url = conn["redis"]
    if url is not None and not url.startswith(_URL_SCHEMES):
        raise ConfigError(
            "connection.redis",
            f"{mask_url(url)!r} is not a URL with one of the schemes {', '.join(s[:-3] for s in _URL_SCHEMES)}",
        )
    check_namespace(conn["namespace"], "connection.namespace")
    _at_least(v, "connection.partitions", 1)
    _positive(v, "connection.timeout_s")
    reward = v["reward"]
    _positive(v, "reward.timeout")
    _at_least(v, "reward.retries", 0)
    for dotted in (
        "reward.num_processes",
        "reward.batch_size",
        "reward.max_resp_len",
        "quota.max_concurrent",
        "quota.estimated_tokens_per_request",
    ):
        _at_least(v, dotted, 1)
    _at_least(v, "reward.batch_wait_ms", 0)
    for dotted in ("quota.max_rpm", "quota.max_tpm"):
        _positive(v, dotted)
    _validate_overlong(reward)
    if reward.get("components") or settings.is_set("reward.components"):  # given empty is an error too
        _validate_components(settings)
    if "reward_kwargs" in reward and not all(isinstance(k, str) for k in reward["reward_kwargs"]):
        raise ConfigError("reward.reward_kwargs", "keys must be strings")
    worker = v["worker"]
    _at_least(v, "worker.processes", 1)
    port = worker["metrics_port"]
    if port is not None and not 0 <= port <= 65535:
        raise ConfigError("worker.metrics_port", f"must be 0..65535, got {port}")
    _positive(v, "worker.metrics_refresh_s")
    level = str(worker["log_level"]).upper()
    if level not in _LOG_LEVELS:
        raise ConfigError("worker.log_level", f"must be one of {', '.join(_LOG_LEVELS)}, got {worker['log_level']!r}")
    worker["log_level"] = level
    # The library's dataclasses check their own fields; name the section in their errors.
    for section, build in (
        ("consumer", settings.consumer_config),
        ("policy", settings.batch_policy),
        ("producer", settings.producer_config),
    ):
        try:
            build()
        except ConfigError as exc:
            key = exc.key if "." in exc.key else f"{section}.{exc.key}"
            raise ConfigError(key, exc.reason) from None


def _validate_components(settings: Settings) -> None:
    """``[[reward.components]]`` replace ``reward.scorer`` and the reward's ``[quota]``
    (each component has its own); entries are checked here, their scorers when built."""
    from stream_reward.scoring.composite import parse_components

    parse_components(settings["reward.components"])
    # The default spec may be given (verl's loop passes it to every worker); another is a conflict.
    if settings.is_set("reward.scorer") and settings["reward.scorer"] != "rules":
        raise ConfigError("reward.scorer", "give either reward.scorer or reward.components, not both")
    manager = settings["reward.manager"]
    if manager not in ("naive", "dapo"):
        raise ConfigError("reward.manager", f"components run under naive or dapo, got {manager!r}")
    for key in ("max_rpm", "max_tpm", "max_concurrent", "quota_key"):
        if settings.is_set(f"quota.{key}"):
            raise ConfigError(f"quota.{key}", "with reward.components, give each component its own quota table")


def _validate_overlong(reward: dict[str, Any]) -> None:
    """The dapo manager's own check (only when enabled, as verl does), run at load time."""
    if "overlong_buffer_cfg" not in reward:
        return
    try:
        OverlongConfig.from_config(reward["overlong_buffer_cfg"], reward.get("max_resp_len"))
    except ConfigError as exc:
        raise ConfigError(f"reward.{exc.key}", exc.reason) from None


def _at_least(v: dict[str, dict[str, Any]], dotted: str, floor: int) -> None:
    section, _, key = dotted.partition(".")
    value = v[section].get(key)
    if value is not None and value < floor:
        raise ConfigError(dotted, f"must be >= {floor}, got {value}")


def _positive(v: dict[str, dict[str, Any]], dotted: str) -> None:
    section, _, key = dotted.partition(".")
    value = v[section].get(key)
    if value is not None and value <= 0:
        raise ConfigError(dotted, f"must be > 0, got {value}")
