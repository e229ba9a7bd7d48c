"""The HTTP gateway (``stream-reward gateway``): OpenRLHF's and slime's reward-service
wire formats in front of the pipeline, with health and Prometheus metrics.

``service.py`` turns a request's samples into a batch and back; ``openrlhf.py`` and
``slime.py`` are the wire formats; ``health.py`` the probes; ``app.py`` the aiohttp app
and its error answers; ``serve.py`` runs it until stopped.
"""

from stream_reward.gateway.app import ROUTE_SETS, build_app
from stream_reward.gateway.service import GatewayConfig, GatewayService

__all__ = ["GatewayConfig", "GatewayService", "build_app", "ROUTE_SETS"]
