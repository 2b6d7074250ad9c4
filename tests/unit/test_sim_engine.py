"""The simulated engine: profile math, deterministic tokens, real block accounting, the fit."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from tandem.config import EngineConfig
from tandem.engine.engine_core import EngineCore
from tandem.engine.request import Request
from tandem.engine.scheduler import Role, ScheduledRequest
from tandem.engine.sim import (
    HeldArrivals,
    SimProfile,
    SimRunner,
    fit_profile,
    sim_token,
    step_shape,
)
from tandem.sampling_params import SamplingParams

PROFILE = SimProfile(
    step_overhead_s=0.002,
    prefill_s_per_token=0.0001,
    decode_s_per_seq=0.001,
    decode_s_per_context_token=0.00001,
    kv_bytes_per_token=1000,
    transfer_bytes_per_s=1e6,
    transfer_latency_s=0.001,
)


def _req(rid: str, prompt: int, computed: int, outputs: int = 0) -> Request:
    r = Request(rid, list(range(3, 3 + prompt)), SamplingParams(max_tokens=100))
    r.output_token_ids.extend([5] * outputs)
    r.num_computed_tokens = computed
    return r


def test_step_time_known_answers() -> None:
    prefill = ScheduledRequest(_req("a", 100, 0), 100)
    decode = ScheduledRequest(_req("b", 10, 10, 1), 1)  # context 11 after this step
    decode2 = ScheduledRequest(_req("c", 20, 22, 3), 1)  # context 23
    assert step_shape([prefill, decode, decode2]) == (100, 2, 34)
    expected = 0.002 + 0.0001 * 100 + 0.001 * 2 + 0.00001 * 34
    assert PROFILE.step_time([prefill, decode, decode2]) == pytest.approx(expected)
    assert PROFILE.step_time([]) == 0.0
    # drafts cost like prompt tokens, on top of the decode
    spec = ScheduledRequest(_req("d", 10, 11, 2), 4, (7, 8, 9))
    assert step_shape([spec]) == (3, 1, 15)
    assert PROFILE.transfer_s(500) == pytest.approx(0.001 + 1000 * 500 / 1e6)
    assert SimProfile().transfer_s(500) == 0.0


def test_profile_roundtrip_and_validation(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    PROFILE.save(path)
    assert SimProfile.load(path) == PROFILE
    assert SimProfile.load(None) == SimProfile() == SimProfile.load("zero")
    with pytest.raises(ValueError, match="unknown"):
        SimProfile.from_dict({"bogus": 1})
    with pytest.raises(ValueError, match=">= 0"):
        SimProfile(prefill_s_per_token=-1.0)


def test_fit_recovers_a_linear_model() -> None:
    truth = SimProfile(0.003, 0.0002, 0.0015, 0.00002)
    samples = [
        {"prefill_tokens": p, "decode_batch": b, "decode_context": c, "step_s": 0.0}
        for p, b, c in [(64, 0, 0), (256, 0, 0), (512, 0, 0), (0, 1, 64), (0, 4, 256),
                        (0, 16, 1024), (0, 1, 512), (0, 4, 2048), (0, 16, 8192)]
    ]  # fmt: skip
    for s in samples:
        s["step_s"] = truth.time_of(s["prefill_tokens"], s["decode_batch"], s["decode_context"])
    fitted = fit_profile(samples)
    for name in ("step_overhead_s", "prefill_s_per_token", "decode_s_per_seq"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    assert fitted.decode_s_per_context_token == pytest.approx(2e-5, rel=1e-6)


def test_fit_drops_negative_terms() -> None:
    samples = [
        {"prefill_tokens": 0, "decode_batch": b, "decode_context": 0, "step_s": 0.01 - 1e-4 * b}
        for b in (1, 4, 16)
    ]
    fitted = fit_profile(samples)
    assert fitted.decode_s_per_seq == 0.0 and fitted.step_overhead_s > 0


def test_sim_token_is_deterministic_and_never_eos() -> None:
    avoid = frozenset({2})
    tokens = [sim_token(42, p, 4, avoid) for p in range(200)]
    assert tokens == [sim_token(42, p, 4, avoid) for p in range(200)]
    assert 2 not in tokens and set(tokens) == {0, 1, 3}
    assert [sim_token(43, p, 4, avoid) for p in range(200)] != tokens


def _sim_engine(
    model: Path, profile: SimProfile | None, tmp_path: Path, **kw: object
) -> EngineCore:
    path = None
    if profile is not None:
        path = str(tmp_path / "profile.json")
        profile.save(path)
    config = EngineConfig.create(str(model), engine="sim", sim_profile=path, **kw)  # type: ignore[arg-type]
    return EngineCore(config)


def _run(engine: EngineCore) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for d in engine.step():
            out.setdefault(d.request.request_id, []).extend(d.new_token_ids)
    return out


def test_sim_engine_answers_deterministically_without_leaks(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    engine = _sim_engine(
        tiny_llama_path, None, tmp_path, num_blocks=8, block_size=4, max_num_seqs=4
    )
    assert engine.model.cfg.num_layers == 1 and engine.runner.kv_caches[0].shape == (2, 8, 4, 1, 1)
    prompts = {f"r{i}": [10 + i] * (5 + i) for i in range(6)}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=6))
    first = _run(engine)  # 6 requests x 3 blocks > 8 blocks: preemption happens
    assert all(len(t) == 6 and 2 not in t for t in first.values())
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    for rid, prompt in prompts.items():
        engine.add_request(rid + "x", prompt, SamplingParams(max_tokens=6))
    again = _run(engine)
    assert all(again[rid + "x"] == first[rid] for rid in prompts)  # depends on prompt + position
    assert engine.kv_cache.usage == 0


def test_sim_engine_capacity_follows_the_real_kv_layout(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    engine = _sim_engine(tiny_llama_path, None, tmp_path, memory_gib=0.001, block_size=16)
    real = json.loads((tiny_llama_path / "config.json").read_text())
    per_token = (
        2
        * real["num_hidden_layers"]
        * real["num_key_value_heads"]
        * (real["hidden_size"] // real["num_attention_heads"])
        * 4
    )
    assert isinstance(engine.runner, SimRunner)
    assert engine.runner.profile.kv_bytes_per_token == per_token
    assert engine.kv_cache.num_blocks == int(0.001 * 2**30) // (per_token * 16)


def test_sim_engine_sleeps_the_modelled_time(tiny_llama_path: Path, tmp_path: Path) -> None:
    engine = _sim_engine(tiny_llama_path, PROFILE, tmp_path, num_blocks=64)
    engine.add_request("a", list(range(3, 103)), SamplingParams(max_tokens=3))
    _run(engine)
    # one prefill step of 100 tokens, then two decode steps at contexts 101 and 102
    expected = 3 * 0.002 + 100 * 0.0001 + 2 * 0.001 + (101 + 102) * 0.00001
    assert engine.runner.busy_s == pytest.approx(expected)  # type: ignore[union-attr]


@dataclass
class _Arrival:
    request_key: str
    seconds: float  # the transfer's own time


class _Arrivals:
    """A receiver's `poll()`: what is put in, reported once."""

    def __init__(self) -> None:
        self.landed: list[_Arrival] = []

    def poll(self) -> list[_Arrival]:
        landed, self.landed = self.landed, []
        return landed


class _RemotePrompts(Role):
    def computes_prompt(self, request: Request) -> bool:
        return False


def test_sim_engine_holds_arrivals_for_the_modelled_transfer_time(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    profile = SimProfile(kv_bytes_per_token=1000, transfer_bytes_per_s=1e6, transfer_latency_s=0.1)
    path = str(tmp_path / "profile.json")
    profile.save(path)
    config = EngineConfig.create(str(tiny_llama_path), engine="sim", sim_profile=path)
    engine = EngineCore(config, _RemotePrompts())
    engine.add_request("r", [5] * 50, SamplingParams(max_tokens=2))
    engine.step()
    assert "r" in engine.scheduler.parked
    source, now = _Arrivals(), [100.0]
    arrivals = engine.executor.arrivals(source, engine.scheduler)
    assert isinstance(arrivals, HeldArrivals)
    arrivals.clock = lambda: now[0]
    # 50 tokens: 0.1 s + 50 kB at 1 MB/s = 0.15 s modelled, of which the transfer took 0.05 s
    parked, gone = _Arrival("r", 0.05), _Arrival("gone", 0.0)  # gone: 0 tokens, 0.1 s
    source.landed = [parked, gone]
    assert arrivals.poll() == []
    now[0] = 100.099
    assert arrivals.poll() == []
    now[0] = 100.101
    assert arrivals.poll() == [parked, gone]
    assert arrivals.poll() == []


def test_real_engine_admits_arrivals_as_they_land(tiny_llama_path: Path) -> None:
    engine = EngineCore(EngineConfig.create(str(tiny_llama_path), num_blocks=8))
    source = _Arrivals()
    assert engine.executor.arrivals(source, engine.scheduler) is source
