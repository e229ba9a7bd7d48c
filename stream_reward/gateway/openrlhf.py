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
  numbers, one per sample. Non-numeric extra info (a reason string) is left out.
* any non-2xx answer is retried (5 attempts, 1 s apart) and then the sample gets no
  reward: a failed sample answers 503 by default, so it is never learnt as a 0.

Optional request keys of ours: ``data_source`` (one for all) or ``data_sources`` (one
per sample); without them the gateway's ``--data-source``.
"""

from __future__ import annotations

import math
from typing import Any

from aiohttp import web

from stream_reward.errors import BadRequestError
from stream_reward.gateway.replies import SERVICE, json_reply, read_json
from stream_reward.gateway.service import Outcome, Sample

__all__ = ["add_routes", "parse_request", "reply_body", "failure_body"]

ROUTE = "/openrlhf"


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
        if not query.startswith(prompt):
            raise BadRequestError(f"sample {i}: query does not start with its prompt")
        samples.append(Sample(response=query[len(prompt) :], ground_truth=label, prompt=prompt, data_source=sources[i]))
    return samples


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


def _extra_logs(outcome: Outcome) -> dict[str, list[float]]:
    """Every numeric extra-info key of the scored samples, as one number per sample
    (0.0 where a sample lacks it: OpenRLHF's tensors need a value in every row). A key
    with any other value in a scored sample (a string, a list) is left out."""
    ok = [at for at, state in enumerate(outcome.status) if state == "ok"]
    logs: dict[str, list[float]] = {}
    for key, values in outcome.extra_info.items():
        present = [values[at] for at in ok if values[at] is not None]
        numbers = [_number(v) for v in present]
        if not present or any(v is None for v in numbers):
            continue
        row = [0.0] * outcome.n
        for at in ok:
            row[at] = _number(values[at]) or 0.0
        logs[key] = row
    return logs


def reply_body(outcome: Outcome, *, count_failed: bool = False) -> dict[str, Any]:
    """The 200 reply. With ``count_failed`` (``--on-failure zero``) failed samples are 0.0,
    and ``extra_logs`` always has ``failed`` (1.0 for a failed sample: its sum is the
    count, its mean the rate), plus ``failed_<reason>`` for each reason in this request."""
    rewards = [float(score) if state == "ok" else 0.0 for score, state in zip(outcome.scores, outcome.status)]
    logs = _extra_logs(outcome)
    if count_failed or outcome.failed:
        logs["failed"] = [0.0 if state == "ok" else 1.0 for state in outcome.status]
        for result in outcome.failed:
            column = logs.setdefault(f"failed_{result.reason or 'unknown'}", [0.0] * outcome.n)
            column[result.index] = 1.0
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
    return json_reply(reply_body(outcome, count_failed=service.config.on_failure == "zero"))
