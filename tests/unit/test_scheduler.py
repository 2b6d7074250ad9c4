"""Scheduler on a tiny random Llama: token budget and seats, chunked prefill beside decodes,
preemption by recompute, priority, head-of-line waiting without chunking, and no leaked KV block.

Every step goes through `step()` below, which checks the budget, the seats and the KV cache's
integrity, and records what the scheduler scheduled.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine.engine_core import EngineCore
from tandem.engine.request import Request, RequestStatus
from tandem.engine.scheduler import SchedulerOutput
from tandem.sampling_params import SamplingParams

VOCAB = 256
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tiny_llama_path: Path) -> Path:
    return tiny_llama_path


def make_engine(path: Path, **overrides: object) -> EngineCore:
    options: dict[str, object] = dict(num_blocks=256, block_size=4)
    options.update(overrides)
    engine = EngineCore(EngineConfig.create(str(path), **options))
    trace: list[dict[str, int]] = []
    schedule = engine.scheduler.schedule

    def traced() -> SchedulerOutput:
        out = schedule()
        trace.append({s.request.request_id: s.num_new_tokens for s in out.scheduled})
        return out

    engine.scheduler.schedule = traced  # type: ignore[method-assign]
    engine.trace = trace  # type: ignore[attr-defined]
    return engine


def step(engine: EngineCore) -> dict[str, int]:
    """One engine step with the invariants checked; returns request id -> tokens scheduled."""
    engine.step()
    scheduled: dict[str, int] = engine.trace[-1]  # type: ignore[attr-defined]
    config = engine.config.scheduler
    assert sum(scheduled.values()) <= config.max_num_batched_tokens
    assert len(engine.scheduler.running) <= config.max_num_seqs
    engine.kv_cache.check_integrity()
    return scheduled


def drain(engine: EngineCore, max_steps: int = 2000) -> list[dict[str, int]]:
    """Step until every request finished; the schedules of those steps."""
    schedules = []
    while engine.has_unfinished():
        assert len(schedules) < max_steps, "the engine made no progress"
        schedules.append(step(engine))
    assert_all_free(engine)
    return schedules


def assert_all_free(engine: EngineCore) -> None:
    engine.kv_cache.check_integrity()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert not engine.scheduler.requests
    assert not engine.scheduler.parked


def prompts_of(lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def solo(path: Path, prompt: list[int], params: SamplingParams) -> list[int]:
    """The request's output when it runs alone with a large cache."""
    engine = make_engine(path, num_blocks=512)
    req = engine.add_request("solo", prompt, params)
    drain(engine)
    return req.output_token_ids


def add_all(
    engine: EngineCore, prompts: list[list[int]], params: SamplingParams, prefix: str = "r"
) -> list[Request]:
    return [engine.add_request(f"{prefix}{i}", p, params) for i, p in enumerate(prompts)]


# -- token budget and seats ---------------------------------------------------------------------


def test_budget_and_seats_scripted(model: Path) -> None:
    engine = make_engine(model, max_num_batched_tokens=16, max_num_seqs=3)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    reqs = add_all(engine, prompts_of([10, 7, 12, 3, 9]), params)
    assert drain(engine) == [
        {"r0": 10, "r1": 6},  # r1's prompt is cut by the budget
        {"r0": 1, "r1": 1, "r2": 12},  # r1's last prompt token; then the seats are full
        {"r0": 1, "r1": 1, "r2": 1},
        {"r0": 1, "r1": 1, "r2": 1},  # r0 has its 4 tokens
        {"r1": 1, "r2": 1, "r3": 3},
        {"r3": 1, "r4": 9},
        {"r3": 1, "r4": 1},
        {"r3": 1, "r4": 1},
        {"r4": 1},
    ]
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert len(r.output_token_ids) == 4


@pytest.mark.parametrize("budget, seats", [(5, 64), (64, 2), (9, 3)])
def test_budget_and_seats_hold_under_load(model: Path, budget: int, seats: int) -> None:
    engine = make_engine(model, max_num_batched_tokens=budget, max_num_seqs=seats)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = prompts_of([1, 17, 4, 30, 8, 2, 11])
    reqs = add_all(engine, prompts, params)
    schedules = drain(engine)  # step() asserts the budget and the seats every step
    assert max(len(s) for s in schedules) <= seats
    assert sum(sum(s.values()) for s in schedules) == sum(len(p) + 5 - 1 for p in prompts)
    assert all(len(r.output_token_ids) == 5 for r in reqs)


# -- chunked prefill beside running decodes -----------------------------------------------------


def test_decodes_keep_running_while_a_long_prompt_is_chunked(model: Path) -> None:
    budget = 32
    engine = make_engine(model, max_num_batched_tokens=budget)
    short = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    short_prompts = prompts_of([5, 6])
    s0, s1 = add_all(engine, short_prompts, short, prefix="s")
    assert step(engine) == {"s0": 5, "s1": 6}

    (long_prompt,) = prompts_of([200], seed=2)
    long = engine.add_request("long", long_prompt, GREEDY)
    num_chunks = 0
    while long.num_computed_tokens < len(long_prompt):
        remaining = len(long_prompt) - long.num_computed_tokens
        outputs_before = len(s0.output_token_ids), len(s1.output_token_ids)
        assert step(engine) == {"s0": 1, "s1": 1, "long": min(remaining, budget - 2)}
        assert (len(s0.output_token_ids), len(s1.output_token_ids)) == (
            outputs_before[0] + 1,
            outputs_before[1] + 1,
        )
        num_chunks += 1
    assert num_chunks == 7  # 6 chunks of 30, then the last 20 tokens
    assert len(long.output_token_ids) == 1
    drain(engine)

    # Sharing steps with a chunked prompt changes no one's greedy output.
    for req, prompt in zip([s0, s1], short_prompts, strict=True):
        assert req.output_token_ids == solo(model, prompt, short)
    assert long.output_token_ids == solo(model, long_prompt, GREEDY)


# -- preemption by recompute --------------------------------------------------------------------


def run_with_small_cache(
    path: Path, prompts: list[list[int]], params: list[SamplingParams], **overrides: object
) -> list[Request]:
    engine = make_engine(path, num_blocks=16, **overrides)
    pairs = enumerate(zip(prompts, params, strict=True))
    reqs = [engine.add_request(f"r{i}", p, sp) for i, (p, sp) in pairs]
    drain(engine)
    return reqs


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_by_recompute_keeps_greedy_output(model: Path, prefix_caching: bool) -> None:
    # Each request grows to 34 tokens = 9 blocks; four of them cannot share 16 blocks.
    prompts = prompts_of([10, 9, 12, 7])
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    reqs = run_with_small_cache(model, prompts, [params] * 4, enable_prefix_caching=prefix_caching)
    assert sum(r.metrics.num_preemptions for r in reqs) > 0
    for req, prompt in zip(reqs, prompts, strict=True):
        assert req.output_token_ids == solo(model, prompt, params)


def test_preemption_keeps_seeded_sampling_output(model: Path) -> None:
    prompts = prompts_of([10, 9, 12, 7], seed=3)
    params = [
        SamplingParams(max_tokens=24, temperature=1.0, seed=100 + i, ignore_eos=True)
        for i in range(4)
    ]
    reqs = run_with_small_cache(model, prompts, params)
    assert sum(r.metrics.num_preemptions for r in reqs) > 0
    for req, prompt, sp in zip(reqs, prompts, params, strict=True):
        assert req.output_token_ids == solo(model, prompt, sp)


def test_preemption_victim_is_the_newest_under_fcfs(model: Path) -> None:
    engine, old, new = start_pair(model, "fcfs", old_priority=0, new_priority=9)
    drain(engine)
    assert old.metrics.num_preemptions == 0
    assert new.metrics.num_preemptions > 0


# -- priority -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy, expected_order", [("priority", ["b", "c", "a"]), ("fcfs", ["a", "b", "c"])]
)
def test_priority_admission_order(model: Path, policy: str, expected_order: list[str]) -> None:
    engine = make_engine(model, max_num_seqs=1, policy=policy)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for name, priority, prompt in zip("abc", [5, 0, 3], prompts_of([4, 4, 4]), strict=True):
        engine.add_request(name, prompt, params, priority=priority)
    first_scheduled = [rid for s in drain(engine) for rid in s]
    assert list(dict.fromkeys(first_scheduled)) == expected_order


def start_pair(
    path: Path, policy: str, old_priority: int, new_priority: int
) -> tuple[EngineCore, Request, Request]:
    """Two requests on 8 blocks that grow to 6 and 7: the older one is admitted a step earlier,
    the newer one's longer prompt makes it the first to need a new block."""
    engine = make_engine(path, num_blocks=8, policy=policy)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    old_prompt, new_prompt = prompts_of([8, 10], seed=4)
    old = engine.add_request("old", old_prompt, params, priority=old_priority)
    step(engine)
    new = engine.add_request("new", new_prompt, params, priority=new_priority)
    return engine, old, new


def test_priority_victim_is_the_least_urgent(model: Path) -> None:
    # The urgent request arrives last and runs behind the older, less urgent one: the older one
    # must give its blocks up, not the urgent one.
    engine, old, new = start_pair(model, "priority", old_priority=9, new_priority=0)
    drain(engine)
    assert new.metrics.num_preemptions == 0
    assert old.metrics.num_preemptions > 0
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for req in (old, new):
        assert req.output_token_ids == solo(model, req.prompt_token_ids, params)


# -- chunked prefill disabled -------------------------------------------------------------------


def test_without_chunking_a_prompt_waits_for_room_head_of_line(model: Path) -> None:
    engine = make_engine(model, max_num_batched_tokens=16, enable_chunked_prefill=False)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    add_all(engine, prompts_of([4, 4]), params, prefix="d")
    assert step(engine) == {"d0": 4, "d1": 4}
    big = engine.add_request("big", prompts_of([15], seed=5)[0], params)
    engine.add_request("small", prompts_of([2], seed=6)[0], params)
    assert drain(engine) == [
        {"d0": 1, "d1": 1},  # 14 tokens left: "big" waits whole, and "small" behind it
        {"d0": 1, "d1": 1},
        {"big": 15},  # the whole prompt in one step; 1 token left is too few for "small"
        {"big": 1, "small": 2},
        {"big": 1, "small": 1},
        {"small": 1},
    ]
    assert big.output_token_ids == solo(model, big.prompt_token_ids, params)


def test_without_chunking_a_prompt_larger_than_the_budget_is_refused(model: Path) -> None:
    engine = make_engine(model, max_num_batched_tokens=16, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="max_num_batched_tokens=16"):
        engine.add_request("r", prompts_of([17])[0], GREEDY)
    assert_all_free(engine)
    engine.add_request("fits", prompts_of([16])[0], GREEDY)  # exactly the budget is fine
    drain(engine)


def test_without_chunking_a_long_recompute_after_preemption_finishes(model: Path) -> None:
    # After preemption a request recomputes prompt + output (up to 12 + 11 tokens), more than
    # one step's budget: it must still finish rather than wait forever.
    prompts = prompts_of([12, 12, 12], seed=7)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    reqs = run_with_small_cache(
        model,
        prompts,
        [params] * 3,
        max_num_batched_tokens=16,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
    )
    assert sum(r.metrics.num_preemptions for r in reqs) > 0
    for req, prompt in zip(reqs, prompts, strict=True):
        assert req.output_token_ids == solo(model, prompt, params)


# -- no leaked KV block -------------------------------------------------------------------------


def test_aborts_mid_prefill_mid_decode_waiting_and_preempted_free_every_block(
    model: Path,
) -> None:
    engine = make_engine(model, num_blocks=24, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    decode, long, queued = add_all(engine, prompts_of([6, 60, 5]), params)
    step(engine)
    step(engine)
    assert decode.output_token_ids and 0 < long.num_computed_tokens < 60
    assert queued.status == RequestStatus.WAITING
    engine.abort("r1")  # mid-prefill
    engine.kv_cache.check_integrity()
    engine.abort("r2")  # still waiting
    assert long.status == queued.status == RequestStatus.FINISHED_ABORTED
    step(engine)
    engine.abort("r0")  # mid-decode
    assert_all_free(engine)
    assert not engine.has_unfinished()

    # Preempt someone, then abort the preempted request while it waits to recompute.
    reqs = add_all(engine, prompts_of([20, 20, 20], seed=8), params, prefix="p")
    while not any(r.status == RequestStatus.PREEMPTED for r in reqs):
        step(engine)
    preempted = next(r for r in reqs if r.status == RequestStatus.PREEMPTED)
    engine.abort(preempted.request_id)
    engine.abort("unknown-id")  # ignored
    drain(engine)
    assert preempted.status == RequestStatus.FINISHED_ABORTED
