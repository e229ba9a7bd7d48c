"""Running the gateway: ``async with RunningGateway(config, health) as gw: gw.url``
(tests, benches), or ``serve_forever`` (the CLI), which prints the URL first and runs
until its task is cancelled (the CLI cancels it on SIGTERM / Ctrl-C)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from aiohttp import web

from stream_reward.gateway.app import build_app
from stream_reward.gateway.replies import HealthCheck, RouteSet
from stream_reward.gateway.service import GatewayConfig, GatewayService

__all__ = ["RunningGateway", "serve_forever"]

log = logging.getLogger(__name__)

# A stop waits this long for requests in flight to be answered, then cancels them.
SHUTDOWN_GRACE_S = 5.0


class RunningGateway:
    """The service and its HTTP server on ``host:port`` (0: a free port); ``url`` once entered."""

    def __init__(
        self,
        config: GatewayConfig,
        health: HealthCheck,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        route_sets: Sequence[RouteSet] | None = None,
    ) -> None:
        self.config = config
        self.health = health
        self.host, self.port = host, port
        self.route_sets = route_sets
        self.url = ""
        self.service: GatewayService | None = None
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> RunningGateway:
        self.service = GatewayService(self.config)
        await self.service.__aenter__()
        try:
            app = build_app(self.service, self.health, route_sets=self.route_sets)
            self._runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.host, self.port)
            await site.start()
        except BaseException:
            await self.__aexit__()
            raise
        host, port = self._runner.addresses[0][:2]
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{port}"
        log.info("gateway listening on %s (namespace %r)", self.url, self.config.namespace)
        return self

    async def __aexit__(self, *exc: object) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        service, self.service = self.service, None
        if service is not None:
            await service.aclose()


async def serve_forever(
    config: GatewayConfig,
    health: HealthCheck,
    *,
    host: str,
    port: int,
    ready: Callable[[str], None],
    route_sets: Sequence[RouteSet] | None = None,
) -> None:
    """Serve until cancelled; ``ready(url)`` once the server listens."""
    async with RunningGateway(config, health, host=host, port=port, route_sets=route_sets) as gateway:
        ready(gateway.url)
        await asyncio.Event().wait()
