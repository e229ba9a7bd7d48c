"""Which server of a multi-URL scorer gets the next request.

A scorer spec may name several base URLs (``genrm:URL1,URL2``). Each one is an
``Endpoint`` with its own counters and ``CircuitBreaker``; the ``Router`` sends a
request to the endpoint with the fewest requests in flight among those whose
breaker lets it through. A server failing ``failures`` times in a row is skipped
for a cool-down, then probed with a single request. The router knows nothing of
HTTP: the transport (``http_transport``) reports each outcome to the endpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from stream_reward.errors import ConfigError
from stream_reward.wire.connection import mask_url

__all__ = ["CircuitBreaker", "Endpoint", "Router"]

log = logging.getLogger(__name__)


class CircuitBreaker:
    """Closed -> open after ``failures`` infrastructure faults in a row; after
    ``cooldown_s`` one probe request is let through (half-open): success closes
    the breaker, failure re-opens it with twice the cool-down (up to ``max_cooldown_s``)."""

    def __init__(
        self,
        failures: int = 3,
        cooldown_s: float = 5.0,
        max_cooldown_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threshold = failures
        self.base_cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.state = "closed"
        self.consecutive = 0
        self.open_until = 0.0
        self.trips = 0

    def available(self) -> bool:
        if self.state == "closed":
            return True
        return self.state == "open" and self.clock() >= self.open_until

    def on_pick(self) -> None:
        if self.state == "open":
            self.state = "half_open"  # this request is the probe; others keep away

    def success(self) -> None:
        if self.state != "closed":
            log.info("circuit closed again after a successful probe")
        self.state = "closed"
        self.consecutive = 0
        self.cooldown_s = self.base_cooldown_s

    def failure(self) -> None:
        self.consecutive += 1
        if self.state == "half_open":
            self.cooldown_s = min(self.cooldown_s * 2, self.max_cooldown_s)
            self._open()
        elif self.state == "closed" and self.consecutive >= self.threshold:
            self._open()

    def abandon(self) -> None:
        """The probe ended without a verdict (cancelled): let another one through."""
        if self.state == "half_open":
            self.state = "open"

    def _open(self) -> None:
        self.state = "open"
        self.open_until = self.clock() + self.cooldown_s
        self.trips += 1


class Endpoint:
    """One server: its URL, the label logs may show (credentials masked), its breaker
    and the counters ``HttpScorer.endpoints()`` reports."""

    def __init__(self, url: str, breaker: CircuitBreaker) -> None:
        self.url = url
        self.label = mask_url(url)
        self.breaker = breaker
        self.in_flight = 0
        self.requests = 0
        self.failures = 0

    def failed(self) -> None:
        """An infrastructure fault (connect, reset, timeout, 5xx): counts against its health."""
        self.failures += 1
        self.breaker.failure()


class Router:
    """Fewest requests in flight among the servers whose breaker lets them through;
    when no breaker does, the server due back soonest (fail open)."""

    def __init__(self, endpoints: list[Endpoint]) -> None:
        if not endpoints:
            raise ConfigError("scorer", "no base URL")
        self.endpoints = endpoints
        self._next = 0

    def pick(self) -> Endpoint:
        n = len(self.endpoints)
        best: Endpoint | None = None
        # Start the scan at a rotating offset: ties go round-robin, not always to the first.
        for i in range(n):
            ep = self.endpoints[(self._next + i) % n]
            if ep.breaker.available() and (best is None or ep.in_flight < best.in_flight):
                best = ep
        self._next = (self._next + 1) % n
        if best is None:
            # Every server is failing. Refusing to send would only burn the retry
            # budget without a real attempt (and with one server, the breaker
            # would be all harm): send to the one due back soonest; the retry
            # backoff, not the breaker, paces these attempts.
            return min(self.endpoints, key=lambda ep: (ep.breaker.open_until, ep.in_flight))
        best.breaker.on_pick()
        return best
