"""Reward managers by verl's names, and the ``--scorer`` spec factory.

A manager turns a compute function (the ``--scorer`` spec) into a Scorer with a
calling discipline around it. The registry maps names to builders; users add
theirs with ``@register_manager("name")`` or ``--manager module.path:builder``
(a function ``ManagerConfig -> Scorer``).

=============  ===============================================================
``naive``      one compute_score call per sample: rules inline, ``async def``
               functions on the worker's loop under ``timeout``, sync functions
               in the pool of killable processes
``dapo``       ``naive`` plus DAPO's overlong penalty (``overlong_buffer_cfg``,
               ``max_resp_len``) and verl's ``acc`` column for bare-number scores
``batch``      samples gathered (``batch_size`` / ``batch_wait_ms``) into one
               batched ``compute_score(data_sources=, solution_strs=, ...)`` call
``prime``      every call in the killable process pool (``num_processes``),
               ``timeout`` per sample; hung processes are killed and replaced
``remote``     the same mechanism as ``prime`` (verl runs it as Ray actors)
``rate_limited`` ``max_rpm`` / ``max_tpm`` / ``max_concurrent`` held in Redis,
               shared by every worker process (``stream_reward.scoring.quota``)
=============  ===============================================================

Every built-in manager takes a sample's precomputed ``rm_score`` (verl's
rm_scores path) as its task score instead of calling the scorer; shaping
(``dapo``) still applies. The layers the managers stack (precomputed scores,
overlong shaping, micro-batching, the quota) live in ``stream_reward.scoring.layers``.

Scorer specs:

* ``rules`` — the built-in rule scorers, routed by ``data_source``;
* ``math-verify`` — math-verify's verdict by verl's convention, in scorer processes
  (``stream_reward.scoring.rules.math_verify``); needs ``stream-reward[math]``;
* ``python:FILE.py:FUNC`` / ``FILE.py:FUNC`` / ``module.path:FUNC`` — a verl-style
  ``compute_score``;
* ``http:URL``, ``disrm:URL``, ``genrm:URL`` — remote verifiers
  (``stream_reward.scoring.http.verifiers``); ``sandbox`` — the local code sandbox;
  ``sandbox-fusion:URL`` — a SandboxFusion server. Their modules are imported
  only when a spec asks for them.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from stream_reward.config import ManagerConfig, OverlongConfig
from stream_reward.errors import ConfigError, ScorerTimeoutError, ScoringError
from stream_reward.scoring.deadline import within
from stream_reward.scoring.layers import (
    BatchCall,
    MicroBatchScorer,
    OverlongShaping,
    PrecomputedScore,
    RateLimitedScorer,
)
from stream_reward.scoring.procpool import ProcessPool
from stream_reward.scoring.scorer import Scored, Scorer, load_function, normalize
from stream_reward.wire.trajectory import Trajectory

__all__ = [
    "register_manager",
    "build_scorer",
    "manager_names",
    "function_scorer",
    "RuleScorer",
    "AsyncFunctionScorer",
]


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
            try:
                builder = load_function(config.manager)
            except ConfigError as exc:
                raise ConfigError("manager", exc.reason) from None
        else:
            raise ConfigError("manager", f"unknown manager {config.manager!r}; known: {', '.join(manager_names())}")
    scorer = builder(config)
    if not getattr(scorer, "name", None):
        # What `status` and the metrics call this worker's scorer: the name a wrapped scorer gives
        # itself (a verifier's), else the spec it was built from, never a wrapper's class name.
        try:
            setattr(scorer, "name", _given_name(scorer) or config.scorer)  # noqa: B010 - not in the Scorer protocol
        except AttributeError:  # a custom builder's scorer with __slots__ or a read-only name
            pass
    return scorer


def _given_name(scorer: Any) -> str | None:
    seen = 0
    while scorer is not None and seen < 8:
        name = getattr(scorer, "name", None)
        if isinstance(name, str) and name:
            return name
        scorer, seen = getattr(scorer, "inner", None), seen + 1
    return None


# ---------------------------------------------------------------- base scorers
class RuleScorer:
    """The built-in rule scorers; never suspends, so the worker runs it inline."""

    inline = True

    def __init__(self, reward_kwargs: dict[str, Any] | None = None) -> None:
        from stream_reward.scoring.rules import compute_score

        self._compute = compute_score
        self._kwargs = reward_kwargs or {}

    async def score(self, traj: Trajectory) -> Scored:
        return normalize(
            self._compute(traj.data_source, traj.response, traj.ground_truth, traj.extra_info, **self._kwargs)
        )


class AsyncFunctionScorer:
    """A user ``async def compute_score``, awaited on the worker's loop under a timeout."""

    def __init__(
        self, fn: Callable[..., Any], *, timeout_s: float, reward_kwargs: dict[str, Any] | None = None
    ) -> None:
        self._fn = fn
        self._timeout_s = timeout_s
        self._kwargs = reward_kwargs or {}

    async def score(self, traj: Trajectory) -> Scored:
        try:
            value = await within(
                self._fn(traj.data_source, traj.response, traj.ground_truth, traj.extra_info, **self._kwargs),
                self._timeout_s,
                what=f"async scorer {getattr(self._fn, '__qualname__', self._fn)!r}",
            )
        except asyncio.TimeoutError:  # TimeoutError from 3.11 on; not yet on 3.10
            raise ScorerTimeoutError(
                f"async scorer ran past its {self._timeout_s:g}s timeout and was cancelled"
            ) from None
        return normalize(value)


# ---------------------------------------------------------------- spec dispatch
def _import(module: str, spec: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError("scorer", f"{spec!r} needs {module}, which cannot be imported: {exc}") from exc


def _url(spec: str) -> str:
    url = spec.partition(":")[2]
    if not url:
        raise ConfigError("scorer", f"{spec!r} needs a URL: {spec.partition(':')[0]}:URL")
    return url


def _http(spec: str, config: ManagerConfig) -> Scorer:
    _url(spec)
    return _import("stream_reward.scoring.http.verifiers", spec).build_http_scorer(spec, config)


def _sandbox(spec: str, config: ManagerConfig) -> Scorer:
    if spec != "sandbox":
        raise ConfigError(
            "scorer", f"{spec!r}: the local sandbox takes no argument; set its limits with the 'sandbox' option"
        )
    module = _import("stream_reward.scoring.sandbox.scorer", spec)
    try:
        sandbox_config = module.SandboxConfig(**config.sandbox)
    except TypeError as exc:  # an unknown limit name
        raise ConfigError("sandbox", str(exc)) from None
    return module.SandboxScorer(sandbox_config)


def _sandbox_fusion(spec: str, config: ManagerConfig) -> Scorer:
    return _import("stream_reward.scoring.sandbox.fusion", spec).SandboxFusionScorer(_url(spec))


def _math_verify(spec: str, config: ManagerConfig) -> Scorer:
    if spec != "math-verify":
        raise ConfigError("scorer", f"{spec!r}: math-verify takes no argument")
    # Imported in the scorer processes only: the worker never loads sympy. A sample past its
    # timeout is the answer's loss (0.0, status ok), not a failure: see that module.
    return ProcessPool(
        "stream_reward.scoring.rules.math_verify:compute_score",
        size=config.num_processes,
        timeout_s=config.timeout,
        reward_kwargs=config.reward_kwargs,
        timeout_score=0.0,
    )


# The part of a spec before its first ":" (or the whole spec) -> factory.
_SPEC_KINDS: dict[str, Callable[[str, ManagerConfig], Scorer]] = {
    "http": _http,
    "disrm": _http,
    "genrm": _http,
    "sandbox": _sandbox,
    "sandbox-fusion": _sandbox_fusion,
    "math-verify": _math_verify,
}


def _spec_kind(spec: str) -> str | None:
    head = spec.partition(":")[0]
    return head if head in _SPEC_KINDS else None


def function_scorer(config: ManagerConfig, *, force_process: bool = False) -> Scorer:
    """The scorer for ``config.scorer``: rules inline, remote and sandbox specs by
    the dispatch table, async functions on the loop, sync functions (or every
    function, with ``force_process``) in killable processes; ``config.components``, a
    CompositeScorer of them."""
    if config.components:
        return _import("stream_reward.scoring.composite", "components").build_composite(
            config, force_process=force_process
        )
    kind = _spec_kind(config.scorer)
    if kind is not None:
        if force_process and kind != "math-verify":  # that one runs in scorer processes already
            raise ConfigError(
                "scorer",
                f"manager {config.manager!r} runs Python functions in scorer processes; "
                f"{config.scorer!r} is not one (use naive or rate_limited)",
            )
        return _SPEC_KINDS[kind](config.scorer, config)
    if config.scorer == "rules" and not force_process:
        return RuleScorer(config.reward_kwargs)
    spec = "stream_reward.scoring.rules:compute_score" if config.scorer == "rules" else config.scorer
    fn = load_function(spec)  # fails here, with the spec named, rather than once per sample in a child
    if inspect.iscoroutinefunction(fn) and not force_process:
        return AsyncFunctionScorer(fn, timeout_s=config.timeout, reward_kwargs=config.reward_kwargs)
    return ProcessPool(spec, size=config.num_processes, timeout_s=config.timeout, reward_kwargs=config.reward_kwargs)


# ---------------------------------------------------------------- the managers
def _task_scorer(config: ManagerConfig, *, force_process: bool = False) -> Scorer:
    return PrecomputedScore(function_scorer(config, force_process=force_process))


@register_manager("naive")
def _naive(config: ManagerConfig) -> Scorer:
    """One compute_score call per sample."""
    return _task_scorer(config)


@register_manager("dapo")
def _dapo(config: ManagerConfig) -> Scorer:
    """naive plus the overlong penalty, per sample on the worker."""
    overlong = OverlongConfig.from_config(config.overlong_buffer_cfg, config.max_resp_len)
    return OverlongShaping(_task_scorer(config), overlong, config.max_resp_len)


def _async_batch_call(fn: Callable[..., Any], config: ManagerConfig) -> BatchCall:
    async def call(trajs: list[Trajectory]) -> list[Scored | ScoringError]:
        try:
            values = await within(
                fn(
                    data_sources=[t.data_source for t in trajs],
                    solution_strs=[t.response for t in trajs],
                    ground_truths=[t.ground_truth for t in trajs],
                    extra_infos=[t.extra_info for t in trajs],
                    **config.reward_kwargs,
                ),
                config.timeout,
                what=f"batched async scorer {config.scorer!r}",
            )
        except asyncio.TimeoutError:  # TimeoutError from 3.11 on; not yet on 3.10
            raise ScorerTimeoutError(
                f"batched async scorer ran past its {config.timeout:g}s timeout and was cancelled"
            ) from None
        out: list[Scored | ScoringError] = []
        for value in list(values):
            try:
                out.append(normalize(value))
            except ScoringError as exc:
                out.append(exc)
        return out

    return call


@register_manager("batch")
def _batch(config: ManagerConfig) -> Scorer:
    """One batched compute_score call per micro-batch of samples."""
    if config.scorer == "rules" or _spec_kind(config.scorer) is not None:
        raise ConfigError(
            "scorer",
            f"the batch manager calls a batched compute_score(data_sources=, solution_strs=, "
            f"ground_truths=, extra_infos=); {config.scorer!r} is not one",
        )
    fn = load_function(config.scorer)
    if inspect.iscoroutinefunction(fn):
        batcher = MicroBatchScorer(
            _async_batch_call(fn, config), batch_size=config.batch_size, batch_wait_s=config.batch_wait_ms / 1000
        )
    else:
        pool = ProcessPool(
            config.scorer, size=config.num_processes, timeout_s=config.timeout, reward_kwargs=config.reward_kwargs
        )
        batcher = MicroBatchScorer(
            pool.score_batch, batch_size=config.batch_size, batch_wait_s=config.batch_wait_ms / 1000, close=pool.aclose
        )
    return PrecomputedScore(batcher)


@register_manager("prime")
def _prime(config: ManagerConfig) -> Scorer:
    """Every call in a killable scorer process, ``timeout`` per sample (verl: a
    ProcessPoolExecutor in the trainer, 300 s per sample)."""
    return _task_scorer(config, force_process=True)


@register_manager("remote")
def _remote(config: ManagerConfig) -> Scorer:
    """Scorer in separate processes (verl: Ray actors, for scorers that are not
    thread-safe, e.g. math-verify). Same mechanism as ``prime`` here."""
    return _task_scorer(config, force_process=True)


@register_manager("rate_limited")
def _rate_limited(config: ManagerConfig) -> Scorer:
    """naive's scorer under a global RPM / TPM / in-flight quota held in Redis."""
    for key in ("max_rpm", "max_tpm"):
        value = getattr(config, key)
        if value is not None and not value > 0:
            raise ConfigError(key, f"must be > 0, got {value!r}")
    if config.max_concurrent is not None and config.max_concurrent < 1:
        raise ConfigError("max_concurrent", f"must be >= 1, got {config.max_concurrent!r}")
    if config.estimated_tokens_per_request < 0:
        raise ConfigError("estimated_tokens_per_request", f"must be >= 0, got {config.estimated_tokens_per_request!r}")
    inner = function_scorer(config)
    if getattr(inner, "manages_quota", False):
        # The HTTP verifiers take leases of this same quota per request (and share
        # their 429 pauses) themselves: a second lease around them would count twice.
        return PrecomputedScore(inner)
    return PrecomputedScore(RateLimitedScorer(inner, config))
