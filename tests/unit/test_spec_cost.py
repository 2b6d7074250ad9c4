"""The cost model drafts only as much as the measured step and proposer times pay for."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.config import EngineConfig
from tandem.engine.engine_core import EngineCore
from tandem.engine.spec import draft_length
from tandem.engine.spec.cost import (
    PROBE_PERIOD,
    DraftLengthControl,
    StepCosts,
    best_draft_length,
    expected_tokens,
)
from tandem.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def costs_of(step_s: dict[int, float], propose_s_per_draft: float) -> StepCosts:
    costs = StepCosts()
    for positions, seconds in step_s.items():
        costs.observe_step(positions, seconds)
    costs.observe_propose(1, propose_s_per_draft)
    return costs


def test_step_seconds_interpolate_and_extrapolate() -> None:
    costs = costs_of({2: 0.010, 6: 0.018}, 0.0)
    assert costs.step_seconds(2) == 0.010
    assert costs.step_seconds(4) == pytest.approx(0.014)
    assert costs.step_seconds(10) == pytest.approx(0.026)  # past the last size: its slope
    assert costs.step_seconds(1) == pytest.approx(0.008)
    assert StepCosts().step_seconds(1) is None
    assert costs_of({2: 0.01}, 0.0).step_seconds(3) is None  # one size: no slope


def test_moving_averages() -> None:
    costs = StepCosts()
    costs.observe_step(3, 1.0)
    costs.observe_step(3, 2.0)
    assert costs.step_seconds(3) == pytest.approx(1.2)
    costs.observe_propose(4, 0.4)  # 0.1 per drafted position
    costs.observe_propose(0, 5.0)  # nothing drafted: not a sample
    assert costs.propose_s_per_draft == pytest.approx(0.1)


def test_expected_tokens() -> None:
    assert expected_tokens(0.5, 0) == 1
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)
    assert expected_tokens(1.0, 4) == 5
    assert expected_tokens(-0.1, 4) == 1


def test_drafts_when_verification_is_cheap() -> None:
    """Memory-bound decode (a GPU): extra positions cost little, so drafts pay as far as the
    acceptance carries them; a costly proposer shortens them."""
    flat = {1: 0.020, 6: 0.021}
    assert best_draft_length(costs_of(flat, 0.0), [0.8], [5], 1) == 5
    assert best_draft_length(costs_of(flat, 0.004), [0.6], [5], 1) == 2
    assert best_draft_length(costs_of(flat, 0.0), [0.8], [3], 1) == 3  # the limit caps it


def test_no_drafts_when_every_position_costs_a_step() -> None:
    """Compute-bound decode (a small model on a CPU): k + 1 positions cost k + 1 steps, and no
    acceptance below 1 makes up for that."""
    linear = {1: 0.010, 6: 0.060}
    assert best_draft_length(costs_of(linear, 0.0), [0.9], [5], 1) == 0
    # Four requests, two of which do not speculate: their positions count, their tokens too.
    assert best_draft_length(costs_of({4: 0.02, 8: 0.021}, 0.0), [0.9, 0.9], [2, 2], 4) == 2
    assert best_draft_length(costs_of({4: 0.02, 8: 0.04}, 0.0), [0.9, 0.9], [2, 2], 4) == 0


def test_control_measures_what_it_lacks_then_chooses_and_probes() -> None:
    control = DraftLengthControl()
    assert control.choose([0.9], [5], 1) == 5  # proposer and verify cost unknown: draft
    control.costs.observe_propose(5, 0.0)
    control.costs.observe_step(6, 0.060)
    assert control.choose([0.9], [5], 1) == 0  # a plain step's cost unknown: don't
    control.costs.observe_step(1, 0.010)
    choices = [control.choose([0.9], [5], 1) for _ in range(3 * PROBE_PERIOD)]
    probes = [i for i, k in enumerate(choices) if k]
    assert len(probes) == 3 and all(choices[i] == 5 for i in probes)  # one in PROBE_PERIOD


class FixedCosts(StepCosts):
    """Test double: the costs it is built with, whatever the steps measure."""

    def __init__(self, step_s: dict[int, float]) -> None:
        super().__init__()
        self.step_s = dict(step_s)
        self.propose_s_per_draft = 0.0

    def observe_step(self, num_positions: int, seconds: float) -> None:
        pass

    def observe_propose(self, max_drafts: int, seconds: float) -> None:
        pass


@pytest.mark.parametrize(
    ("step_s", "drafting"), [({1: 0.01, 5: 0.01}, True), ({1: 1, 5: 5}, False)]
)
def test_engine_follows_the_costs_and_keeps_greedy_output(
    tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch, step_s: dict[int, float], drafting: bool
) -> None:
    monkeypatch.setattr(draft_length, "DraftLengthControl", DraftLengthControl)  # the real one

    def run(speculative: dict[str, object] | None) -> tuple[list[int], EngineCore]:
        engine = EngineCore(
            EngineConfig.create(
                str(tiny_llama_path), speculative=speculative, num_blocks=64, block_size=4
            )
        )
        if engine.spec_decoder is not None:
            engine.spec_decoder.draft_length.control.costs = FixedCosts(step_s)
        params = SamplingParams(max_tokens=3 * PROBE_PERIOD, temperature=0.0, ignore_eos=True)
        req = engine.add_request("r", [5, 6, 7, 8] * 4, params)
        while engine.has_unfinished():
            engine.step()
        return req.output_token_ids, engine

    want, _ = run(None)
    got, engine = run({"method": "ngram", "num_speculative_tokens": 4})
    assert got == want
    stats = engine.scheduler.spec_stats
    assert engine.spec_decoder is not None
    decisions = engine.spec_decoder.draft_length.control.decisions
    probes = decisions // PROBE_PERIOD
    assert probes >= 2
    if drafting:  # free positions: every step drafts but the probes
        assert stats.num_plain_by_cost == probes
        assert stats.num_drafts > probes
    else:  # every position costs a step: only the probes draft
        assert stats.num_plain_by_cost == decisions - probes
        assert stats.num_drafts <= probes
