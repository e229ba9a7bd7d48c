"""``POST /openrlhf``: OpenRLHF's ``--reward.remote_url`` wire format.

What OpenRLHF 0.11 sends and reads (``openrlhf/utils/agent.py``,
``SingleTurnAgentExecutor._fetch_rewards_via_http`` and ``execute``; the reply's use in
``openrlhf/trainer/ppo_utils/samples_generator.py``, ``_process_response_into_experience``):

* request ``{"query": [str], "prompts": [str], "labels": [...]}``; ``query`` is the
  decoded prompt + response, so the response is ``query`` minus its prompt. 0.11 sends
  one sample per request; older versions and other callers send many, which works alike.
* reply ``{"rewards": [float], "scores": [float], "extra_logs": {key: [float]}}``: it
  reads ``rewards`` and ``scores`` (falling back to ``rewards``), and turns each
  ``extra_logs`` value into ``torch.tensor([value])``, so every value here is a list of
  numbers, one per sample. OpenRLHF then merges a step's samples key by key
  (``Experience._merge_item``) and checks each key holds one value per sample
  (``split_experience_batch``): a key one reply lacks fails the step. So the keys are
  the same in every reply: ``failed`` and ``failed_<class>`` (``FAILURE_CLASSES``), and
  the scorer's numeric keys the operator declared (``--extra-logs``; 0.0 where a sample
  has none or a non-number); an undeclared key is left out, with one warning.
* any non-2xx answer is retried (5 attempts, 1 s apart) and then the sample gets no
  reward: a failed sample answers 503 by default, so it is never learnt as a 0.

Optional request keys of ours: ``data_source`` (one for all) or ``data_sources`` (one
per sample); without them the gateway's ``--data-source``.
"""

from __future__ import annotations

import logging
import math
import unicodedata
from typing import Any

from aiohttp import web

from stream_reward.errors import BadRequestError
from stream_reward.gateway.replies import SERVICE, json_reply, read_json
from stream_reward.gateway.service import Outcome, Sample

__all__ = ["add_routes", "parse_request", "reply_body", "failure_body"]

ROUTE = "/openrlhf"

log = logging.getLogger(__name__)

# A failed sample's reason, by what the operator does about it: a column each in every
# reply (the exact reason is in the 503 body, the gateway's log and /metrics). Reasons not
# listed (a composite's "<component>:<reason>" is classed by its reason) are "other".
FAILURE_CLASSES: dict[str, tuple[str, ...]] = {
    "timeout": ("timeout", "deadline"),
    "verifier": (
        "verifier_unavailable", "bad_reply", "unparseable_verdict", "no_verdict", "bad_json",
        "sandbox_unavailable", "sandbox_error", "host_resources", "checker_crashed",
    ),
    "scorer": ("scorer_error", "scorer_crashed", "scorer_load", "scorer_start", "no_score", "bad_score", "config"),
    "input": (
        "bad_input", "malformed", "too_large", "schema_version", "unknown_data_source", "bad_ground_truth",
        "bad_tests", "unresolved_name", "no_response_length", "max_deliveries", "never_pushed", "produce_failed",
    ),
}  # fmt: skip
_CLASS_OF = {reason: name for name, reasons in FAILURE_CLASSES.items() for reason in reasons}
FAILURE_COLUMNS = ("failed", *(f"failed_{name}" for name in FAILURE_CLASSES), "failed_other")
_warned: set[str] = set()
_MAX_WARNED = 64  # undeclared keys named in a warning each; then one line for the rest


def add_routes(app: web.Application) -> None:
    app.router.add_post(ROUTE, handle)


def _strings(body: dict[str, Any], key: str) -> list[str]:
    if key not in body:
        raise BadRequestError(f"missing field {key!r} (OpenRLHF sends query, prompts, labels)")
    value = body[key]
    if not isinstance(value, list):
        raise BadRequestError(f"field {key!r} must be a list, got {type(value).__name__}")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise BadRequestError(f"field {key!r}: item {i} must be a string, got {type(item).__name__}")
    return value


def parse_request(body: Any) -> list[Sample]:
    """The samples of one request; BadRequestError names the first fault."""
    if not isinstance(body, dict):
        raise BadRequestError(f"expected a JSON object, got {type(body).__name__}")
    queries = _strings(body, "query")
    prompts = _strings(body, "prompts")
    if "labels" not in body:
        raise BadRequestError("missing field 'labels' (OpenRLHF sends query, prompts, labels)")
    labels = body["labels"]
    if not isinstance(labels, list):
        raise BadRequestError(f"field 'labels' must be a list, got {type(labels).__name__}")
    if not len(queries) == len(prompts) == len(labels):
        raise BadRequestError(f"lengths differ: {len(queries)} query, {len(prompts)} prompts, {len(labels)} labels")
    sources = _sources(body, len(queries))
    samples = []
    for i, (query, prompt, label) in enumerate(zip(queries, prompts, labels)):
        response = query[len(prompt) :] if query.startswith(prompt) else response_after(query, prompt)
        if response is None:
            raise BadRequestError(
                f"sample {i}: query does not start with its prompt, even up to Unicode NFC and whitespace "
                "(a prompt OpenRLHF truncated to fit its max length is not a prefix of the query)"
            )
        samples.append(Sample(response=response, ground_truth=label, prompt=prompt, data_source=sources[i]))
    return samples


def response_after(query: str, prompt: str) -> str | None:
    """The response in ``query`` when its prompt is not a plain prefix, None if it is not
    there at all. OpenRLHF's query is ``tokenizer.decode(prompt tokens + response tokens)``
    and its prompt the raw text, so the query's copy of the prompt is the tokenizer's: in
    NFC/NFKC form for a tokenizer that normalizes, without the space before punctuation
    for one that cleans up tokenization spaces. Matched in NFC, ignoring whitespace; the
    response is then the NFC query's rest (after the prompt's own trailing whitespace)."""
    q, p = unicodedata.normalize("NFC", query), unicodedata.normalize("NFC", prompt)
    if q.startswith(p):
        return q[len(p) :]
    at = 0
    for char in p:
        if char.isspace():
            continue
        while at < len(q) and q[at].isspace():
            at += 1
        if at >= len(q) or q[at] != char:
            return None
        at += 1
    trailing = len(p) - len(p.rstrip())
    end = at
    while end < len(q) and end - at < trailing and q[end].isspace():
        end += 1
    return q[end:]


def _sources(body: dict[str, Any], n: int) -> list[str | None]:
    if body.get("data_sources") is not None:
        sources = _strings(body, "data_sources")
        if len(sources) != n:
            raise BadRequestError(f"lengths differ: {n} query, {len(sources)} data_sources")
        return list(sources)
    one = body.get("data_source")
    if one is not None and not isinstance(one, str):
        raise BadRequestError(f"field 'data_source' must be a string, got {type(one).__name__}")
    return [one] * n


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def failure_class(reason: str | None) -> str:
    """``failed_<class>``'s class of a failure reason (a composite's ``judge:timeout``: ``timeout``)."""
    code = (reason or "").rpartition(":")[2]
    return _CLASS_OF.get(code, "other")


def _extra_logs(outcome: Outcome, declared: tuple[str, ...]) -> dict[str, list[float]]:
    """The declared keys, one number per sample: the scored sample's value where it is a
    number, else 0.0 (OpenRLHF's tensors need a value in every row, in every reply)."""
    for key in outcome.extra_info:
        if key not in declared and key not in _warned:
            if len(_warned) >= _MAX_WARNED:
                # Keys from the data (one per sample) would be a warning each and a set
                # of every key ever seen, for the gateway's lifetime.
                if len(_warned) == _MAX_WARNED:
                    _warned.add("")  # "" is no key: the marker that this line was said
                    log.warning("more undeclared extra-info keys are left out of extra_logs, not named one by one")
                break
            _warned.add(key)
            log.warning("extra-info key %r is left out of OpenRLHF's extra_logs; declare it with --extra-logs", key)
    logs: dict[str, list[float]] = {}
    for key in declared:
        values = outcome.extra_info.get(key) or [None] * outcome.n
        logs[key] = [(_number(value) or 0.0) if state == "ok" else 0.0 for value, state in zip(values, outcome.status)]
    return logs


def reply_body(outcome: Outcome, declared: tuple[str, ...] = ()) -> dict[str, Any]:
    """The 200 reply: a failed sample (``--on-failure zero``) is 0.0, and ``extra_logs``
    has, in every reply, ``failed`` (1.0 for a failed sample: its mean is the rate) and
    ``failed_<class>`` (``FAILURE_CLASSES``), then the ``declared`` keys."""
    rewards = [float(score) if state == "ok" else 0.0 for score, state in zip(outcome.scores, outcome.status)]
    logs = {column: [0.0] * outcome.n for column in FAILURE_COLUMNS}
    for result in outcome.failed:
        logs["failed"][result.index] = 1.0
        logs[f"failed_{failure_class(result.reason)}"][result.index] = 1.0
    logs.update(_extra_logs(outcome, declared))
    return {"rewards": rewards, "scores": list(rewards), "extra_logs": logs}


def failure_body(outcome: Outcome) -> dict[str, Any]:
    return {
        "error": f"{len(outcome.failed)} of {outcome.n} samples failed (infrastructure, not a wrong answer); "
        "retry, or start the gateway with --on-failure zero",
        "failed": outcome.failed_rows(),
    }


async def handle(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    samples = parse_request(await read_json(request))
    outcome = await service.score(samples, route="openrlhf")
    if outcome.failed and service.config.on_failure == "error":
        return json_reply(failure_body(outcome), 503)
    return json_reply(reply_body(outcome, service.config.extra_logs))
