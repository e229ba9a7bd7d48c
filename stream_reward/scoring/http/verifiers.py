"""Remote verifiers over HTTP: a generic verifier, discriminative and generative reward models.

Specs (``--scorer``), each taking one or more base URLs separated by commas::

    http:URL[,URL...]    POST URL  {"uid", "data_source", "solution_str", "ground_truth",
                                    "extra_info", "prompt"} -> {"score": float, ...}
    disrm:URL[,URL...]   a reward model: vLLM  POST /classify  {"model", "input"} -> data[-1].probs[-1]
                                         SGLang POST /v1/embeddings             -> data[-1].embedding[i]
    genrm:URL[,URL...]   an LLM judge on POST /v1/chat/completions; the verdict is parsed for a score

Options come from ``reward_kwargs`` (``--reward-kwargs '{"api": "embeddings"}'``);
see ``HttpOptions`` (``http_options``) and docs/remote.md. This module holds the
three protocols — what each sends and how it reads the reply — and
``build_http_scorer``, which turns a spec and a ManagerConfig into one of them.
How a request travels (quota lease, router and breakers, retries, the session)
is ``HttpScorer`` in ``http_transport``, which every protocol extends.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable
from typing import Any

from yarl import URL

from stream_reward.config import ManagerConfig, QuotaConfig
from stream_reward.errors import BadReplyError, ConfigError
from stream_reward.scoring.http.options import DEFAULT_GENRM_TEMPLATE, HttpOptions
from stream_reward.scoring.http.router import CircuitBreaker, Router
from stream_reward.scoring.http.transport import HttpScorer, masked_spec
from stream_reward.scoring.quota import QuotaLimiter
from stream_reward.scoring.retry import RetryPolicy
from stream_reward.scoring.scorer import Scored, load_function, normalize
from stream_reward.wire.connection import mask_url
from stream_reward.wire.trajectory import Trajectory

__all__ = [
    "HttpOptions",
    "HttpScorer",
    "GenericVerifier",
    "DisRMScorer",
    "GenRMScorer",
    "CircuitBreaker",
    "Router",
    "build_http_scorer",
]

_PLACEHOLDER = re.compile(r"\{(prompt|response|ground_truth|data_source|uid)\}")


def render(template: str, traj: Trajectory) -> str:
    """Fill ``{prompt}``, ``{response}``, ``{ground_truth}``, ``{data_source}``, ``{uid}``.

    Only these names are replaced, so any other brace in a template (``\\boxed{}``,
    JSON examples) is left alone — ``str.format`` would choke on it.
    """
    values = {
        "prompt": traj.prompt or "",
        "response": traj.response,
        "ground_truth": "" if traj.ground_truth is None else str(traj.ground_truth),
        "data_source": traj.data_source,
        "uid": traj.uid,
    }
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


# ---------------------------------------------------------------------- protocols
def _usage_tokens(reply: dict[str, Any]) -> int | None:
    usage = reply.get("usage")
    if not isinstance(usage, dict):
        return None
    total = usage.get("total_tokens")
    if total is None:
        parts = [usage.get("prompt_tokens"), usage.get("completion_tokens")]
        if all(p is None for p in parts):
            return None
        total = sum(p for p in parts if isinstance(p, (int, float)))
    if isinstance(total, bool) or not isinstance(total, (int, float)) or total < 0:
        return None
    return int(total)


def _path(url: str, *suffixes: str) -> str:
    """``url`` if it already ends with one of ``suffixes`` (a full endpoint URL),
    else the base URL with the first suffix appended (``/v1`` bases get the rest)."""
    trimmed = url.rstrip("/")
    for suffix in suffixes:
        if trimmed.endswith(suffix):
            return trimmed
    full = suffixes[0]
    if trimmed.endswith("/v1") and full.startswith("/v1/"):
        return trimmed + full[3:]
    return trimmed + full


class GenericVerifier(HttpScorer):
    """``http:URL`` — POST the sample; the reply's ``score`` is the score, every other
    key but ``usage`` lands in the extra info."""

    kind = "http"

    def request(self, traj: Trajectory) -> dict[str, Any]:
        body = {
            "uid": traj.uid,
            "data_source": traj.data_source,
            "solution_str": traj.response,
            "ground_truth": traj.ground_truth,
            "extra_info": traj.extra_info,
            "prompt": traj.prompt,
        }
        body.update(self.options.extra_body)
        return body

    def parse(self, reply: Any, traj: Trajectory) -> tuple[Scored, int | None]:
        if not isinstance(reply, dict):
            raise BadReplyError(
                f"verifier replied with a JSON {type(reply).__name__}, not an object", reason="no_score"
            )
        if "score" not in reply:
            raise BadReplyError(
                f"verifier reply has no 'score' (keys: {sorted(map(str, reply))[:10]})", reason="no_score"
            )
        used = _usage_tokens(reply)
        return normalize({k: v for k, v in reply.items() if k != "usage"}), used


class DisRMScorer(HttpScorer):
    """``disrm:URL`` — a discriminative reward model behind vLLM ``/classify`` or
    SGLang ``/v1/embeddings`` (option ``api``)."""

    kind = "disrm"

    def endpoint_url(self, base: str) -> str:
        if self.options.api == "embeddings":
            return _path(base, "/v1/embeddings", "/embeddings")
        return _path(base, "/classify")

    def request(self, traj: Trajectory) -> dict[str, Any]:
        return self._with_model({"input": render(self.options.template or "{prompt}{response}", traj)})

    def parse(self, reply: Any, traj: Trajectory) -> tuple[Scored, int | None]:
        try:
            item = reply["data"][-1]
            if self.options.api == "embeddings":
                value = item["embedding"][self.options.embedding_index]
            else:
                value = item["probs"][-1]
        except (KeyError, IndexError, TypeError):
            shape = "data[-1].embedding" if self.options.api == "embeddings" else "data[-1].probs[-1]"
            raise BadReplyError(
                f"reward model reply has no {shape}: {json.dumps(reply)[:200]}", reason="no_score"
            ) from None
        return normalize(value), _usage_tokens(reply) if isinstance(reply, dict) else None


class GenRMScorer(HttpScorer):
    """``genrm:URL`` — an LLM judge on an OpenAI-compatible ``/v1/chat/completions``."""

    kind = "genrm"

    def __init__(self, urls: list[str], **kwargs: Any) -> None:
        super().__init__(urls, **kwargs)
        o = self.options
        self._pattern = re.compile(o.score_pattern)
        parser = o.score_parser
        if isinstance(parser, str):
            parser = load_function(parser)
        if parser is not None and not callable(parser):
            raise ConfigError(
                "reward_kwargs.score_parser", f"must be FILE.py:FUNC, module:FUNC or a callable, got {parser!r}"
            )
        self._parser: Callable[[str], Any] | None = parser

    def endpoint_url(self, base: str) -> str:
        return _path(base, "/v1/chat/completions", "/chat/completions")

    def request(self, traj: Trajectory) -> dict[str, Any]:
        o = self.options
        messages = []
        if o.system:
            messages.append({"role": "system", "content": render(o.system, traj)})
        messages.append({"role": "user", "content": render(o.template or DEFAULT_GENRM_TEMPLATE, traj)})
        return self._with_model({"messages": messages, "max_tokens": o.max_tokens, "temperature": o.temperature})

    def parse(self, reply: Any, traj: Trajectory) -> tuple[Scored, int | None]:
        try:
            verdict = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise BadReplyError(
                f"judge reply has no choices[0].message.content: {json.dumps(reply)[:200]}", reason="no_verdict"
            ) from None
        if not isinstance(verdict, str):
            raise BadReplyError(f"judge verdict is {type(verdict).__name__}, not text", reason="no_verdict")
        used = _usage_tokens(reply)
        scored = self.verdict_score(verdict)
        if self.options.keep_verdict:
            scored.extra["genrm_verdict"] = verdict
        return scored, used

    def verdict_score(self, verdict: str) -> Scored:
        if self._parser is not None:
            try:
                value = self._parser(verdict)
            except Exception as exc:  # the user's parser refusing a verdict is a data fault
                raise BadReplyError(
                    f"score_parser raised {type(exc).__name__}: {exc}", reason="unparseable_verdict"
                ) from exc
            if value is None:
                raise BadReplyError(
                    f"score_parser found no score in the verdict: {_tail(verdict)!r}", reason="unparseable_verdict"
                )
            return normalize(value)
        matches = self._pattern.findall(verdict)
        if not matches:
            raise BadReplyError(
                f"no score matching {self.options.score_pattern!r} in the verdict: {_tail(verdict)!r}",
                reason="unparseable_verdict",
            )
        last = matches[-1]
        text = last[0] if isinstance(last, tuple) else last
        try:
            value = float(text) * self.options.score_scale
        except ValueError:
            raise BadReplyError(
                f"score {text!r} in the verdict is not a number", reason="unparseable_verdict"
            ) from None
        if not math.isfinite(value):
            raise BadReplyError(f"score {text!r} in the verdict is not finite", reason="unparseable_verdict")
        return Scored(value)


def _tail(text: str, n: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else "..." + text[-n:]


_KINDS: dict[str, type[HttpScorer]] = {"http": GenericVerifier, "disrm": DisRMScorer, "genrm": GenRMScorer}


# ---------------------------------------------------------------------- factory
def parse_spec(spec: str) -> tuple[str, list[str]]:
    """``kind:URL[,URL...]`` -> (kind, urls), validated."""
    kind, sep, rest = spec.partition(":")
    if kind not in _KINDS or not sep:
        raise ConfigError("scorer", f"{spec!r} is not http:URL, disrm:URL or genrm:URL")
    urls = [u.strip() for u in rest.split(",") if u.strip()]
    if not urls:
        raise ConfigError("scorer", f"{spec!r} needs at least one URL: {kind}:URL[,URL...]")
    for url in urls:
        try:
            parsed = URL(url)
        except (ValueError, TypeError) as exc:
            raise ConfigError("scorer", f"{mask_url(url)!r} is not a URL: {exc}") from None
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ConfigError("scorer", f"{mask_url(url)!r} must be an http:// or https:// URL with a host")
    return kind, urls


def quota_name(kind: str, urls: list[str], options: HttpOptions, quota_key: str | None) -> str:
    """The quota's key: ``quota_key``; else the API key's fingerprint (providers meter
    per key); else the spec with credentials masked."""
    if quota_key:
        name = quota_key
    elif options.api_key:
        name = "key-" + hashlib.sha256(options.api_key.encode()).hexdigest()[:16]
    else:
        name = masked_spec(kind, urls)
    return name.replace("{", "(").replace("}", ")")


def build_http_scorer(spec: str, config: ManagerConfig) -> HttpScorer:
    """The scorer for an ``http:`` / ``disrm:`` / ``genrm:`` spec under a ManagerConfig.

    ``config.timeout`` bounds each HTTP request (time spent waiting for quota is
    not counted); ``config.retries`` is the budget for infrastructure faults;
    ``max_rpm`` / ``max_tpm`` / ``max_concurrent`` become the global quota named
    ``quota_key``. With a Redis URL the quota (and the shared 429 pause) is
    always on; without one, limits are a configuration error.
    """
    kind, urls = parse_spec(spec)
    options = HttpOptions.from_kwargs(config.reward_kwargs)
    redis_url = config.redis_url
    limits: dict[str, Any] = {
        "max_rpm": config.max_rpm,
        "max_tpm": config.max_tpm,
        "max_concurrent": config.max_concurrent,
    }
    limiter = None
    if redis_url:
        limiter = QuotaLimiter(
            redis_url,
            QuotaConfig(
                name=quota_name(kind, urls, options, config.quota_key),
                **limits,
                estimated_tokens_per_request=config.estimated_tokens_per_request,
                lease_ttl_s=max(60.0, 2 * config.timeout),
                burst=options.burst,
                adaptive=options.adaptive_rate,
            ),
            namespace=config.namespace,
        )
    elif any(v is not None for v in limits.values()):
        raise ConfigError(
            "redis_url",
            f"{', '.join(k for k, v in limits.items() if v is not None)} need a Redis URL: the quota is kept in Redis",
        )
    if not config.timeout > 0:
        raise ConfigError("timeout", f"must be > 0, got {config.timeout!r}")
    try:
        retry = RetryPolicy(
            retries=config.retries, backoff_base_s=options.backoff_base_s, backoff_max_s=options.backoff_max_s
        )
    except ValueError as exc:
        raise ConfigError("retries", str(exc)) from None
    scorer = _KINDS[kind](
        urls,
        options=options,
        timeout_s=config.timeout,
        retry=retry,
        limiter=limiter,
        estimated_tokens=config.estimated_tokens_per_request,
        max_connections=options.max_connections or config.max_concurrent or 256,
    )
    scorer.name = quota_name(kind, urls, options, config.quota_key)
    return scorer
