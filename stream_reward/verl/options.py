"""What ``StreamRewardLoopManager`` reads of verl's config: ``LoopOptions``.

Only ``reward.custom_reward_function``, ``reward.reward_kwargs`` and two lengths /
paths are read, each through ``.get`` (a ``???`` elsewhere in verl's config is never
touched); what reaches the worker processes is a small ManagerConfig, never verl's
config.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from stream_reward.config import BatchPolicy, ManagerConfig
from stream_reward.errors import ConfigError
from stream_reward.scoring.columns import parse_columns

__all__ = ["LoopOptions"]

# reward.reward_kwargs keys that are ManagerConfig fields, passed to the workers as is.
_MANAGER_KEYS = (
    "manager",
    "scorer",
    "timeout",
    "num_processes",
    "overlong_buffer_cfg",
    "max_resp_len",
    "batch_size",
    "batch_wait_ms",
    "max_concurrent",
    "max_rpm",
    "max_tpm",
    "estimated_tokens_per_request",
    "quota_key",
    "retries",
    "sandbox",
    "components",
)
_VERL_QUOTA_KEYS = ("max_rpm", "max_tpm", "max_concurrent", "estimated_tokens_per_request", "timeout")
_LOOP_MANAGERS = ("naive", "dapo", "batch", "prime", "remote", "rate_limited")


@dataclass
class LoopOptions:
    """What ``StreamRewardLoopManager`` takes from verl's config.

    From ``reward.reward_kwargs`` (verl's DAPO keys keep their meaning):

    * ``manager``: ``naive`` (default), ``dapo``, ``batch``, ``prime``, ``remote``,
      ``rate_limited`` — the calling discipline on the workers (``stream_reward.scoring``);
    * ``overlong_buffer_cfg``, ``max_resp_len`` (default: verl's configured response
      length, ``actor_rollout_ref.rollout.response_length``): DAPO's overlong penalty;
    * ``scorer``: a scorer spec (``http:URL``, ``genrm:URL``, ``sandbox``, ...) instead
      of the rules / custom function, and ``scorer_kwargs``: its options (``model``,
      ``template``, ... see docs/remote.md);
    * ``max_rpm``, ``max_tpm``, ``max_concurrent``, ...: the global quota;
    * ``components``: a composite reward, the entries of ``[[reward.components]]``;
    * ``extra_keys``: the keys a custom function's dict results carry besides ``score``,
      the only ones that reach verl's ``reward_extra_info`` (``stream_reward.verl.columns``;
      also read from ``reward.extra_keys``);
    * ``redis_url``, ``namespace``: an existing deployment (workers run anywhere);
    * ``num_workers``: local worker processes when no ``redis_url`` (default 2);
      ``concurrency``: samples in flight per worker process (default 256);
    * ``on_failure`` (``mask`` | ``fallback``), ``fallback_score``, ``deadline_s``:
      what a sample that could not be scored becomes;
    * ``server_host``, ``server_lease_s``: the job's shared server (``verl_server``).

    From ``reward.custom_reward_function``: ``path``, ``name`` and its ``reward_kwargs``.
    From ``reward`` itself, as verl's rate_limited manager reads them: ``max_rpm``,
    ``max_tpm``, ``max_concurrent``, ``estimated_tokens_per_request``, ``timeout``
    (``reward_kwargs`` wins where both are set).
    """

    manager: ManagerConfig
    redis_url: str | None = None
    namespace: str = "sr"
    num_workers: int | None = None
    policy: BatchPolicy = field(default_factory=BatchPolicy)
    server_host: str = "127.0.0.1"
    server_lease_s: float = 30.0
    custom_function: bool = False
    concurrency: int | None = None  # samples in flight per worker process (the workers' default: 256)
    extra_keys: tuple[str, ...] = ()  # the scorer's own reward_extra_info keys (stream_reward.verl.columns)

    @classmethod
    def from_verl(cls, config: Any, *, reward_router_address: str | None = None) -> LoopOptions:
        reward = _get(config, "reward") or {}
        kwargs = _container(_get(reward, "reward_kwargs")) or {}
        if not isinstance(kwargs, dict):
            raise ConfigError("reward.reward_kwargs", f"must be a mapping, got {type(kwargs).__name__}")
        known = {*_MANAGER_KEYS, "redis_url", "namespace", "num_workers", "on_failure", "fallback_score"}
        known |= {"deadline_s", "server_host", "server_lease_s", "concurrency", "scorer_kwargs", "extra_keys"}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(
                f"reward.reward_kwargs.{unknown[0]}",
                f"unknown key; StreamRewardLoopManager reads {', '.join(sorted(known))}",
            )
        manager_options = {key: kwargs[key] for key in _MANAGER_KEYS if kwargs.get(key) is not None}
        # verl's own rate_limited manager reads its quota from reward.* directly; the same
        # keys mean the same here (but the quota is global, not one per RewardLoopWorker).
        for key in _VERL_QUOTA_KEYS:
            if key not in manager_options and _get(reward, key) is not None:
                manager_options[key] = _container(_get(reward, key))
        manager_options.setdefault("manager", "naive")
        if manager_options["manager"] not in _LOOP_MANAGERS and ":" not in manager_options["manager"]:
            raise ConfigError(
                "reward.reward_kwargs.manager",
                f"unknown manager {manager_options['manager']!r}; known: {', '.join(_LOOP_MANAGERS)}",
            )
        if manager_options["manager"] == "dapo" and "max_resp_len" not in manager_options:
            # verl's configured response length, never the sample's own padded width.
            default = _select(config, "actor_rollout_ref.rollout.response_length")
            if default is None:
                default = _select(config, "data.max_response_length")
            if default is not None:
                manager_options["max_resp_len"] = int(default)

        custom = _get(reward, "custom_reward_function") or {}
        path = _get(custom, "path")
        reward_kwargs: dict[str, Any] = dict(kwargs.get("scorer_kwargs") or {})
        if path:
            if manager_options.get("scorer"):
                raise ConfigError(
                    "reward.reward_kwargs.scorer", "set either it or reward.custom_reward_function.path, not both"
                )
            manager_options["scorer"] = _function_spec(str(path), str(_get(custom, "name") or "compute_score"))
            reward_kwargs.update(_container(_get(custom, "reward_kwargs")) or {})
        if reward_router_address is not None:
            # verl passes these two to compute_score only when a reward model runs.
            manager_options["scorer"], extra = _with_reward_model(
                manager_options.get("scorer") or "rules", reward_router_address, config
            )
            reward_kwargs.update(extra)
        if reward_kwargs:
            manager_options["reward_kwargs"] = reward_kwargs
        try:
            manager = ManagerConfig(**manager_options)
        except TypeError as exc:
            raise ConfigError("reward.reward_kwargs", str(exc)) from None
        try:
            json.dumps(_manager_json(manager))
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                "reward.reward_kwargs", f"must be JSON-serializable to reach the workers: {exc}"
            ) from None
        on_failure = kwargs.get("on_failure") or "mask"
        if on_failure not in ("mask", "fallback"):
            raise ConfigError(
                "reward.reward_kwargs.on_failure",
                f"{on_failure!r}: verl needs one reward per sample, so 'mask' or 'fallback' (not 'drop')",
            )
        deadline = kwargs.get("deadline_s", 600.0)
        policy = BatchPolicy(
            on_failure="fallback" if on_failure == "fallback" else "mask",
            fallback_score=float(kwargs.get("fallback_score") or 0.0),
            deadline_s=float(deadline) if deadline else None,
        )
        extra_keys: tuple[str, ...] = ()
        for where, value in (
            ("reward.extra_keys", _get(reward, "extra_keys")),
            ("reward.reward_kwargs.extra_keys", kwargs.get("extra_keys")),
        ):
            if value is not None:  # reward_kwargs wins where both are set
                extra_keys = parse_columns(_container(value), where)
        num_workers = kwargs.get("num_workers")
        if num_workers is not None and int(num_workers) < 0:
            raise ConfigError("reward.reward_kwargs.num_workers", f"must be >= 0, got {num_workers}")
        return cls(
            manager=manager,
            redis_url=kwargs.get("redis_url"),
            namespace=str(kwargs.get("namespace") or "sr"),
            num_workers=None if num_workers is None else int(num_workers),
            policy=policy,
            server_host=str(kwargs.get("server_host") or "127.0.0.1"),
            server_lease_s=float(kwargs.get("server_lease_s") or 30.0),
            custom_function=bool(path),
            concurrency=_positive_int(kwargs, "concurrency"),
            extra_keys=extra_keys,
        )

    def worker_args(self) -> list[str]:
        """The worker command line: a few hundred bytes, never verl's config."""
        options = _manager_json(self.manager)
        concurrency = ["--concurrency", str(self.concurrency)] if self.concurrency else []
        return [
            *concurrency,
            "--manager",
            options.pop("manager"),
            "--scorer",
            options.pop("scorer"),
            "--manager-kwargs",
            json.dumps(options, sort_keys=True),
        ]


def _positive_int(kwargs: Mapping[str, Any], key: str) -> int | None:
    value = kwargs.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"reward.reward_kwargs.{key}", f"must be an integer >= 1, got {value!r}")
    return value


def _manager_json(config: ManagerConfig) -> dict[str, Any]:
    """The ManagerConfig fields that differ from their defaults."""
    default = ManagerConfig()
    return {
        f.name: getattr(config, f.name)
        for f in fields(ManagerConfig)
        if f.name in ("manager", "scorer") or getattr(config, f.name) != getattr(default, f.name)
    }


def _get(node: Any, key: str) -> Any:
    """``node[key]`` or None, for dicts and DictConfigs alike (never resolving other keys)."""
    if node is None:
        return None
    getter = getattr(node, "get", None)
    return getter(key) if callable(getter) else None


def _select(config: Any, dotted: str) -> Any:
    node = config
    for part in dotted.split("."):
        node = _get(node, part)
    return node


def _container(node: Any) -> Any:
    """A DictConfig subtree as plain Python (resolved); anything else as is."""
    if node is None:
        return None
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf  # type: ignore[import-not-found]
    except ImportError:
        return node
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    return node


def _function_spec(path: str, name: str) -> str:
    """verl's ``custom_reward_function.path`` (``pkg://a.b``, ``file://x.py``, a path) as a scorer spec.

    A file path becomes absolute here: the worker processes may run in another directory.
    """
    if path.startswith("pkg://"):
        return f"{path[len('pkg://') :].replace('/', '.')}:{name}"
    path = path.removeprefix("file://")
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise ConfigError("reward.custom_reward_function.path", f"no such file {full!r}")
    return f"{full}:{name}"


def _with_reward_model(spec: str, address: str, config: Any) -> tuple[str, dict[str, Any]]:
    """The scorer spec wrapped so that compute_score receives ``reward_router_address``
    and ``reward_model_tokenizer`` as verl passes them. A tokenizer cannot travel to a
    worker process, so the worker loads it once from ``reward.reward_model.model_path``."""
    from stream_reward.scoring.scorer import load_function

    if ":" not in spec or spec.partition(":")[0] in ("http", "disrm", "genrm", "sandbox", "sandbox-fusion"):
        raise ConfigError(
            "reward.custom_reward_function.path",
            "with a reward model, verl calls a custom compute_score with reward_router_address; set one",
        )
    wrapper = (
        "acall_with_reward_model" if inspect.iscoroutinefunction(load_function(spec)) else "call_with_reward_model"
    )
    extra = {
        "_sr_function": spec,
        "_sr_tokenizer_path": _select(config, "reward.reward_model.model_path"),
        "reward_router_address": address,
    }
    return f"stream_reward.verl.compute:{wrapper}", extra
