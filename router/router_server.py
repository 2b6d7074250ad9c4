"""Run the router: the gRPC API and the HTTP API in one asyncio loop, over a registry snapshot,
with the gRPC health following readiness on the same loop.

`RouterServer` runs that loop on a thread (the local launcher and tests use it);
`tandem router` blocks on it until interrupted. `stop()` closes both APIs to new requests at
once and lets the requests in flight on either finish, for up to STOP_GRACE_S.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from dataclasses import dataclass
from typing import Any

import redis
import uvicorn

from router.core import Router
from router.grpc_api import build_grpc_server
from router.http_api import build_app
from router.router_metrics import RouterMetrics
from tandem.config import RouterConfig
from tandem.registry import AbortListener, Registry, RegistrySnapshot

log = logging.getLogger(__name__)

# Once the router stops, the requests in flight on either API have this long to finish (then
# gRPC cancels its calls and the HTTP connections close). Until 7 December gRPC's calls had 1 s
# and only once the HTTP ones were done, and gRPC took new calls meanwhile: a stream admitted
# then ended CANCELLED (1 run in 8 of tests/chaos/test_chaos_ray_stop.py, Zen 4).
STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class RouterAddress:
    http_url: str  # e.g. http://127.0.0.1:8000
    grpc_target: str  # e.g. 127.0.0.1:50051


class RouterServer:
    def __init__(
        self,
        config: RouterConfig,
        registry_url: str,
        host: str = "127.0.0.1",
        http_port: int = 8000,
        grpc_port: int = 50051,
        admin_token: str | None = None,
        refresh_s: float = 0.25,
        controller: Any = None,
    ) -> None:
        self.config = config
        self.controller = controller  # Ray pool controller: enables the admin Scale/Drain
        self.registry = Registry(registry_url)
        self.snapshot = RegistrySnapshot(self.registry, refresh_s=refresh_s)
        self.host = host
        self.admin_token = admin_token
        self.refresh_s = refresh_s
        self._http_socket = socket.create_server((host, http_port), reuse_port=False)
        self._grpc_port = grpc_port
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="router", daemon=True)
        self.router: Router | None = None
        self.address: RouterAddress | None = None
        self._uvicorn: uvicorn.Server | None = None
        self._stopping: asyncio.Future[None] | None = None  # done once stop() is called
        self._abort_listener: AbortListener | None = None

    def start(self, timeout_s: float = 60.0) -> RouterAddress:
        self.snapshot.refresh()
        self.snapshot.start()
        self._thread.start()
        if not self._ready.wait(timeout_s) or self.address is None:
            raise RuntimeError(f"the router did not start: {self._error}")
        return self.address

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as e:  # report to start(); the thread ends
            self._error = e
            self._ready.set()

    async def _serve(self) -> None:
        router = self.router = Router(self.config, self.snapshot, self._forward_abort)
        self._abort_listener = self.registry.listen_for_aborts(
            self.config.model, lambda rid: self._loop.call_soon_threadsafe(router.abort, rid)
        )
        metrics = RouterMetrics(self.router)  # one set for both APIs
        grpc_server, grpc_port, readiness = await build_grpc_server(
            self.router,
            f"{self.host}:{self._grpc_port}",
            metrics,
            self.admin_token,
            self.controller,
            readiness_period_s=self.refresh_s,
        )
        await grpc_server.start()
        self._stopping = self._loop.create_future()
        following = asyncio.create_task(readiness.follow())
        app = build_app(self.router, metrics, self.admin_token, self.controller)
        config = uvicorn.Config(
            app, log_level="warning", lifespan="off", timeout_graceful_shutdown=int(STOP_GRACE_S)
        )
        self._uvicorn = uvicorn.Server(config)
        http_port = self._http_socket.getsockname()[1]
        self.address = RouterAddress(f"http://{self.host}:{http_port}", f"{self.host}:{grpc_port}")
        serving = asyncio.create_task(self._uvicorn.serve(sockets=[self._http_socket]))
        while not self._uvicorn.started and not serving.done():
            await asyncio.sleep(0.01)
        self._ready.set()
        await asyncio.wait([serving, self._stopping], return_when=asyncio.FIRST_COMPLETED)
        await asyncio.gather(serving, grpc_server.stop(STOP_GRACE_S))  # both drain at once
        following.cancel()
        await self.router.close()

    def _forward_abort(self, request_id: str) -> int:
        """Publish an abort to the other router replicas: how many listen (0: Redis is down)."""
        try:
            return self.registry.publish_abort(self.config.model, request_id)
        except redis.RedisError as e:
            log.warning("could not forward the abort of %s: %s", request_id, e)
            return 0

    def stop(self) -> None:
        """Refuse new requests on both APIs, let those in flight finish (up to STOP_GRACE_S),
        then close."""
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._stopping is not None:
            self._loop.call_soon_threadsafe(self._begin_stop)
        self._thread.join(STOP_GRACE_S + 5.0)
        if self._abort_listener is not None:
            self._abort_listener.close()
        self.snapshot.close()
        self.registry.close()

    def _begin_stop(self) -> None:
        if self._stopping is not None and not self._stopping.done():
            self._stopping.set_result(None)

    def wait(self) -> None:
        self._thread.join()
