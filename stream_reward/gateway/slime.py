"""``POST /slime``: slime's ``--rm-type remote_rm --rm-url`` wire format.

What slime 0.3 sends and reads (``slime/rollout/rm_hub/__init__.py``, ``remote_rm``):
one sample per request, ``{"prompt", "response", "label"}``, where ``prompt`` is a
string or a chat (a list of ``{"role", "content"}`` messages) and ``label`` a string
or null. The JSON reply becomes ``sample.reward`` as it is; with ``--reward-key
score`` slime takes ``reward["score"]`` (``Sample.get_reward_value``,
``slime/utils/types.py``). Any non-2xx answer is retried (10 attempts, backoff up to
30 s), then raised: a failed sample answers 503 by default, never a 0.

The reply is ``{"score": float, "status": "ok", ...reward_extra_info}``; with
``?reply=float`` it is the bare score, for a slime run without ``--reward-key``.
Optional keys honoured: ``data_source`` (else ``metadata["data_source"]``, else the
gateway's ``--data-source``), ``extra_info`` (the scorer's ``extra_info``) and
``metadata`` (passed on as ``extra_info["metadata"]``).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from stream_reward.errors import BadRequestError
from stream_reward.gateway.replies import SERVICE, finite, json_reply, read_json
from stream_reward.gateway.service import Outcome, Sample

__all__ = ["add_routes", "parse_request", "reply_body"]

ROUTE = "/slime"


def add_routes(app: web.Application) -> None:
    app.router.add_post(ROUTE, handle)


def _prompt_text(prompt: Any) -> str | None:
    """A chat prompt as text: its messages' contents, in order, one per paragraph."""
    if prompt is None or isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        parts = []
        for i, message in enumerate(prompt):
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, str):
                raise BadRequestError(f"field 'prompt': message {i} must be an object with a string 'content'")
            parts.append(content)
        return "\n\n".join(parts)
    raise BadRequestError(f"field 'prompt' must be a string or a list of messages, got {type(prompt).__name__}")


def _optional_dict(body: dict[str, Any], key: str) -> dict[str, Any]:
    value = body.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequestError(f"field {key!r} must be an object, got {type(value).__name__}")
    return value


def parse_request(body: Any) -> Sample:
    if not isinstance(body, dict):
        raise BadRequestError(f"expected a JSON object (one sample), got {type(body).__name__}")
    if "response" not in body:
        raise BadRequestError("missing field 'response' (slime sends prompt, response, label)")
    response = body["response"]
    if not isinstance(response, str):
        raise BadRequestError(f"field 'response' must be a string, got {type(response).__name__}")
    metadata = _optional_dict(body, "metadata")
    extra_info = dict(_optional_dict(body, "extra_info"))
    if metadata:
        extra_info.setdefault("metadata", metadata)
    source = body.get("data_source")
    if source is None:
        source = metadata.get("data_source")
    if source is not None and not isinstance(source, str):
        raise BadRequestError(f"field 'data_source' must be a string, got {type(source).__name__}")
    return Sample(
        response=response,
        ground_truth=body.get("label"),
        prompt=_prompt_text(body.get("prompt")),
        data_source=source,
        extra_info=extra_info,
    )


def reply_body(outcome: Outcome) -> dict[str, Any]:
    """The 200 reply of the one sample; a failed one (``--on-failure zero``) says so.
    Extra info that is not finite (NaN, inf) is null: the score still reaches slime."""
    body: dict[str, Any] = finite(outcome.extra_of(0))
    if not outcome.failed:
        body.update(score=float(outcome.scores[0]), status="ok")
    else:
        result = outcome.failed[0]
        body.update(score=0.0, status="failed", reason=result.reason, error=result.error, failed=1)
    return body


async def handle(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    reply = request.query.get("reply", "dict")
    if reply not in ("dict", "float"):
        raise BadRequestError(f"query parameter reply must be 'dict' or 'float', got {reply!r}")
    sample = parse_request(await read_json(request))
    outcome = await service.score([sample], route="slime")
    if outcome.failed and service.config.on_failure == "error":
        failed = outcome.failed_rows()
        return json_reply(
            {
                "error": f"the sample failed ({failed[0]['reason']}: infrastructure, not a wrong answer); "
                "retry, or start the gateway with --on-failure zero",
                "failed": failed,
            },
            503,
        )
    body = reply_body(outcome)
    return json_reply(body["score"] if reply == "float" else body)
