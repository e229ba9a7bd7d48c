"""What the gateway's route sets share: the app keys they find the service under, the
JSON body reader (refusals as BadRequestError) and the JSON reply."""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from stream_reward.errors import BadRequestError
from stream_reward.gateway.metrics import GatewayMetrics
from stream_reward.gateway.service import GatewayService

__all__ = ["RouteSet", "HealthCheck", "SERVICE", "METRICS", "HEALTH", "read_json", "json_reply", "finite"]

# A route set: ``add_routes(app)`` adds its routes; it finds what it needs under the keys below.
RouteSet = Callable[[web.Application], None]
# (healthy, one-line reason): a round trip to Redis each time, never a cached flag.
HealthCheck = Callable[[], Awaitable[tuple[bool, str]]]

SERVICE = web.AppKey("service", GatewayService)
METRICS = web.AppKey("metrics", GatewayMetrics)
HEALTH: web.AppKey[HealthCheck] = web.AppKey("health")


def json_reply(body: Any, status: int = 200) -> web.Response:
    # allow_nan=False: NaN is not JSON to most clients; a scorer that produced one is
    # a fault the app answers with 500, naming it, rather than a reply they cannot read.
    return web.Response(text=json.dumps(body, allow_nan=False), status=status, content_type="application/json")


async def read_json(request: web.Request) -> Any:
    """The request's JSON body, or BadRequestError (413 over the size limit)."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        limit = request.app[SERVICE].config.max_body_bytes
        raise BadRequestError(
            f"request body over the gateway's limit of {limit} bytes (--max-body-mb)", status=413
        ) from exc
    try:
        return json.loads(raw)
    except RecursionError:  # the parser recurses per level: a body nested past it is the client's
        raise BadRequestError("malformed JSON: nested too deeply for the parser") from None
    except ValueError as exc:  # bad syntax, bad UTF-8, an integer past Python's 4300 digits
        raise BadRequestError(f"malformed JSON: {exc}") from None


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinity in it as None: a scorer's extra info may hold
    them, and a reply that carries a scored sample must still be JSON its client reads."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value
