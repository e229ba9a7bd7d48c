"""``HttpOptions``: the ``reward_kwargs`` of the HTTP scorers, parsed and validated.

One flat dataclass for the three protocols (``http``, ``disrm``, ``genrm``): a
worker passes one ``--reward-kwargs`` JSON whatever the spec, and an unknown key
is an error rather than silently ignored. docs/remote.md has the table.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

from stream_reward.errors import ConfigError

__all__ = ["HttpOptions", "DEFAULT_GENRM_TEMPLATE", "DEFAULT_SCORE_PATTERN"]

# The default judge prompt and the default pattern go together: the one asks for
# the "Score: x" line the other finds.
DEFAULT_GENRM_TEMPLATE = (
    "Judge whether the response answers the question correctly. Compare it with the reference answer.\n\n"
    "<question>{prompt}</question>\n\n"
    "<reference>{ground_truth}</reference>\n\n"
    "<response>{response}</response>\n\n"
    'Think briefly, then end with a last line "Score: 1" if the response is correct or "Score: 0" if it is not.'
)
# The last "Score: x" (or "score = x", "**Score:** x") or \boxed{x} of the verdict.
DEFAULT_SCORE_PATTERN = r"(?:\\boxed\{\s*|(?i:score)\**\s*[:=]\s*\**\s*)(-?\d+(?:\.\d+)?)"


@dataclass
class HttpOptions:
    """Options of the HTTP scorers, from ``reward_kwargs``. Unknown keys are an error.

    Common: ``headers`` (sent with every request), ``api_key`` / ``api_key_env``
    (``Authorization: Bearer``; also keys the quota when no ``quota_key`` is set),
    ``connect_timeout_s``, ``max_connections`` (per process; default
    ``max_concurrent`` or 256), ``breaker_failures`` / ``breaker_cooldown_s`` /
    ``breaker_max_cooldown_s``, ``backoff_base_s`` / ``backoff_max_s``,
    ``adaptive_rate`` (lower the shared rate after repeated 429s), ``burst``
    (GCRA burst, requests), ``model`` (sent when set), ``extra_body`` (merged into
    every request body).

    ``disrm``: ``api`` = ``classify`` (vLLM, default) or ``embeddings`` (SGLang),
    ``template`` (default ``{prompt}{response}``; apply the model's chat template
    here), ``embedding_index`` (default 0).

    ``genrm``: ``template`` (user message; default asks for ``Score: 0|1``),
    ``system``, ``score_pattern`` (regex, group 1 is the score; the last match
    wins), ``score_parser`` (``FILE.py:FUNC`` or ``module:FUNC``, ``fn(verdict) ->
    float | dict | None``; None means unparseable), ``score_scale`` (multiplies a
    regex score), ``max_tokens``, ``temperature``, ``keep_verdict`` (verdict text
    in the extra info as ``genrm_verdict``).
    """

    headers: dict[str, str] = field(default_factory=dict)
    api_key: str | None = None
    api_key_env: str | None = None
    connect_timeout_s: float = 10.0
    max_connections: int | None = None
    breaker_failures: int = 3
    breaker_cooldown_s: float = 5.0
    breaker_max_cooldown_s: float = 60.0
    backoff_base_s: float = 0.1
    backoff_max_s: float = 10.0
    adaptive_rate: bool = False
    burst: float = 1.0
    model: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    # disrm
    api: str = "classify"
    template: str | None = None
    embedding_index: int = 0
    # genrm
    system: str | None = None
    score_pattern: str = DEFAULT_SCORE_PATTERN
    score_parser: Any = None
    score_scale: float = 1.0
    max_tokens: int = 1024
    temperature: float = 0.0
    keep_verdict: bool = False

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any] | None) -> HttpOptions:
        kwargs = dict(kwargs or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(
                f"reward_kwargs.{unknown[0]}", f"unknown option of the HTTP scorers; known: {', '.join(sorted(known))}"
            )
        options = cls(**kwargs)
        options.validate()
        return options

    def validate(self) -> None:
        if self.api not in ("classify", "embeddings"):
            raise ConfigError("reward_kwargs.api", f"must be 'classify' or 'embeddings', got {self.api!r}")
        for key in ("connect_timeout_s", "breaker_cooldown_s", "breaker_max_cooldown_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"reward_kwargs.{key}", f"must be > 0, got {getattr(self, key)!r}")
        if self.breaker_failures < 1:
            raise ConfigError("reward_kwargs.breaker_failures", f"must be >= 1, got {self.breaker_failures!r}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ConfigError("reward_kwargs.max_connections", f"must be >= 1, got {self.max_connections!r}")
        try:
            compiled = re.compile(self.score_pattern)
        except re.error as exc:
            raise ConfigError("reward_kwargs.score_pattern", f"not a valid regex: {exc}") from None
        if compiled.groups < 1:
            raise ConfigError("reward_kwargs.score_pattern", "needs a capturing group around the score")
        if self.api_key_env and not self.api_key:
            self.api_key = os.environ.get(self.api_key_env)
            if not self.api_key:
                raise ConfigError("reward_kwargs.api_key_env", f"environment variable {self.api_key_env!r} is not set")
