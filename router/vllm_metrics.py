"""The router's metrics under vLLM's names and labels (`vllm:...`, label `model_name`), beside
Tandem's own, so dashboards built for a vLLM server read a Tandem router unchanged.

Names, types and bucket edges are vLLM's (v1 `PrometheusStatLogger`). The router sees the whole
request, so the request-level series are the client's view; the engine's own series (KV usage,
preemptions) are on the workers' /metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from router.relay import Delta

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
FINISHED_REASONS = ("stop", "length", "abort")


class VllmMetrics:
    """vLLM's request counters, latency histograms and queue gauges for one served model."""

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        running: Callable[[], float],
        waiting: Callable[[], float],
    ) -> None:
        r, label = registry, ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, label, buckets=buckets, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, label, registry=r).labels(model_name)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*label, "finished_reason"],
            registry=r,
        )
        self.success = {reason: success.labels(model_name, reason) for reason in FINISHED_REASONS}
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            TOKEN_LATENCY_BUCKETS,
        )
        # vLLM's older name for the same gaps (v0, and v1 before 0.11): dashboards still read it
        self.tpot = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.request_tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            label,
            registry=r,
        ).labels(model_name).set_function(running)
        Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            label,
            registry=r,
        ).labels(model_name).set_function(waiting)

    def token_gap(self, seconds: float) -> None:
        """The time between two messages of a request that carried tokens."""
        self.itl.observe(seconds)
        self.tpot.observe(seconds)

    def finished(self, d: Delta, timings: dict[str, Any]) -> None:
        """The request's last message (`timings` its own): its usage, finish reason and
        latencies."""
        self.prompt_tokens.inc(d.prompt_tokens)
        self.generation_tokens.inc(d.completion_tokens)
        if d.finish_reason in self.success:
            self.success[d.finish_reason].inc()
        self.e2e.observe(timings["e2e_s"])
        if d.completion_tokens:
            self.ttft.observe(timings["ttft_s"])
        if d.completion_tokens > 1:
            self.request_tpot.observe(timings["tpot_s"])
