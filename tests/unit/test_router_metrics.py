"""The router's metrics under vLLM's names, against the scripted worker doubles of
test_router_inflight: after a served request the `vllm:` token counters equal its usage, the
success counter has its finish reason, the latency histograms one observation each (the
inter-token ones one per gap between chunks), all labelled with the served model; an aborted
request counts as `abort`; the queue gauges read the router's admission; Tandem's own series
are still there.
"""

from __future__ import annotations

from pathlib import Path

from test_router_inflight import CHUNKS, LONG, Cluster, abort_during_prefill, run

from router.relay import Delta
from router.router_metrics import RouterMetrics
from tandem.sampling_params import SamplingParams


async def observed(metrics: RouterMetrics, c: Cluster, ids: list[int]) -> list[Delta]:
    prep = await c.router.prepare(SamplingParams(max_tokens=8), prompt_token_ids=ids)
    return [d async for d in metrics.observe(c.router.generate(prep))]


def test_served_request_under_vllm_names(tiny_llama_path: Path) -> None:
    async def scenario(c: Cluster) -> None:
        metrics = RouterMetrics(c.router)
        model = {"model_name": c.router.model_name}

        def value(name: str, **labels: str) -> float | None:
            return metrics.registry.get_sample_value(name, {**model, **labels})

        last = (await observed(metrics, c, LONG))[-1]
        assert (last.prompt_tokens, last.completion_tokens) == (len(LONG), CHUNKS)
        assert value("vllm:prompt_tokens_total") == len(LONG)
        assert value("vllm:generation_tokens_total") == CHUNKS
        assert value("vllm:request_success_total", finished_reason="length") == 1
        assert value("vllm:request_success_total", finished_reason="stop") == 0
        for name in (
            "vllm:time_to_first_token_seconds",
            "vllm:e2e_request_latency_seconds",
            "vllm:request_time_per_output_token_seconds",
        ):
            assert value(f"{name}_count") == 1, name
        for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
            assert value(f"{name}_count") == CHUNKS - 1, name
        assert value("vllm:time_to_first_token_seconds_bucket", le="2560.0") == 1
        assert value("vllm:num_requests_running") == c.router.admission.inflight
        assert value("vllm:num_requests_waiting") == 0
        assert (
            metrics.registry.get_sample_value("tandem_router_requests_total", {"outcome": "length"})
            == 1
        )

    run(tiny_llama_path, {"p1": "push", "d1": "serve"}, scenario)


def test_aborted_request_counts_as_abort(tiny_llama_path: Path) -> None:
    async def scenario(c: Cluster) -> None:
        metrics = RouterMetrics(c.router)
        prep = await c.router.prepare(SamplingParams(max_tokens=8), prompt_token_ids=LONG)
        await abort_during_prefill(c, metrics.observe(c.router.generate(prep)), prep.request_id)
        labels = {"model_name": c.router.model_name, "finished_reason": "abort"}
        assert metrics.registry.get_sample_value("vllm:request_success_total", labels) == 1
        # no token came: no TTFT, but the request's latency and its prompt
        model = {"model_name": c.router.model_name}
        sample = metrics.registry.get_sample_value
        assert sample("vllm:time_to_first_token_seconds_count", model) == 0
        assert sample("vllm:e2e_request_latency_seconds_count", model) == 1
        assert sample("vllm:prompt_tokens_total", model) == len(LONG)

    run(tiny_llama_path, {"p1": "hang", "d1": "serve"}, scenario)
