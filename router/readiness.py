"""gRPC health (`grpc.health.v1`) that follows the router's readiness, as HTTP /ready does.

The server as a whole ("") and the public service `tandem.v1.Tandem` are SERVING while a decode
worker of the model takes new requests (`Router.ready`) and NOT_SERVING otherwise, so gRPC
clients and Kubernetes gRPC probes see an empty decode pool. The admin service stays SERVING:
it is how an operator grows an empty pool. `follow()` reads readiness again every `period_s` on
the router's loop (the registry snapshot's refresh period) and writes the statuses when it
changes; Watch callers hear of each change.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from grpc_health.v1 import health, health_pb2

from router.core import Router

log = logging.getLogger(__name__)


class ReadinessHealth:
    def __init__(
        self,
        router: Router,
        servicer: health.aio.HealthServicer,
        services: Sequence[str],
        period_s: float,
    ) -> None:
        self.router = router
        self.servicer = servicer
        self.names = ("", *services)  # "": the server as a whole
        self.period_s = period_s
        self._ready: bool | None = None  # None: no status written yet

    async def update(self) -> bool:
        """Read readiness now and write the statuses if it changed; returns it."""
        ready = self.router.ready
        if ready != self._ready:
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if ready
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            for name in self.names:
                await self.servicer.set(name, status)
            if self._ready is not None:
                name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
                log.info("gRPC health: %s (decode workers serving: %s)", name, ready)
            self._ready = ready
        return ready

    async def follow(self) -> None:
        """Update every `period_s` until cancelled."""
        while True:
            await self.update()
            await asyncio.sleep(self.period_s)
