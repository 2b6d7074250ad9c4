"""`tandem serve` on Ray: join or start Ray, the registry, the controller actor with its pools,
and the router in this process.

Start: `ray.init(address)` (local Ray when None) -> registry (embedded Redis unless a URL) ->
controller (named actor; starts the pools) -> wait until both pools serve -> router.
Stop: router -> controller drains and removes every worker -> registry -> Ray (if we started it).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from router.router_server import RouterAddress, RouterServer
from tandem.cluster.autoscaler import AutoscalerConfig
from tandem.cluster.pools import ClusterSpec, PoolSpec, start_controller
from tandem.config import RouterConfig
from tandem.registry import Registry


@dataclass
class RayCluster:
    model: str
    num_prefill: int = 1
    num_decode: int = 1
    address: str | None = None  # an existing Ray cluster; None starts local Ray
    redis_url: str | None = None
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    engine: dict[str, Any] = field(default_factory=dict)
    decode_engine: dict[str, Any] = field(default_factory=dict)
    prefill_pool: PoolSpec = field(default_factory=PoolSpec)
    decode_pool: PoolSpec = field(default_factory=PoolSpec)
    router: RouterConfig | None = None
    autoscale: AutoscalerConfig | None = None
    dry_run: bool = False
    admin_token: str | None = None
    num_cpus: int | None = None  # logical CPUs of a local Ray (default: the machine's)
    heartbeat_ttl_s: float = 3.0
    placement_timeout_s: float = 300.0  # a worker not placed this long is dropped

    def __post_init__(self) -> None:
        self.registry: Registry | None = None
        self.controller: Any = None
        self.router_server: RouterServer | None = None
        self.router_address: RouterAddress | None = None

    def start(self, timeout_s: float = 300.0) -> RouterAddress:
        if not ray.is_initialized():
            ray.init(
                self.address,
                num_cpus=self.num_cpus if self.address is None else None,
                include_dashboard=False,
                logging_level=logging.WARNING,
            )
        self.registry = Registry(self.redis_url)
        spec = ClusterSpec(
            self.model,
            self.registry.url,
            self.engine,
            self.decode_engine,
            self.host,
            self.heartbeat_ttl_s,
            placement_timeout_s=self.placement_timeout_s,
            prefill=self.prefill_pool,
            decode=self.decode_pool,
        )
        self.controller = start_controller(
            spec, self.num_prefill, self.num_decode, self.autoscale, self.dry_run
        )
        self.wait_ready(timeout_s)
        self.router_server = RouterServer(
            self.router or RouterConfig(self.model),
            self.registry.url,
            self.host,
            self.http_port,
            self.grpc_port,
            self.admin_token,
            controller=self.controller,
        )
        self.router_address = self.router_server.start()
        return self.router_address

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Until every pool serves at its desired size (and the registry lists them)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ray.get(self.controller.ready.remote()):
                return
            time.sleep(0.2)
        raise TimeoutError(f"the pools did not reach their size within {timeout_s:.0f} s")

    def scale(self, prefill: int | None = None, decode: int | None = None) -> dict[str, int]:
        return dict(ray.get(self.controller.scale.remote(prefill, decode)))

    def stop(self) -> None:
        if self.router_server is not None:
            self.router_server.stop()
        if self.controller is not None:
            ray.get(self.controller.shutdown.remote())
            ray.kill(self.controller)
        if self.registry is not None:
            self.registry.close()
        if self.address is None:
            ray.shutdown()

    def __enter__(self) -> RayCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
