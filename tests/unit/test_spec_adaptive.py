"""Draft length adapts to acceptance and turns speculation off as the batch grows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine.engine_core import EngineCore
from tandem.engine.spec.adaptive import Acceptance, disable_batch_size, num_draft_tokens
from tandem.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def test_draft_length_follows_acceptance() -> None:
    assert num_draft_tokens(5, 1.0, 1, 32) == 5
    assert num_draft_tokens(5, 0.9, 1, 32) == 5  # 0.9**5 = 0.59
    assert num_draft_tokens(5, 0.6, 1, 32) == 2  # 0.6**2 = 0.36, 0.6**3 = 0.22
    assert num_draft_tokens(5, 0.1, 1, 32) == 1  # keep probing
    assert num_draft_tokens(5, 0.0, 1, 32) == 1


def test_draft_length_shrinks_with_the_batch_and_stops() -> None:
    ks = [num_draft_tokens(8, 1.0, b, 32) for b in (1, 8, 16, 24, 31, 32, 64)]
    assert ks == [8, 6, 4, 2, 1, 0, 0]


def test_acceptance_moving_average() -> None:
    a = Acceptance()
    assert a.rate == pytest.approx(0.6)
    for _ in range(20):
        a.observe(4, 0)
    assert a.rate < 0.01
    a = Acceptance(0.5, 1.0)
    a.observe(4, 4)  # four successes in four tries
    assert (a.accepted, a.tried) == (pytest.approx(1.55), pytest.approx(1.9))


def test_acceptance_counts_tries_up_to_the_first_rejection() -> None:
    """Drafts after a rejection were never tried: with each draft accepted at rate 0.6, the
    estimate is near 0.6 (a ratio of short moving averages reads a little low: 0.57 with this
    seed), not the 0.28 of accepted / drafted."""
    gen = torch.Generator().manual_seed(0)
    a = Acceptance()
    rates = []
    for _ in range(4000):
        accepted = 0
        while accepted < 5 and torch.rand((), generator=gen).item() < 0.6:
            accepted += 1
        a.observe(5, accepted)
        rates.append(a.rate)
    assert sum(rates[100:]) / len(rates[100:]) == pytest.approx(0.6, abs=0.05)


def test_no_drafts_at_or_above_the_disable_batch_size(tiny_llama_path: Path) -> None:
    engine = EngineCore(
        EngineConfig.create(
            str(tiny_llama_path),
            speculative={"method": "ngram", "num_speculative_tokens": 4, "disable_batch_size": 3},
            num_blocks=256,
            block_size=4,
        )
    )
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(f"r{i}", [5, 6, 7] * 6, params) for i in range(3)]
    while engine.has_unfinished():
        engine.step()
    assert all(r.metrics.num_draft_tokens == 0 for r in reqs)


def test_spec_stats_count_as_benchmarks_define_them() -> None:
    from tandem.engine.spec.acceptance import SpecStats

    stats = SpecStats()
    stats.observe(4, 2)  # drafts 0, 1 accepted; 2, 3 not
    stats.observe(2, 2)
    stats.observe(3, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 9, 4)
    assert stats.acceptance_rate == pytest.approx(4 / 9)
    assert stats.mean_acceptance_length == pytest.approx(1 + 4 / 3)
    assert stats.drafted_per_position == [3, 3, 2, 1]
    assert stats.per_position_rates == pytest.approx([2 / 3, 2 / 3, 0, 0])


def test_engine_spec_stats_match_request_metrics(tiny_llama_path: Path) -> None:
    engine = EngineCore(
        EngineConfig.create(
            str(tiny_llama_path),
            speculative={"method": "ngram", "num_speculative_tokens": 4},
            num_blocks=256,
            block_size=4,
        )
    )
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(f"r{i}", [5, 6, 7, 8] * (3 + i), params) for i in range(3)]
    while engine.has_unfinished():
        engine.step()
    stats = engine.scheduler.spec_stats
    assert stats.num_draft_tokens == sum(r.metrics.num_draft_tokens for r in reqs) > 0
    assert stats.num_accepted_tokens == sum(r.metrics.num_accepted_tokens for r in reqs)
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens


def test_disable_batch_size_defaults_by_device() -> None:
    """CPU stops drafting from 4 running requests (verification stops paying there on a
    compute-bound CPU), other devices from 32; a configured value wins."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert disable_batch_size(None, cpu) == 4
    assert disable_batch_size(None, cuda) == 32
    assert disable_batch_size(7, cpu) == 7 and disable_batch_size(7, cuda) == 7
    assert [num_draft_tokens(5, 1.0, b, disable_batch_size(None, cpu)) for b in (1, 2, 3, 4)] == [
        4,
        3,
        2,
        0,
    ]


def test_cpu_engine_stops_drafting_at_its_default(
    tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.undo()  # the shared fixture lets test engines draft in any batch; not here
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    drafted = []
    for batch in (1, 4):
        engine = EngineCore(
            EngineConfig.create(
                str(tiny_llama_path), speculative=spec, num_blocks=256, block_size=4
            )
        )
        reqs = [engine.add_request(f"r{i}", [5, 6, 7] * 6, params) for i in range(batch)]
        while engine.has_unfinished():
            engine.step()
        drafted.append(sum(r.metrics.num_draft_tokens for r in reqs))
    assert drafted[0] > 0 and drafted[1] == 0
