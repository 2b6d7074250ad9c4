"""`tandem bench serve` without a cluster: SSE token counting, Prometheus deltas, the KV leak
check, load-point sweeps and the SLA search."""

from __future__ import annotations

import json

import pytest

from tandem.bench.serve import (
    ClusterScrape,
    HttpClient,
    WorkerScrape,
    leak_check,
    next_sla_rate,
    operating_point,
    parse_metrics,
    router_delta,
    worker_delta,
)
from tandem.bench.serve_config import ServeConfig, sweep_points
from tandem.bench.serve_report import pareto
from tandem.bench.serving_metrics import Timeline
from tandem.bench.workloads import LoadPoint, WorkloadError


def _sse(client: HttpClient, events: list[dict[str, object]]) -> tuple[Timeline, dict[str, object]]:
    timeline = Timeline(0.0)
    extra: dict[str, object] = {"finish_reason": None, "events": 0}
    for i, event in enumerate(events):
        assert not client._event(f"data: {json.dumps(event)}", 1.0 + i, timeline, extra)
    assert client._event("data: [DONE]", 9.0, timeline, extra)
    return timeline, extra


def _chat(text: str, finish: str | None = None) -> dict[str, object]:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}}


def test_http_events_count_one_token_each_and_usage_wins() -> None:
    client = HttpClient(ServeConfig())
    # An event with empty text (a held-back UTF-8 byte) still carries a token on Tandem.
    timeline, extra = _sse(
        client, [_chat("a"), _chat(""), _chat("bc"), _chat("d", "length"), USAGE]
    )
    assert timeline.chunks == [(1.0, 1), (2.0, 1), (3.0, 1), (4.0, 1)]
    assert (timeline.prompt_tokens, timeline.output_tokens, timeline.n_out) == (7, 5, 5)
    assert timeline.ttft == 1.0 and timeline.tpot == pytest.approx(3.0 / 4)
    assert extra == {"finish_reason": "length", "events": 4}


def test_http_text_mode_skips_empty_events() -> None:
    client = HttpClient(ServeConfig(http_chunk_tokens="text"))
    role_only = {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
    timeline, _ = _sse(client, [role_only, _chat("a"), _chat(""), _chat("b", "stop"), USAGE])
    assert [n for _, n in timeline.chunks] == [0, 1, 0, 1]
    assert timeline.ttft == 2.0


def test_http_completion_text_and_stream_errors() -> None:
    client = HttpClient(ServeConfig())
    completion = {"choices": [{"index": 0, "text": "x", "finish_reason": None}]}
    error = {"error": {"message": "no worker", "code": 503}}
    timeline, _ = _sse(client, [completion, error])
    assert timeline.chunks == [(1.0, 1)] and timeline.error == "503"


def test_request_bodies() -> None:
    from tandem.bench.workloads import BenchRequest

    client = HttpClient(ServeConfig(temperature=0.5))
    path, body = client.body(BenchRequest(3, 8, prompt_token_ids=(1, 2)))
    assert path == "/v1/completions" and body["prompt"] == [1, 2] and body["ignore_eos"]
    assert body["stream_options"] == {"include_usage": True} and body["seed"] == 3
    path, body = client.body(BenchRequest(0, 8, messages=(("user", "hi"),), ignore_eos=False))
    assert path == "/v1/chat/completions"
    assert body["messages"] == [{"role": "user", "content": "hi"}] and not body["ignore_eos"]


WORKER_BEFORE = """
tandem_spec_drafts_total{role="decode"} 10
tandem_spec_draft_tokens_total{role="decode"} 50
tandem_spec_accepted_tokens_total{role="decode"} 20
tandem_kv_transfers_total{role="decode"} 3
tandem_kv_transfer_bytes_total{role="decode"} 3e6
tandem_kv_transfer_seconds_total{role="decode"} 0.5
tandem_kv_blocks_total{role="decode"} 100
tandem_kv_blocks_free{role="decode"} 90
tandem_requests_running{role="decode"} 1
"""
WORKER_AFTER = """
tandem_spec_drafts_total{role="decode"} 30
tandem_spec_draft_tokens_total{role="decode"} 150
tandem_spec_accepted_tokens_total{role="decode"} 80
tandem_spec_drafted_per_position_total{position="0",role="decode"} 20
tandem_spec_drafted_per_position_total{position="1",role="decode"} 10
tandem_spec_accepted_per_position_total{position="0",role="decode"} 15
tandem_spec_accepted_per_position_total{position="1",role="decode"} 5
tandem_kv_transfers_total{role="decode"} 5
tandem_kv_transfer_bytes_total{role="decode"} 5e6
tandem_kv_transfer_seconds_total{role="decode"} 1.5
tandem_kv_transfer_failures_total{cause="timeout",role="decode"} 1
tandem_kv_blocks_total{role="decode"} 100
tandem_kv_blocks_free{role="decode"} 100
tandem_requests_running{role="decode"} 0
"""


def test_worker_deltas() -> None:
    d = worker_delta(parse_metrics(WORKER_BEFORE), parse_metrics(WORKER_AFTER))
    spec = d["spec"]
    assert (spec["drafts"], spec["draft_tokens"], spec["accepted_tokens"]) == (20, 100, 60)
    assert spec["acceptance_rate"] == pytest.approx(0.6)
    assert spec["mean_acceptance_length"] == pytest.approx(1 + 60 / 20)
    assert spec["per_position"] == [0.75, 0.5]
    t = d["transfer"]
    assert (t["count"], t["bytes"], t["seconds"]) == (2, 2e6, 1.0)
    assert t["gb_s"] == pytest.approx(0.002) and t["failures"] == {"timeout": 1}
    assert (d["kv_blocks_total"], d["kv_blocks_free"], d["requests_end"]) == (100, 100, 0)


def test_router_deltas() -> None:
    before = parse_metrics(
        'tandem_router_requests_total{outcome="length"} 4\n'
        "tandem_router_ttft_seconds_count 4\ntandem_router_ttft_seconds_sum 2\n"
        "tandem_router_local_prefills 1\n"
    )
    after = parse_metrics(
        'tandem_router_requests_total{outcome="length"} 10\n'
        'tandem_router_requests_total{outcome="unavailable"} 2\n'
        "tandem_router_ttft_seconds_count 10\ntandem_router_ttft_seconds_sum 3.2\n"
        "tandem_router_local_prefills 1\ntandem_router_inflight 0\n"
    )
    d = router_delta(before, after)
    assert d["requests"] == {"length": 6, "unavailable": 2}
    assert d["ttft_count"] == 6 and d["ttft_mean_s"] == pytest.approx(0.2)
    assert d["local_prefills"] == 0 and d["tpot_count"] is None


def test_leak_check() -> None:
    def scrape(free: str) -> ClusterScrape:
        text = (
            f'tandem_kv_blocks_total{{role="decode"}} 100\n'
            f'tandem_kv_blocks_free{{role="decode"}} {free}\n'
        )
        return ClusterScrape([], {"d0": WorkerScrape("d0", "decode", "u", parse_metrics(text))})

    assert leak_check(scrape("100"))["status"] == "OK"
    leak = leak_check(scrape("96"))
    assert leak["status"] == "LEAK" and leak["workers"]["d0"]["blocks_free"] == 96
    unreadable = ClusterScrape([], {"d0": WorkerScrape("d0", "decode", "u", None, "refused")})
    assert leak_check(unreadable)["status"] == "unknown"


def test_sweep_points() -> None:
    assert sweep_points(None, None) == (LoadPoint(concurrency=1),)
    assert [p.rate for p in sweep_points(None, 8, rates=[1, 2])] == [1, 2]
    assert all(p.concurrency == 8 for p in sweep_points(None, 8, rates=[1, 2]))
    assert [p.concurrency for p in sweep_points(None, None, concurrencies=[1, 4])] == [1, 4]
    with pytest.raises(WorkloadError):
        sweep_points(None, None, rates=[1], concurrencies=[1])
    assert sweep_points(None, None, trace=True) == (LoadPoint(trace=True),)
    assert sweep_points(None, 2, trace=True) == (LoadPoint(concurrency=2, trace=True),)
    assert sweep_points(5.0, None, trace=True) == (LoadPoint(rate=5.0),)


def test_sla_search_doubles_then_bisects() -> None:
    capacity = 11.0  # the SLO holds up to this rate
    history: list[tuple[float, bool]] = []
    while (rate := next_sla_rate(history, start=1.0, max_rate=1000.0, bisect_steps=3)) is not None:
        history.append((rate, rate <= capacity))
    assert [r for r, _ in history] == [1, 2, 4, 8, 16, 12, 10, 11]
    assert operating_point(history) == 11
    assert next_sla_rate([(1.0, True), (2.0, True)], 1.0, max_rate=3.0, bisect_steps=2) is None
    assert next_sla_rate([(1.0, False)], 1.0, 8.0, 1) == 0.5
    assert operating_point([(1.0, False), (0.5, False)]) is None


def test_pareto_front() -> None:
    assert pareto([(1.0, 10.0), (2.0, 30.0), (3.0, 20.0), (4.0, 40.0)]) == [
        (1.0, 10.0),
        (2.0, 30.0),
        (4.0, 40.0),
    ]
