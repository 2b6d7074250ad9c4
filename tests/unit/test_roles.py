"""Role hooks: one scheduler serves the prefill and decode roles of disaggregated serving.

Engine P (prefill role) computes the prompt and samples the first token, then holds the request's
blocks (FINISHED_PREFILLED). Engine D (decode role) reserves blocks for the prompt and parks the
request (WAITING_FOR_REMOTE_KV). The test plays the KV channel: it copies P's blocks into D's,
tells D the KV and first token arrived, releases P, and lets D decode. Greedy output must equal
the colocated engine's, token for token.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine.engine_core import EngineCore
from tandem.engine.request import Request, RequestStatus
from tandem.engine.scheduler import Role
from tandem.sampling_params import SamplingParams

VOCAB = 256
EOS = 2  # the tiny model's eos_token_id
BLOCK_SIZE = 4
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


class PrefillRole(Role):
    def hands_over_after_first_token(self, request: Request) -> bool:
        return True


class DecodeRole(Role):
    def computes_prompt(self, request: Request) -> bool:
        return False


pytestmark = pytest.mark.usefixtures("one_thread")


def make_engine(path: Path, role: Role | None = None, **overrides: object) -> EngineCore:
    options: dict[str, object] = dict(num_blocks=128, block_size=BLOCK_SIZE)
    options.update(overrides)
    return EngineCore(EngineConfig.create(str(path), **options), role)


def run(engine: EngineCore) -> None:
    for _ in range(1000):
        if not engine.has_unfinished():
            return
        engine.step()
        engine.kv_cache.check_integrity()
    raise AssertionError("the engine made no progress")


def assert_all_free(engine: EngineCore) -> None:
    engine.kv_cache.check_integrity()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert not engine.scheduler.requests and not engine.scheduler.parked
    assert not engine.has_unfinished()


def prompts_of(lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def colocated(path: Path, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    engine = make_engine(path)
    reqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    run(engine)
    return [r.output_token_ids for r in reqs]


def copy_kv(src: EngineCore, src_blocks: list[int], dst: EngineCore, dst_blocks: list[int]) -> None:
    """What a KV channel does: P's blocks -> D's reserved blocks, layer by layer."""
    assert len(src_blocks) == len(dst_blocks)
    for src_cache, dst_cache in zip(src.runner.kv_caches, dst.runner.kv_caches, strict=True):
        # [2, num_blocks, block_size, num_kv_heads, head_dim]
        dst_cache[:, dst_blocks] = src_cache[:, src_blocks]


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 8])  # 8: P prefills in chunks
def test_disaggregated_greedy_equals_colocated(
    tiny_llama_path: Path, max_num_batched_tokens: int
) -> None:
    # 12 and 16 are multiples of the block size: D's first decode step needs a fresh block.
    prompts = prompts_of([5, 12, 16, 23, 1, 9])
    p_engine = make_engine(
        tiny_llama_path, PrefillRole(), max_num_batched_tokens=max_num_batched_tokens
    )
    d_engine = make_engine(tiny_llama_path, DecodeRole(), num_blocks=100)
    # Different KV pools on each side: a P block id is generally not the D block id.
    warmup = p_engine.add_request("warmup", prompts_of([30], seed=9)[0], GREEDY)
    run(p_engine)
    p_engine.scheduler.release(warmup.request_id)

    ids = [f"r{i}" for i in range(len(prompts))]
    decoding = [d_engine.add_request(rid, p, GREEDY) for rid, p in zip(ids, prompts, strict=True)]
    assert d_engine.step() == []  # reserves blocks; nothing to compute yet
    d_tables = {}
    for req, prompt in zip(decoding, prompts, strict=True):
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KV
        d_tables[req.request_id] = d_engine.kv_cache.block_table(req.request_id)
        assert len(d_tables[req.request_id]) == -(-len(prompt) // BLOCK_SIZE)
    assert not d_engine.has_unfinished()  # parked requests wait on the channel, not on steps

    prefilling = [p_engine.add_request(rid, p, GREEDY) for rid, p in zip(ids, prompts, strict=True)]
    run(p_engine)
    for req in prefilling:
        assert req.status == RequestStatus.FINISHED_PREFILLED
        assert len(req.output_token_ids) == 1
    p_tables = {rid: p_engine.kv_cache.block_table(rid) for rid in ids}
    assert p_tables != d_tables

    for req in prefilling:
        rid = req.request_id
        copy_kv(p_engine, p_tables[rid], d_engine, d_tables[rid])
        d_engine.scheduler.remote_kv_arrived(rid, req.output_token_ids[0])
        p_engine.scheduler.release(rid)
        p_engine.kv_cache.check_integrity()
    assert_all_free(p_engine)

    run(d_engine)
    assert_all_free(d_engine)
    expected = colocated(tiny_llama_path, prompts, GREEDY)
    for req, want in zip(decoding, expected, strict=True):
        assert req.status == RequestStatus.FINISHED_LENGTH
        assert req.output_token_ids == want


def test_aborting_a_parked_request_frees_its_reserved_blocks(tiny_llama_path: Path) -> None:
    d_engine = make_engine(tiny_llama_path, DecodeRole())
    req = d_engine.add_request("r", prompts_of([13])[0], GREEDY)
    d_engine.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert d_engine.kv_cache.num_free_blocks == d_engine.kv_cache.num_blocks - 4
    d_engine.abort("r")
    assert req.status == RequestStatus.FINISHED_ABORTED
    assert_all_free(d_engine)
    with pytest.raises(KeyError):
        d_engine.scheduler.remote_kv_arrived("r", 7)  # a late arrival finds nothing parked


def test_aborting_a_prefilled_request_frees_its_held_blocks(tiny_llama_path: Path) -> None:
    p_engine = make_engine(tiny_llama_path, PrefillRole())
    req = p_engine.add_request("r", prompts_of([13])[0], GREEDY)
    run(p_engine)
    assert req.status == RequestStatus.FINISHED_PREFILLED
    assert p_engine.kv_cache.num_free_blocks == p_engine.kv_cache.num_blocks - 4
    p_engine.abort("r")
    assert req.status == RequestStatus.FINISHED_ABORTED
    assert_all_free(p_engine)


@pytest.mark.parametrize(
    "params, first_token, status",
    [
        (SamplingParams(max_tokens=8, temperature=0.0), EOS, RequestStatus.FINISHED_STOPPED),
        (SamplingParams(max_tokens=1, temperature=0.0), 7, RequestStatus.FINISHED_LENGTH),
    ],
)
def test_a_final_first_token_finishes_on_arrival(
    tiny_llama_path: Path, params: SamplingParams, first_token: int, status: RequestStatus
) -> None:
    d_engine = make_engine(tiny_llama_path, DecodeRole())
    d_engine.add_request("r", prompts_of([8])[0], params)
    d_engine.step()
    req = d_engine.scheduler.remote_kv_arrived("r", first_token)
    assert req.status == status
    assert req.output_token_ids == [first_token]
    assert_all_free(d_engine)
    assert d_engine.step() == []


def test_prefill_role_hands_over_even_a_final_first_token(tiny_llama_path: Path) -> None:
    p_engine = make_engine(tiny_llama_path, PrefillRole())
    req = p_engine.add_request("r", prompts_of([8])[0], SamplingParams(max_tokens=1))
    run(p_engine)
    assert req.status == RequestStatus.FINISHED_PREFILLED  # the decode side decides it stops
    p_engine.scheduler.release("r")
    assert_all_free(p_engine)
    p_engine.scheduler.release("r")  # a second release is harmless


def test_decode_role_computes_the_prompt_when_its_kv_will_not_arrive(
    tiny_llama_path: Path,
) -> None:
    prompts = prompts_of([13, 6], seed=5)
    d_engine = make_engine(tiny_llama_path, DecodeRole())
    reqs = [d_engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    d_engine.step()
    for r in reqs:
        d_engine.scheduler.compute_prompt_locally(r.request_id)
    run(d_engine)
    assert_all_free(d_engine)
    assert [r.output_token_ids for r in reqs] == colocated(tiny_llama_path, prompts, GREEDY)


def test_parked_requests_hold_seats(tiny_llama_path: Path) -> None:
    d_engine = make_engine(tiny_llama_path, DecodeRole(), max_num_seqs=2)
    prompts = prompts_of([5, 6, 7])
    reqs = [d_engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    d_engine.step()
    assert [r.status for r in reqs] == [
        RequestStatus.WAITING_FOR_REMOTE_KV,
        RequestStatus.WAITING_FOR_REMOTE_KV,
        RequestStatus.WAITING,  # no seat until one of the first two leaves
    ]
    d_engine.scheduler.remote_kv_arrived("r0", 7)
    d_engine.scheduler.remote_kv_arrived("r1", 7)
    d_engine.step()
    assert len(d_engine.scheduler.running) == 2
    assert reqs[2].status == RequestStatus.WAITING
    d_engine.abort("r0")
    d_engine.step()
    assert reqs[2].status == RequestStatus.WAITING_FOR_REMOTE_KV
    d_engine.abort("r1")
    d_engine.abort("r2")
    assert_all_free(d_engine)


def hand_over(
    p_engine: EngineCore,
    d_engine: EngineCore,
    prompts: list[list[int]],
    params: SamplingParams = GREEDY,
) -> list[Request]:
    """Prefill every prompt on P, move its KV to D and release P; D's requests."""
    ids = [f"r{i}" for i in range(len(prompts))]
    decoding = [d_engine.add_request(rid, p, params) for rid, p in zip(ids, prompts, strict=True)]
    d_engine.step()
    prefilling = [p_engine.add_request(rid, p, params) for rid, p in zip(ids, prompts, strict=True)]
    run(p_engine)
    for req in prefilling:
        rid = req.request_id
        d_table = d_engine.kv_cache.block_table(rid)
        copy_kv(p_engine, p_engine.kv_cache.block_table(rid), d_engine, d_table)
        d_engine.scheduler.remote_kv_arrived(rid, req.output_token_ids[0])
        p_engine.scheduler.release(rid)
    return decoding


def test_decode_role_recomputes_a_preempted_request_locally(tiny_llama_path: Path) -> None:
    # Three requests grow to 13 + 10 tokens = 6 blocks each on D's 12 blocks: D must preempt,
    # and a preempted request recomputes on D (P released its KV long ago).
    prompts = prompts_of([13, 13, 13], seed=3)
    p_engine = make_engine(tiny_llama_path, PrefillRole())
    d_engine = make_engine(tiny_llama_path, DecodeRole(), num_blocks=12)
    decoding = hand_over(p_engine, d_engine, prompts)
    run(d_engine)
    assert sum(r.metrics.num_preemptions for r in decoding) > 0
    assert_all_free(d_engine)
    assert [r.output_token_ids for r in decoding] == colocated(tiny_llama_path, prompts, GREEDY)


def test_disaggregated_seeded_sampling_equals_colocated(tiny_llama_path: Path) -> None:
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    prompts = prompts_of([7, 9], seed=4)
    p_engine = make_engine(tiny_llama_path, PrefillRole())
    d_engine = make_engine(tiny_llama_path, DecodeRole())
    decoding = hand_over(p_engine, d_engine, prompts, params)
    run(d_engine)
    assert [r.output_token_ids for r in decoding] == colocated(tiny_llama_path, prompts, params)
