"""Composite rewards: several scorers, weighted, each with its own failure policy.

A reward is rarely one verifier: a format check, a correctness check and a judge,
summed with weights. Written as one function, the slowest call stalls the rest and a
judge outage zeroes the reward. Here each component is a scorer of its own (any
``--scorer`` spec) with its own timeout, retries and quota, and the components of a
sample run concurrently, ordered only by ``skip_unless``: a sample takes as long as
its slowest path, not the sum.

``CompositeScorer`` is a Scorer like any other, so it works wherever one does. Its
score is the sum of ``weight * score`` over the components that ran; its extra info
carries, for every component and every sample (missing values filled explicitly, as
verl builds its columns from the first sample's keys), ``<name>``, ``<name>_status``
(``ok``, ``failed``, ``timeout``, ``skipped``), ``<name>_latency_ms`` and the
component's own extra keys as ``<name>/<key>``: its declared ``columns`` (the built-in
scorers' keys by default) from the first sample on, and any other key once seen (verl's
reward loop keeps only the declared ones: ``stream_reward.verl.columns``).

A required component that fails or times out fails the sample, with a reason naming
it: a partial sum is never passed off as the reward. The failed sample still carries
every column (its ScoringError's ``extra``): the other components' scores where they
finished, ``cancelled`` where they had not. An optional one is left out of the sum, and
its status says why. A component whose ``skip_unless`` gate failed or timed out is not
skipped (whether it would have run is unknown): it fails as if it had.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stream_reward.config import ManagerConfig
from stream_reward.errors import ConfigError, ScoringError
from stream_reward.scoring.columns import default_columns, parse_columns
from stream_reward.scoring.scorer import Scored, Scorer
from stream_reward.wire.trajectory import Trajectory

__all__ = ["Component", "CompositeScorer", "parse_components", "build_composite", "composite_columns"]

_QUOTA_KEYS = ("max_concurrent", "max_rpm", "max_tpm", "estimated_tokens_per_request", "quota_key")
_KEYS = (
    "name",
    "scorer",
    "weight",
    "timeout_s",
    "required",
    "skip_unless",
    "quota",
    "reward_kwargs",
    "sandbox",
    "retries",
    "columns",
)
_COLUMNS = ("", "_status", "_latency_ms")  # a component's columns in the extra info, after its name
# Keys the managers put beside the components' columns: verl's loop logs the task score as
# "score", dapo its penalty as "overlong_reward" and "overlong".
_RESERVED = ("score", "overlong", "overlong_reward")
_SEEN_KEYS_MAX = 64  # a component's undeclared keys carried on every later sample, at most
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
# Specs whose head is known without importing anything; anything else must be FILE:FUNC or module:FUNC.
_SPEC_HEADS = ("http", "disrm", "genrm", "sandbox-fusion")
_PLAIN_SPECS = ("rules", "sandbox", "math-verify")


@dataclass(frozen=True, slots=True)
class Component:
    """One ``[[reward.components]]`` entry. ``timeout_s`` and ``retries`` default to the
    reward's ``timeout`` and ``retries``; ``quota`` holds the keys of ``[quota]`` for a
    limiter of the component's own (``quota_key`` defaults to the component's name).
    ``columns`` are the scorer's own extra keys, declared: every sample carries each as
    ``<name>/<key>`` (None where it has none); None means the built-in scorer's defaults
    (``scoring.columns.default_columns``)."""

    name: str
    scorer: str
    weight: float = 1.0
    timeout_s: float | None = None
    required: bool = True
    skip_unless: str | None = None
    quota: dict[str, Any] | None = None
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    sandbox: dict[str, Any] = field(default_factory=dict)
    retries: int | None = None
    columns: tuple[str, ...] | None = None

    @property
    def declared(self) -> tuple[str, ...]:
        """The component's own extra keys that every sample carries."""
        return self.columns if self.columns is not None else default_columns(self.scorer, self.reward_kwargs)


def composite_columns(components: Sequence[Component]) -> list[str]:
    """Every extra-info column a composite of ``components`` gives every sample, in order."""
    out: list[str] = []
    for c in components:
        out += [f"{c.name}{suffix}" for suffix in _COLUMNS] + [f"{c.name}/{key}" for key in c.declared]
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _parse_one(raw: Any, index: int, earlier: Sequence[str]) -> Component:
    where = f"reward.components[{index}]"
    if not isinstance(raw, Mapping):
        raise ConfigError(where, f"must be a table with name and scorer, got {type(raw).__name__}")
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"{where}.name", f"must be letters, digits, '_', '.' or '-', got {name!r}")
    where = f"reward.components.{name}"
    unknown = sorted(set(map(str, raw)) - set(_KEYS))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}", f"unknown key; known: {', '.join(_KEYS)}")
    if name in earlier:
        raise ConfigError(where, "duplicate component name")
    taken = sorted({f"{name}{suffix}" for suffix in _COLUMNS} & set(_RESERVED))
    if taken:
        raise ConfigError(where, f"its column {taken[0]!r} is the reward's own; reserved: {', '.join(_RESERVED)}")
    columns = {f"{e}{suffix}" for e in earlier for suffix in _COLUMNS}
    if columns & {f"{name}{suffix}" for suffix in _COLUMNS}:
        raise ConfigError(where, f"its columns would clash with an earlier component's ({', '.join(sorted(columns))})")
    scorer = raw.get("scorer")
    if not isinstance(scorer, str) or not scorer:
        raise ConfigError(f"{where}.scorer", f"must be a scorer spec, got {scorer!r}")
    head, sep, _ = scorer.partition(":")
    if scorer not in _PLAIN_SPECS and head not in _SPEC_HEADS and not (sep and head and scorer.rpartition(":")[2]):
        raise ConfigError(
            f"{where}.scorer",
            f"unknown scorer {scorer!r}; use rules, math-verify, sandbox, http:URL, disrm:URL, genrm:URL, "
            "sandbox-fusion:URL, FILE.py:FUNC or module:FUNC",
        )
    weight = raw.get("weight", 1.0)
    if not _is_number(weight):
        raise ConfigError(f"{where}.weight", f"must be a number, got {weight!r}")
    timeout_s = raw.get("timeout_s")
    if timeout_s is not None and not (_is_number(timeout_s) and timeout_s > 0):
        raise ConfigError(f"{where}.timeout_s", f"must be a number > 0, got {timeout_s!r}")
    retries = raw.get("retries")
    if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int) or retries < 0):
        raise ConfigError(f"{where}.retries", f"must be an integer >= 0, got {retries!r}")
    required = raw.get("required", True)
    if not isinstance(required, bool):
        raise ConfigError(f"{where}.required", f"must be true or false, got {required!r}")
    skip_unless = raw.get("skip_unless")
    if skip_unless is not None and skip_unless not in earlier:
        raise ConfigError(
            f"{where}.skip_unless",
            f"{skip_unless!r} is not the name of an earlier component (earlier: {list(earlier)})",
        )
    for key in ("reward_kwargs", "sandbox"):
        value = raw.get(key, {})
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{where}.{key}", f"must be a table with string keys, got {value!r}")
    quota = raw.get("quota")
    if quota is not None:
        quota = _parse_quota(quota, where)
    declared = raw.get("columns")
    if declared is not None:
        declared = parse_columns(declared, f"{where}.columns")
    return Component(
        name=name,
        scorer=scorer,
        weight=float(weight),
        timeout_s=None if timeout_s is None else float(timeout_s),
        required=required,
        skip_unless=skip_unless,
        quota=quota,
        reward_kwargs=dict(raw.get("reward_kwargs", {})),
        sandbox=dict(raw.get("sandbox", {})),
        retries=retries,
        columns=declared,
    )


def _parse_quota(quota: Any, where: str) -> dict[str, Any]:
    if not isinstance(quota, Mapping):
        raise ConfigError(f"{where}.quota", f"must be a table of {', '.join(_QUOTA_KEYS)}, got {quota!r}")
    out = dict(quota)
    for key, value in out.items():
        if key not in _QUOTA_KEYS:
            raise ConfigError(f"{where}.quota.{key}", f"unknown key; known: {', '.join(_QUOTA_KEYS)}")
        if key == "quota_key":
            if not isinstance(value, str) or not value or any(c in value for c in "{}"):
                raise ConfigError(
                    f"{where}.quota.quota_key", f"must be a non-empty string without braces, got {value!r}"
                )
        elif value is not None and not (_is_number(value) and value > 0):
            raise ConfigError(f"{where}.quota.{key}", f"must be a number > 0, got {value!r}")
    for key in ("max_concurrent", "estimated_tokens_per_request"):
        if out.get(key) is not None and not isinstance(out[key], int):
            raise ConfigError(f"{where}.quota.{key}", f"must be an integer, got {out[key]!r}")
    return out


def parse_components(raw: Any) -> list[Component]:
    """Check ``reward.components`` as read from a config file; a bad entry is a
    ``ConfigError`` naming it (``reward.components.judge.skip_unless``)."""
    if not isinstance(raw, (list, tuple)):
        raise ConfigError("reward.components", f"must be a list of tables, got {type(raw).__name__}")
    if not raw:  # given but empty: not a fall back to the default scorer
        raise ConfigError("reward.components", "needs at least one component")
    out: list[Component] = []
    for index, entry in enumerate(raw):
        out.append(entry if isinstance(entry, Component) else _parse_one(entry, index, [c.name for c in out]))
    return out


# ---------------------------------------------------------------------- scoring
@dataclass(slots=True)
class _Outcome:
    status: str  # ok | failed | timeout | skipped | cancelled
    score: float | None
    latency_ms: float
    extra: dict[str, Any]


def _outcomes_so_far(tasks: Mapping[str, asyncio.Task[_Outcome]], started: Mapping[str, float]) -> dict[str, _Outcome]:
    """Each component's outcome once a required one has failed: its result when it has
    one, its failure, or ``cancelled`` (score None) when it had not finished."""
    now = time.perf_counter()
    out: dict[str, _Outcome] = {}
    for name, task in tasks.items():
        error = task.exception() if task.done() and not task.cancelled() else None
        if isinstance(error, _RequiredFailed):
            out[name] = error.args[2]
        elif task.done() and not task.cancelled() and error is None:
            out[name] = task.result()
        else:
            since = started.get(name)
            out[name] = _Outcome("cancelled", None, 0.0 if since is None else (now - since) * 1000, {})
    return out


class _RequiredFailed(Exception):
    """A required component failed: ``args`` are its name, its ScoringError and its _Outcome."""


class CompositeScorer:
    """Score a sample with every component; see the module docstring."""

    inline = False

    def __init__(self, components: Sequence[tuple[Component, Scorer]]) -> None:
        if not components:
            raise ConfigError("reward.components", "needs at least one component")
        self.components = list(components)
        self.name = "composite(" + ",".join(c.name for c, _ in self.components) + ")"
        # Each component's own extra keys: the declared ones from the first sample on, then any
        # other seen so far (later samples carry them all, filled with None). Only the declared
        # ones reach verl's reward loop (stream_reward.verl.columns).
        self._seen: dict[str, dict[str, None]] = {c.name: dict.fromkeys(c.declared) for c, _ in self.components}

    async def score(self, traj: Trajectory) -> Scored:
        tasks: dict[str, asyncio.Task[_Outcome]] = {}
        started: dict[str, float] = {}  # when each component's scorer was called
        for component, scorer in self.components:
            after = tasks.get(component.skip_unless) if component.skip_unless else None
            tasks[component.name] = asyncio.ensure_future(self._run(component, scorer, traj, after, started))
        try:
            # The first required component to fail ends the sample: the others are cancelled
            # rather than spend calls (and quota) on a sum that will not be used.
            await asyncio.gather(*tasks.values())
        except _RequiredFailed as failed:
            name, error, _ = failed.args
            verb = "timed out" if error.reason == "timeout" else "failed"
            # The failed sample still carries every column, with what each component got to.
            extra = self._combine(_outcomes_so_far(tasks, started)).extra
            raise ScoringError(
                f"required component {name!r} {verb}: {error}",
                reason=f"{name}:{error.reason}",
                attempts=error.attempts,
                extra=extra,
            ) from None
        finally:
            for task in tasks.values():
                task.cancel()
        return self._combine({name: task.result() for name, task in tasks.items()})

    async def _run(
        self,
        component: Component,
        scorer: Scorer,
        traj: Trajectory,
        after: asyncio.Task[_Outcome] | None,
        started: dict[str, float],
    ) -> _Outcome:
        if after is not None:
            gate = await asyncio.shield(after)
            if gate.status in ("failed", "timeout"):
                # Whether this one would have run is unknown: not the policy's loss, so not a skip.
                if component.required:
                    error = ScoringError(
                        f"its skip_unless {component.skip_unless!r} {gate.status}", reason="gate_failed"
                    )
                    raise _RequiredFailed(component.name, error, _Outcome("failed", None, 0.0, {}))
                return _Outcome("failed", None, 0.0, {})
            if gate.status != "ok" or not (gate.score or 0.0) > 0:
                return _Outcome("skipped", 0.0, 0.0, {})
        started[component.name] = time.perf_counter()
        try:
            scored = await scorer.score(traj)
        except Exception as exc:  # a component's bug is its failure, not the worker's
            if not isinstance(exc, ScoringError):
                exc = ScoringError(f"{type(exc).__name__}: {exc}")
            status = "timeout" if exc.reason == "timeout" else "failed"
            outcome = _Outcome(status, None, (time.perf_counter() - started[component.name]) * 1000, {})
            if component.required:
                raise _RequiredFailed(component.name, exc, outcome) from None
            return outcome
        return _Outcome("ok", scored.score, (time.perf_counter() - started[component.name]) * 1000, dict(scored.extra))

    def _combine(self, outcomes: Mapping[str, _Outcome]) -> Scored:
        total = 0.0
        extra: dict[str, Any] = {}
        for component, _ in self.components:
            name, outcome = component.name, outcomes[component.name]
            if outcome.status == "ok":
                total += component.weight * float(outcome.score or 0.0)
            extra[name] = outcome.score
            extra[f"{name}_status"] = outcome.status
            extra[f"{name}_latency_ms"] = round(outcome.latency_ms, 3)
            seen = self._seen[name]
            for key in outcome.extra:
                # Bounded: a scorer whose keys come from the data (one per test case, say)
                # would otherwise make every later sample carry every key ever seen.
                if key not in seen and len(seen) < _SEEN_KEYS_MAX:
                    seen[key] = None
            for key in seen:
                extra[f"{name}/{key}"] = outcome.extra.get(key)
            for key in outcome.extra:
                extra.setdefault(f"{name}/{key}", outcome.extra[key])
        if not math.isfinite(total):  # finite weights and scores can still overflow the sum
            raise ScoringError(f"the weighted sum of the components is not finite ({total})", reason="bad_score")
        return Scored(total, extra)

    async def aclose(self) -> None:
        for _, scorer in self.components:
            close = getattr(scorer, "aclose", None)
            if close is not None:
                await close()


# ---------------------------------------------------------------------- building
def _component_config(component: Component, config: ManagerConfig) -> ManagerConfig:
    quota = component.quota or {}
    return dataclasses.replace(
        config,
        scorer=component.scorer,
        components=[],
        reward_kwargs=dict(component.reward_kwargs),
        sandbox=dict(component.sandbox),
        timeout=component.timeout_s if component.timeout_s is not None else config.timeout,
        retries=component.retries if component.retries is not None else config.retries,
        # The reward's own [quota] is not the component's: a component has the limits it gives.
        max_rpm=quota.get("max_rpm"),
        max_tpm=quota.get("max_tpm"),
        max_concurrent=quota.get("max_concurrent"),
        estimated_tokens_per_request=quota.get("estimated_tokens_per_request", config.estimated_tokens_per_request),
        quota_key=quota.get("quota_key", component.name) if component.quota is not None else None,
    )


def build_composite(config: ManagerConfig, *, force_process: bool = False) -> CompositeScorer:
    """The CompositeScorer of ``config.components``: each component's scorer is built
    by the registry from its own spec and options; one with a ``quota`` holds a lease
    of its own limiter per attempt (HTTP verifiers take their leases themselves)."""
    from stream_reward.scoring.layers import RateLimitedScorer
    from stream_reward.scoring.registry import function_scorer

    if force_process:
        raise ConfigError(
            "reward.components", f"manager {config.manager!r} runs one function in scorer processes; use naive or dapo"
        )
    built: list[tuple[Component, Scorer]] = []
    for component in parse_components(config.components):
        sub = _component_config(component, config)
        if component.quota is not None and not config.redis_url:
            raise ConfigError(
                f"reward.components.{component.name}.quota", "is held in Redis and needs the worker's Redis URL"
            )
        try:
            scorer = function_scorer(sub)
        except ConfigError as exc:
            raise ConfigError(f"reward.components.{component.name}.{exc.key}", exc.reason) from None
        if component.quota is not None and not getattr(scorer, "manages_quota", False):
            scorer = RateLimitedScorer(scorer, sub)
        built.append((component, scorer))
    return CompositeScorer(built)
