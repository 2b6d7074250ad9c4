"""Serving metrics on hand-built request timelines with known answers (BENCHMARKS.md)."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.bench.serving_metrics import SLO, Stats, Timeline, measured, percentile, summarize


def test_single_token_chunks() -> None:
    # Sent at 10.0; chunks of one token at 10.5, 10.6, 10.8, 11.1.
    t = Timeline(10.0, [(10.5, 1), (10.6, 1), (10.8, 1), (11.1, 1)], prompt_tokens=20)
    assert t.ttft == pytest.approx(0.5)
    assert t.e2e == pytest.approx(1.1)
    assert t.tpot == pytest.approx(0.6 / 3)
    assert t.itl_chunk() == pytest.approx([0.1, 0.2, 0.3])
    assert t.itl_token() == pytest.approx([0.1, 0.2, 0.3])


def test_speculative_chunks_carry_several_tokens() -> None:
    # 1 token at 1.2, then 3 tokens at 1.5 (two drafts accepted + bonus), then 2 at 1.9.
    t = Timeline(1.0, [(1.2, 1), (1.5, 3), (1.9, 2)])
    assert t.n_out == 6
    assert t.ttft == pytest.approx(0.2)
    assert t.tpot == pytest.approx(0.7 / 5)  # per token, not per chunk
    assert t.itl_chunk() == pytest.approx([0.3, 0.4])
    assert t.itl_token() == pytest.approx([0.1, 0.2])


def test_empty_chunks_do_not_count_as_tokens() -> None:
    # A role-only first chunk (OpenAI chat streams) and a usage-only last one.
    t = Timeline(0.0, [(0.1, 0), (0.3, 1), (0.4, 1), (0.9, 0)])
    assert t.ttft == pytest.approx(0.3)
    assert t.e2e == pytest.approx(0.4)
    assert t.itl_chunk() == pytest.approx([0.1])


def test_server_usage_overrides_the_streamed_count() -> None:
    t = Timeline(0.0, [(0.2, 2), (0.4, 2)], output_tokens=5)
    assert t.n_out == 5
    assert t.tpot == pytest.approx(0.2 / 4)


def test_one_token_has_no_tpot() -> None:
    assert Timeline(0.0, [(0.2, 1)]).tpot is None


def test_percentiles_match_numpy_linear() -> None:
    values = [0.3, 0.1, 0.9, 0.4, 0.2, 0.7, 0.5]
    for q in (0, 50, 90, 95, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    s = Stats.of(values)
    assert s is not None
    assert (s.count, s.min, s.max) == (7, 0.1, 0.9)
    assert s.mean == pytest.approx(np.mean(values)) and s.std == pytest.approx(np.std(values))


def test_summary_throughput_goodput_and_errors() -> None:
    timelines = [
        Timeline(0.0, [(0.5, 1), (1.0, 1), (1.5, 1)], prompt_tokens=10),  # ttft .5, tpot .5
        Timeline(1.0, [(1.2, 1), (1.4, 2), (2.0, 1)], prompt_tokens=10),  # ttft .2, tpot 0.8/3
        Timeline(2.0, [(3.5, 1), (4.0, 1)], prompt_tokens=10),  # ttft 1.5: misses the TTFT SLO
        Timeline(3.0, [], error="UNAVAILABLE"),
    ]
    s = summarize(timelines, SLO(ttft_s=1.0, tpot_s=0.6))
    assert (s.num_requests, s.num_ok) == (4, 3)
    assert s.errors == {"UNAVAILABLE": 1}
    assert s.window_s == pytest.approx(4.0)  # first send 0.0 to last token 4.0
    assert s.request_throughput == pytest.approx(3 / 4)
    assert s.output_throughput == pytest.approx(9 / 4)
    assert s.total_throughput == pytest.approx(39 / 4)
    assert s.goodput == pytest.approx(2 / 4)
    assert s.ttft is not None and s.ttft.count == 3 and s.ttft.max == pytest.approx(1.5)
    assert s.tpot is not None and s.tpot.min == pytest.approx(0.8 / 3)
    assert s.itl_chunk is not None and s.itl_chunk.count == 5
    assert summarize(timelines).goodput is None


def test_measured_window_excludes_warm_up_and_cool_down() -> None:
    timelines = [Timeline(float(i), [(i + 0.5, 1)]) for i in range(10)]
    kept = measured(timelines, warmup_s=2.0, cooldown_s=2.0)
    assert [t.send_time for t in kept] == [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]


def test_client_queue_is_reported_apart_from_ttft() -> None:
    t = Timeline(5.0, [(5.5, 1), (6.0, 1)], queue_s=2.0)
    s = summarize([t])
    assert s.ttft is not None and s.ttft.mean == pytest.approx(0.5)
    assert s.client_queue is not None and s.client_queue.mean == pytest.approx(2.0)
