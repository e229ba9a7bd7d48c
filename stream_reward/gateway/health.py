"""``GET /healthz`` and ``GET /metrics``.

``/healthz`` is what ``stream-reward worker --check`` answers (``ops/health.py``): 200
while a worker of the namespace (and group, when one is configured) heartbeat within
three intervals; 503 when none did or Redis cannot be read. A round trip each time,
bounded, never a cached flag. The body is JSON: ``{"ok", "reason"}``.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from stream_reward.gateway.metrics import CONTENT_TYPE_LATEST
from stream_reward.gateway.replies import HEALTH, METRICS, json_reply

__all__ = ["add_routes"]

# Under a prober's usual timeout; the check's own Redis calls have a 5 s socket timeout.
_CHECK_TIMEOUT_S = 8.0


def add_routes(app: web.Application) -> None:
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)


async def healthz(request: web.Request) -> web.Response:
    try:
        healthy, reason = await asyncio.wait_for(request.app[HEALTH](), _CHECK_TIMEOUT_S)
    except asyncio.TimeoutError:
        healthy, reason = False, f"unhealthy: the health check did not answer within {_CHECK_TIMEOUT_S:g}s"
    return json_reply({"ok": healthy, "reason": reason}, 200 if healthy else 503)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS].exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
