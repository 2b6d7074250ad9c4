"""A worker's /metrics under vLLM's names, on a tiny random Llama with a cache too small for its
requests: `vllm:num_preemptions_total` counts every preemption of the scheduler, KV usage and the
queue gauges read the engine, all labelled with the model and the role; Tandem's own series stay.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from test_scheduler import drain, make_engine, prompts_of

from kv_transfer.transfer_metrics import TransferMetrics
from tandem.engine.engine_core import EngineCore
from tandem.engine.request import Request
from tandem.sampling_params import SamplingParams
from tandem.worker_server import _Collector, worker_metrics

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny-llama"


class EngineOnly:
    """The worker a server wraps, reduced to its engine."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.draining = False
        self.transfer_metrics = TransferMetrics()
        self.on_finished: Callable[[Request], None] | None = None

    def num_in_flight(self) -> int:
        return 0

    def close(self) -> None:
        pass


def scrape(engine: EngineCore) -> dict[str, float | None]:
    registry = CollectorRegistry()
    registry.register(_Collector(worker_metrics("decode", MODEL, EngineOnly(engine))))
    labels = {"model_name": MODEL, "role": "decode"}
    names = (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    )
    values = {name: registry.get_sample_value(name, labels) for name in names}
    values["tandem_kv_usage"] = registry.get_sample_value("tandem_kv_usage", {"role": "decode"})
    return values


def test_preemptions_and_queue_under_vllm_names(tiny_llama_path: Path) -> None:
    # Each request grows to 34 tokens = 9 blocks; four of them cannot share 16 blocks.
    engine = make_engine(tiny_llama_path, num_blocks=16)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    reqs: list[Request] = [
        engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts_of([10, 9, 12, 7]))
    ]
    before = scrape(engine)
    assert before["vllm:num_requests_waiting"] == 4 and before["vllm:num_requests_running"] == 0
    assert before["vllm:num_preemptions_total"] == 0
    engine.step()
    during = scrape(engine)
    assert during["vllm:num_requests_running"] == len(engine.scheduler.running) > 0
    assert during["vllm:kv_cache_usage_perc"] == during["tandem_kv_usage"] == engine.kv_cache.usage
    assert during["vllm:kv_cache_usage_perc"] > 0
    drain(engine)
    preemptions = sum(r.metrics.num_preemptions for r in reqs)
    assert preemptions > 0
    after = scrape(engine)
    assert after["vllm:num_preemptions_total"] == engine.scheduler.num_preemptions == preemptions
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    assert after["vllm:prefix_cache_queries_total"] == engine.kv_cache.stats.prefix_queries > 0
    assert after["vllm:prefix_cache_hits_total"] == engine.kv_cache.stats.prefix_hits
