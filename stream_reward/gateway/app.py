"""The gateway's aiohttp application: route sets, the error answers, the metrics.

A route set is ``add_routes(app) -> None``; it finds what it needs under the app keys
below. ``ROUTE_SETS`` lists the built-in ones, and ``build_app(..., route_sets=...)`` is
the one place more are added. A handler raises and the middleware answers:

* ``BadRequestError`` -> its status (400, or 413 for a size), ``{"error": one line}``;
  nothing was enqueued for it;
* ``RequestTimeoutError`` -> 504 naming the timeout and how far the batch got;
* ``BrokerError`` (Redis unreachable, refused) -> 503;
* a body over the limit -> 413; anything else -> 500 with one line (and the traceback
  in the gateway's log, not in the reply).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web

from stream_reward.errors import BadRequestError, BrokerError, RequestTimeoutError
from stream_reward.gateway.health import add_routes as health_routes
from stream_reward.gateway.metrics import GatewayMetrics
from stream_reward.gateway.openrlhf import add_routes as openrlhf_routes
from stream_reward.gateway.replies import HEALTH, METRICS, SERVICE, HealthCheck, RouteSet, json_reply
from stream_reward.gateway.run_code import add_run_code_routes
from stream_reward.gateway.service import GatewayService
from stream_reward.gateway.slime import add_routes as slime_routes

__all__ = ["build_app", "ROUTE_SETS"]

log = logging.getLogger(__name__)

# The routes every gateway serves, one ``add_routes`` per front door. ``/run_code`` runs
# programs on this host's sandbox, not through the pipeline: SandboxFusion's clients wait
# on each program's stdout, one call per test case, and its answer is the run itself.
ROUTE_SETS: list[RouteSet] = [openrlhf_routes, slime_routes, health_routes, add_run_code_routes]


def _route_name(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical.strip("/") or "root" if resource is not None else "unknown"


@web.middleware
async def _answers(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Any:
    metrics = request.app[METRICS]
    route = _route_name(request)
    started = time.monotonic()
    metrics.in_flight.inc()
    code = 500
    try:
        try:
            reply = await handler(request)
        except BadRequestError as exc:  # refused whole: nothing was enqueued
            reply = json_reply({"error": str(exc)}, exc.status)
        except RequestTimeoutError as exc:
            timeout = request.app[SERVICE].config.timeout_s
            got = "Redis did not answer in time" if exc.stalled else f"{exc.done} of {exc.size} samples scored"
            reply = json_reply({"error": f"request timed out after {timeout:g}s (--timeout-s): {got}"}, 504)
        except BrokerError as exc:
            reply = json_reply({"error": f"Redis unavailable: {exc}"}, 503)
        except web.HTTPException as exc:
            reply = json_reply({"error": exc.text or exc.reason}, exc.status)
        except Exception as exc:  # a bug, or a reply json.dumps refused (a NaN score): ours, said in one line
            log.exception("%s: cannot answer", route)
            reply = json_reply({"error": f"cannot answer: {type(exc).__name__}: {exc}"}, 500)
        code = reply.status
        return reply
    finally:
        metrics.in_flight.dec()
        if route != "metrics":
            metrics.observe_request(route, code, time.monotonic() - started)


def build_app(
    service: GatewayService,
    health: HealthCheck,
    *,
    metrics: GatewayMetrics | None = None,
    route_sets: Sequence[RouteSet] | None = None,
) -> web.Application:
    """The gateway app. ``route_sets`` defaults to ``ROUTE_SETS``; pass more (or others)
    to serve extra routes from the same server."""
    app = web.Application(middlewares=[_answers], client_max_size=service.config.max_body_bytes)
    app[SERVICE] = service
    app[METRICS] = metrics or service.metrics
    app[HEALTH] = health
    for add_routes in ROUTE_SETS if route_sets is None else route_sets:
        add_routes(app)
    return app
