"""The router's Prometheus metrics: requests by outcome, TTFT/TPOT/E2E histograms, in-flight and
queued requests, local prefills and prefill retries; also under vLLM's names (router.vllm_metrics).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from router.errors import RouterError
from router.vllm_metrics import VllmMetrics

if TYPE_CHECKING:
    from router.core import Router
    from router.relay import Delta

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RouterMetrics:
    def __init__(self, router: Router) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tandem_router_requests", "Finished requests by outcome", ["outcome"], registry=r
        )
        self.ttft = Histogram(
            "tandem_router_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "tandem_router_tpot_seconds",
            "Time per output token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tandem_router_e2e_seconds", "Request latency", buckets=LATENCY_BUCKETS, registry=r
        )
        inflight = Gauge("tandem_router_inflight", "Requests dispatched", registry=r)
        inflight.set_function(lambda: router.admission.inflight)
        queued = Gauge("tandem_router_queued", "Requests waiting for a slot", registry=r)
        queued.set_function(lambda: router.admission.queued)
        local = Gauge("tandem_router_local_prefills", "Prefills moved to D", registry=r)
        local.set_function(lambda: router.local_prefills)
        retries = Gauge("tandem_router_prefill_retries", "Prefills retried", registry=r)
        retries.set_function(lambda: router.prefill_retries)
        migrations = Gauge(
            "tandem_router_migrations",
            "Requests resumed on another decode worker after theirs died",
            registry=r,
        )
        migrations.set_function(lambda: router.migrations)
        self.vllm = VllmMetrics(
            r,
            router.model_name,
            running=lambda: router.admission.inflight,
            waiting=lambda: router.admission.queued,
        )

    async def observe(self, deltas: AsyncIterator[Delta]) -> AsyncGenerator[Delta, None]:
        """Pass the deltas through, recording the outcome and latencies of the request."""
        last_tokens: float | None = None  # when the last message with tokens came
        try:
            async for d in deltas:
                if d.token_ids:
                    now = time.monotonic()
                    if last_tokens is not None:
                        self.vllm.token_gap(now - last_tokens)
                    last_tokens = now
                if d.finish_reason is not None and d.timings:
                    self.requests.labels(d.finish_reason).inc()
                    self.ttft.observe(d.timings["ttft_s"])
                    self.e2e.observe(d.timings["e2e_s"])
                    if d.completion_tokens > 1:
                        self.tpot.observe(d.timings["tpot_s"])
                    self.vllm.finished(d, d.timings)
                yield d
        except RouterError as e:
            self.requests.labels(e.kind.name.lower()).inc()
            raise
