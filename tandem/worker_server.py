"""What both worker servers share: the gRPC server (with grpc.health.v1 and reflection), the
Prometheus `/metrics` endpoint, the Redis registration with a TTL heartbeat, and draining.

Lifecycle: start -> SERVING (registered, heartbeat every ttl/3) -> SIGTERM or `drain()`:
NOT_SERVING, `draining` published (routers stop sending) -> after a grace, new work refused ->
in-flight requests finish (up to the drain timeout) -> deregistered -> stopped.

A worker whose engine is no longer healthy (a tensor-parallel rank died: tandem/engine/tp/)
stops heartbeating at once, deregisters and reports itself `lost`: `serve_until` then stops it
without draining, and its process exits for its supervisor to replace the whole worker.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent import futures
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kv_transfer.transfer_metrics import TransferMetrics
from tandem.config import GRPC_OPTIONS, WorkerConfig
from tandem.drain_signal import DrainSignal
from tandem.engine.engine_core import EngineCore
from tandem.engine.request import Request, RequestStatus
from tandem.registry import Registry, WorkerRecord
from tandem.v1 import worker_pb2 as wpb

log = logging.getLogger(__name__)

PREFIX_SUMMARY_SIZE = 4096
LOST_POLL_S = 0.1  # how often `serve_until` looks whether the worker is lost
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Worker(Protocol):
    """The worker core a server wraps (PrefillWorker or DecodeWorker)."""

    engine: EngineCore
    draining: bool
    transfer_metrics: TransferMetrics
    on_finished: Callable[[Request], None] | None

    def num_in_flight(self) -> int: ...

    def close(self) -> None: ...


def worker_stats(role: str, model: str, worker: Worker) -> wpb.WorkerStats:
    sched, kv = worker.engine.scheduler, worker.engine.kv_cache
    return wpb.WorkerStats(
        role=role,
        model=model,
        running=len(sched.running) + len(sched.parked),
        waiting=len(sched.waiting),
        kv_blocks_total=kv.num_blocks,
        kv_blocks_free=kv.num_free_blocks,
        draining=worker.draining,
    )


def worker_metrics(role: str, model: str, worker: Worker) -> Callable[[], Iterable[Metric]]:
    """Scrape-time metrics of the worker: queue, batch, KV blocks and usage, prefix-cache hits,
    speculative decoding acceptance, KV transfer bytes/seconds/failures; and the engine's series
    under vLLM's names (`vllm_engine_metrics`)."""

    def gauge(name: str, doc: str, value: float) -> Metric:
        g = GaugeMetricFamily(name, doc, labels=["role"])
        g.add_metric([role], float(value))
        return g

    def counter(name: str, doc: str, value: float) -> Metric:
        c = CounterMetricFamily(name, doc, labels=["role"])
        c.add_metric([role], float(value))
        return c

    def collect() -> Iterable[Metric]:
        engine = worker.engine
        sched, kv = engine.scheduler, engine.kv_cache
        yield gauge("tandem_requests_waiting", "Requests queued in the engine", len(sched.waiting))
        yield gauge("tandem_requests_running", "Requests in the running batch", len(sched.running))
        yield gauge(
            "tandem_requests_parked", "Requests waiting for KV or hand-over", len(sched.parked)
        )
        yield gauge("tandem_kv_blocks_total", "KV cache blocks", kv.num_blocks)
        yield gauge("tandem_kv_blocks_free", "KV blocks free or evictable", kv.num_free_blocks)
        yield gauge("tandem_kv_usage", "Fraction of KV blocks referenced", kv.usage)
        yield counter(
            "tandem_prefix_cache_hit_tokens", "Prompt tokens found cached", kv.stats.prefix_hits
        )
        yield counter(
            "tandem_prefix_cache_query_tokens", "Prompt tokens looked up", kv.stats.prefix_queries
        )
        spec = sched.spec_stats
        yield counter("tandem_spec_drafts", "Verify steps that carried drafts", spec.num_drafts)
        yield counter("tandem_spec_draft_tokens", "Draft tokens verified", spec.num_draft_tokens)
        yield counter(
            "tandem_spec_accepted_tokens", "Draft tokens accepted", spec.num_accepted_tokens
        )
        yield gauge("tandem_spec_acceptance_rate", "Accepted / draft tokens", spec.acceptance_rate)
        drafted = CounterMetricFamily(
            "tandem_spec_drafted_per_position",
            "Drafts proposed at each position",
            labels=["role", "position"],
        )
        accepted = CounterMetricFamily(
            "tandem_spec_accepted_per_position",
            "Drafts accepted at each position",
            labels=["role", "position"],
        )
        for i, (d, a) in enumerate(
            zip(spec.drafted_per_position, spec.accepted_per_position, strict=True)
        ):
            drafted.add_metric([role, str(i)], d)
            accepted.add_metric([role, str(i)], a)
        yield drafted
        yield accepted
        transfers = worker.transfer_metrics
        yield counter("tandem_kv_transfers", "KV transfers completed", transfers.completed)
        yield counter("tandem_kv_transfer_bytes", "KV bytes transferred", transfers.nbytes)
        yield counter("tandem_kv_transfer_seconds", "Seconds spent transferring", transfers.seconds)
        failures = CounterMetricFamily(
            "tandem_kv_transfer_failures", "Failed KV transfers by cause", labels=["role", "cause"]
        )
        for cause, n in sorted(transfers.failures.items(), key=lambda kv: kv[0].value):
            failures.add_metric([role, cause.value], n)
        yield failures
        yield from vllm_engine_metrics(role, model, engine)

    return collect


def vllm_engine_metrics(role: str, model: str, engine: EngineCore) -> Iterable[Metric]:
    """The engine's queue, batch, KV usage, prefix-cache and preemption series under vLLM's names
    and labels (`model_name`, and `role`), so dashboards built for vLLM read the workers. A request
    parked for its remote KV waits, as in vLLM; one held for hand-over is done here."""
    sched, kv = engine.scheduler, engine.kv_cache
    parked_waiting = sum(
        1 for r in list(sched.parked.values()) if r.status == RequestStatus.WAITING_FOR_REMOTE_KV
    )
    gauge, counter = GaugeMetricFamily, CounterMetricFamily
    series: list[tuple[type[GaugeMetricFamily | CounterMetricFamily], str, str, float]] = [
        (gauge, "vllm:num_requests_running", "Number of requests in model execution batches.",
         len(sched.running)),
        (gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
         len(sched.waiting) + parked_waiting),
        (gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
         kv.usage),
        (counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
         sched.num_preemptions),
        (counter, "vllm:prefix_cache_queries", "Prefix cache queries, in queried tokens.",
         kv.stats.prefix_queries),
        (counter, "vllm:prefix_cache_hits", "Prefix cache hits, in cached tokens.",
         kv.stats.prefix_hits),
    ]  # fmt: skip
    for family, name, doc, value in series:
        m = family(name, doc, labels=["model_name", "role"])
        m.add_metric([model, role], float(value))
        yield m


class LatencyHistograms:
    """TTFT and TPOT of the requests this worker finished (TTFT from arrival at this worker)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.ttft = Histogram(
            "tandem_worker_ttft_seconds",
            "Time to first token here",
            buckets=BUCKETS,
            registry=registry,
        )
        self.tpot = Histogram(
            "tandem_worker_tpot_seconds",
            "Time per output token",
            buckets=BUCKETS,
            registry=registry,
        )

    def observe(self, request: Request) -> None:
        m = request.metrics
        if m.first_token_time is None:
            return
        self.ttft.observe(m.first_token_time - m.arrival_time)
        n = len(request.output_token_ids)
        if n > 1 and m.last_token_time is not None:
            self.tpot.observe((m.last_token_time - m.first_token_time) / (n - 1))


class _Collector:
    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self.collect = collect


class WorkerServer:
    def __init__(
        self,
        role: str,
        worker: Worker,
        model: str,
        add_servicer: Callable[[grpc.Server], None],
        service_names: list[str],
        host: str = "127.0.0.1",
        port: int = 0,
        metrics_port: int | None = 0,
        registry_url: str | None = None,
        kv_endpoint: str = "",
        ttl_s: float = 3.0,
        max_workers: int = 64,
    ) -> None:
        self.role = role
        self.worker = worker
        self.model = model
        self.worker_id = f"{role}-{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        self.ttl_s = ttl_s
        self.kv_endpoint = kv_endpoint
        self.metrics = CollectorRegistry()
        self.metrics.register(_Collector(worker_metrics(role, model, worker)))
        worker.on_finished = LatencyHistograms(self.metrics).observe
        self.service_names = service_names
        self.draining = False  # published; the worker refuses new work a grace period later
        self.started_at = time.time()
        self._stop = threading.Event()
        self.lost = threading.Event()  # the engine cannot run steps any more
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=role),
            options=GRPC_OPTIONS,
        )
        add_servicer(self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        self.endpoint = f"{host}:{self.port}"
        self.metrics_url = ""
        if metrics_port is not None:
            httpd, _ = start_http_server(metrics_port, host, registry=self.metrics)
            self._httpd = httpd
            self.metrics_url = f"http://{host}:{httpd.server_address[1]}/metrics"
        self.registry = Registry(registry_url) if registry_url else None
        self._heartbeat = threading.Thread(target=self._beat, name="heartbeat", daemon=True)

    def start(self) -> None:
        self.server.start()
        for name in ("", *self.service_names):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.registry is not None:
            self.registry.register(self.record(), self.ttl_s)
        self._heartbeat.start()

    def record(self) -> WorkerRecord:
        engine = self.worker.engine
        sched, kv = engine.scheduler, engine.kv_cache
        return WorkerRecord(
            worker_id=self.worker_id,
            role=self.role,
            model=self.model,
            endpoint=self.endpoint,
            kv_endpoint=self.kv_endpoint,
            metrics_url=self.metrics_url,
            kv_blocks_total=kv.num_blocks,
            kv_blocks_free=kv.num_free_blocks,
            running=len(sched.running) + len(sched.parked),
            waiting=len(sched.waiting),
            draining=self.draining,
            prefix_hashes=tuple(kv.cached_hash_summary(PREFIX_SUMMARY_SIZE)),
            started_at=self.started_at,
            heartbeat_at=time.time(),
            block_size=kv.block_size,
            heartbeat_s=self.ttl_s / 3,
        )

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):  # WorkerRecord.heartbeat_s
            if not self.worker.engine.executor.healthy:
                self._lose()
                return
            if self.registry is None:
                continue
            try:
                self.registry.heartbeat(self.record(), self.ttl_s)
            except Exception as e:  # Redis blip: keep serving, retry next beat
                log.warning("heartbeat failed: %s", e)

    def _lose(self) -> None:
        """The engine lost a rank: out of the registry now, and NOT_SERVING."""
        log.error("a tensor-parallel rank is gone: leaving the registry")
        self.lost.set()
        self.health.enter_graceful_shutdown()
        if self.registry is not None:
            try:
                self.registry.deregister(self.worker_id)
            except Exception as e:  # the TTL takes it out anyway
                log.warning("could not deregister: %s", e)

    def drain(self, timeout_s: float = 30.0, grace_s: float = 1.0) -> None:
        """Publish `draining` (routers stop picking this worker), keep accepting for `grace_s`
        while their snapshots catch up, then refuse new work, let in-flight requests finish
        (up to `timeout_s`), deregister and stop."""
        self.draining = True
        self.health.enter_graceful_shutdown()
        if self.registry is not None:
            try:
                self.registry.heartbeat(self.record(), self.ttl_s)
            except Exception as e:
                log.warning("could not publish draining: %s", e)
        time.sleep(grace_s)
        self.worker.draining = True
        deadline = time.monotonic() + timeout_s
        while self.worker.num_in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self.registry is not None:
            try:
                self.registry.deregister(self.worker_id)
            except Exception as e:
                log.warning("could not deregister: %s", e)
        self.server.stop(1.0).wait()
        self.worker.close()
        if hasattr(self, "_httpd"):
            self._httpd.shutdown()

    def serve_until(self, stop: DrainSignal) -> bool:
        """Block until `stop` came (see `drain_signal`), then drain: True. Or until the worker
        is `lost`, then stop it: False."""
        while not stop.wait(LOST_POLL_S):
            if self.lost.is_set():
                self.stop()
                return False
        log.info("draining")
        self.drain()
        return True


def start_worker_server(
    role: str,
    worker: Any,
    add_servicer: Callable[[grpc.Server], None],
    service_name: str,
    config: WorkerConfig,
    kv_endpoint: str = "",
) -> WorkerServer:
    """Start the worker's engine loop, then its server (which registers it)."""
    server = WorkerServer(
        role,
        worker,
        config.engine.model.model,
        add_servicer,
        [service_name],
        config.host,
        config.port,
        config.metrics_port,
        config.registry_url,
        kv_endpoint=kv_endpoint,
        ttl_s=config.heartbeat_ttl_s,
    )
    worker.start()
    server.start()
    return server
