"""Reward managers by verl's names, and the ``--scorer`` spec factory.

A manager turns a compute function (the ``--scorer`` spec) into a Scorer with a
calling discipline around it. The registry maps names to builders; users add
theirs with ``@register_manager("name")`` or ``--manager module.path:builder``.

Scorer specs:

* ``rules`` — the built-in rule scorers, routed by ``data_source`` (inline: they
  are pure, linear-time Python, cheaper than any hop);
* ``python:FILE.py:FUNC`` / ``FILE.py:FUNC`` / ``module.path:FUNC`` — a verl-style
  ``compute_score``; ``async def`` functions are awaited on the worker's loop
  with a timeout, sync ones run in a pool of killable processes.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError, ScorerTimeoutError
from .procpool import ProcessPool
from .scoring import Scored, Scorer, load_function, normalize
from .trajectory import Trajectory

__all__ = ["ManagerConfig", "register_manager", "build_scorer", "manager_names", "RuleScorer", "AsyncFunctionScorer"]


@dataclass(slots=True)
class ManagerConfig:
    """Manager options, with verl's key names where verl has them."""

    manager: str = "naive"
    scorer: str = "rules"
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    timeout: float = 30.0  # per sample, seconds (verl's key name)
    num_processes: int | None = None  # scorer processes; default: cores
    # dapo
    overlong_buffer_cfg: dict[str, Any] = field(default_factory=dict)
    max_resp_len: int | None = None
    # batch
    batch_size: int = 128
    batch_wait_ms: float = 20.0
    # rate_limited (and remote verifiers)
    max_concurrent: int | None = None
    max_rpm: float | None = None
    max_tpm: float | None = None
    estimated_tokens_per_request: int = 2000
    quota_key: str | None = None
    retries: int = 5  # attempts after the first, for infrastructure faults
    redis_url: str | None = None
    namespace: str = "sr"


Builder = Callable[[ManagerConfig], Scorer]
_REGISTRY: dict[str, Builder] = {}


def register_manager(name: str) -> Callable[[Builder], Builder]:
    def decorator(builder: Builder) -> Builder:
        _REGISTRY[name] = builder
        return builder
    return decorator


def manager_names() -> list[str]:
    return sorted(_REGISTRY)


def build_scorer(config: ManagerConfig) -> Scorer:
    builder = _REGISTRY.get(config.manager)
    if builder is None:
        if ":" in config.manager:
            builder = load_function(config.manager)
        else:
            raise ConfigError("manager", f"unknown manager {config.manager!r}; known: {', '.join(manager_names())}")
    return builder(config)


class RuleScorer:
    """The built-in rule scorers; never suspends, so the worker runs it inline."""

    inline = True

    def __init__(self, reward_kwargs: dict[str, Any] | None = None) -> None:
        from .scorers.rules import compute_score

        self._compute = compute_score
        self._kwargs = reward_kwargs or {}

    async def score(self, traj: Trajectory) -> Scored:
        return normalize(self._compute(traj.data_source, traj.response, traj.ground_truth, traj.extra_info, **self._kwargs))


class AsyncFunctionScorer:
    """A user ``async def compute_score``, awaited on the worker's loop under a timeout."""

    def __init__(self, fn: Callable[..., Any], *, timeout_s: float, reward_kwargs: dict[str, Any] | None = None) -> None:
        self._fn = fn
        self._timeout_s = timeout_s
        self._kwargs = reward_kwargs or {}

    async def score(self, traj: Trajectory) -> Scored:
        try:
            value = await asyncio.wait_for(
                self._fn(traj.data_source, traj.response, traj.ground_truth, traj.extra_info, **self._kwargs),
                self._timeout_s,
            )
        except TimeoutError:
            raise ScorerTimeoutError(f"async scorer ran past its {self._timeout_s:g}s timeout and was cancelled") from None
        return normalize(value)


def function_scorer(config: ManagerConfig, *, force_process: bool = False) -> Scorer:
    """The scorer for ``config.scorer``: rules inline, async functions on the loop,
    sync functions (or everything, with ``force_process``) in killable processes."""
    if config.scorer == "rules" and not force_process:
        return RuleScorer(config.reward_kwargs)
    spec = "stream_reward.scorers.rules:compute_score" if config.scorer == "rules" else config.scorer
    if not force_process:
        fn = load_function(spec)
        if inspect.iscoroutinefunction(fn):
            return AsyncFunctionScorer(fn, timeout_s=config.timeout, reward_kwargs=config.reward_kwargs)
    return ProcessPool(spec, size=config.num_processes, timeout_s=config.timeout, reward_kwargs=config.reward_kwargs)


@register_manager("naive")
def _naive(config: ManagerConfig) -> Scorer:
    """One compute_score call per sample."""
    return function_scorer(config)
