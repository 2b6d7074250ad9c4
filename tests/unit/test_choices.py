"""n > 1 choices in the engine: one prompt computation, n sequences on its blocks.

Choice i of a seeded request samples exactly what a request of its own seeded seed + i samples
(greedy: what the greedy request does); the prompt's full blocks are held once, shared by the
choices, and each choice gets its own copy of the partial last block. Preempting, cancelling or
finishing one choice leaves the others' blocks intact, and nothing leaks. The disaggregated path
is played as in test_roles.py: P samples the n first tokens, D forks the choices over the KV.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from test_roles import (
    BLOCK_SIZE,
    DecodeRole,
    PrefillRole,
    assert_all_free,
    copy_kv,
    make_engine,
    prompts_of,
    run,
)

from tandem.engine import LLM
from tandem.engine.engine_core import EngineCore
from tandem.engine.request import Request, RequestStatus
from tandem.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
PROMPT = prompts_of([10])[0]  # 2 full blocks of 4 and a partial one


def singles(engine: EngineCore, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    """Each choice's output as a request of its own (seed + i)."""
    reqs = [engine.add_request(f"one{i}", prompt, params.choice(i)) for i in range(params.n)]
    run(engine)
    return [r.output_token_ids for r in reqs]


def choices_of(req: Request) -> list[Request]:
    return [req, *req.forks]


def finish_as_singles(engine: EngineCore, req: Request, path: Path) -> None:
    """Run `engine` to the end: each choice of `req` equals its request of its own (seed + i,
    on an engine with blocks to spare), and every block is free."""
    run(engine)
    want = singles(make_engine(path, num_blocks=32), req.prompt_token_ids, req.params)
    assert [r.output_token_ids for r in choices_of(req)] == want
    assert_all_free(engine)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_offline_choices_equal_single_requests_seeded_seed_plus_i(
    tiny_llama_path: Path, temperature: float
) -> None:
    llm = LLM(str(tiny_llama_path), num_blocks=64, block_size=BLOCK_SIZE)
    params = replace(SEEDED, n=3, temperature=temperature)
    outs = llm.generate(PROMPT, params)
    assert [o.index for o in outs] == [0, 1, 2]
    want = singles(llm.engine, PROMPT, params)
    assert [o.token_ids for o in outs] == want
    if temperature == 0.0:
        assert want[0] == want[1] == want[2]
    else:
        assert len({tuple(w) for w in want}) > 1  # the seeds differ, so do the choices
    assert_all_free(llm.engine)


def test_offline_stream_of_choices(tiny_llama_path: Path) -> None:
    llm = LLM(str(tiny_llama_path), num_blocks=64, block_size=BLOCK_SIZE)
    params = replace(SEEDED, n=2)
    last = {out.index: out for out in llm.stream(PROMPT, params)}
    assert [last[i].token_ids for i in (0, 1)] == [
        o.token_ids for o in llm.generate(PROMPT, params)
    ]
    assert all(out.finished for out in last.values())
    assert_all_free(llm.engine)


def test_every_choice_carries_the_prompts_logprobs(tiny_llama_path: Path) -> None:
    """The prompt is scored once, by choice 0's prefill; each choice's output carries it."""
    llm = LLM(str(tiny_llama_path), num_blocks=64, block_size=BLOCK_SIZE)
    one = llm.generate(PROMPT, replace(SEEDED, prompt_logprobs=2))[0].prompt_logprobs
    outs = llm.generate(PROMPT, replace(SEEDED, n=3, prompt_logprobs=2))
    assert len(one) == len(PROMPT) - 1
    assert [o.prompt_logprobs for o in outs] == [one] * 3
    assert_all_free(llm.engine)


def test_choices_share_the_prompts_full_blocks_and_copy_the_partial_one(
    tiny_llama_path: Path,
) -> None:
    engine = make_engine(tiny_llama_path, num_blocks=32)
    req = engine.add_request("r", PROMPT, replace(SEEDED, n=3))
    assert engine.kv_cache.num_free_blocks == 32
    engine.step()  # the prompt, and three first tokens
    tables = [engine.kv_cache.block_table(r.request_id) for r in choices_of(req)]
    assert [r.request_id for r in choices_of(req)] == ["r", "r/c1", "r/c2"]
    assert all(len(r.output_token_ids) == 1 for r in choices_of(req))
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]  # the full blocks, held once
    assert len({t[2] for t in tables}) == 3  # a partial block each
    assert engine.kv_cache.num_free_blocks == 32 - 2 - 3
    engine.kv_cache.check_integrity()
    run(engine)
    assert_all_free(engine)


def test_cancelling_one_choice_or_all_frees_their_blocks(tiny_llama_path: Path) -> None:
    engine = make_engine(tiny_llama_path, num_blocks=32)
    req = engine.add_request("r", PROMPT, replace(SEEDED, n=3, max_tokens=20))
    engine.step()
    engine.step()
    engine.abort("r/c1")
    engine.kv_cache.check_integrity()
    assert engine.kv_cache.num_free_blocks == 32 - 2 - 2  # c1's partial block came back
    engine.step()
    assert req.forks[1].status == RequestStatus.RUNNING
    for r in choices_of(req):
        engine.abort(r.request_id)
    assert_all_free(engine)


def test_aborting_before_the_first_token_ends_every_choice(tiny_llama_path: Path) -> None:
    engine = make_engine(tiny_llama_path, num_blocks=32, max_num_batched_tokens=4)
    req = engine.add_request("r", PROMPT, replace(SEEDED, n=3))
    engine.step()  # a first chunk of the prompt
    engine.abort("r")
    assert_all_free(engine)
    assert all(f.status == RequestStatus.WAITING and not f.output_token_ids for f in req.forks)


def test_preempted_choices_recompute_without_corrupting_the_shared_blocks(
    tiny_llama_path: Path,
) -> None:
    # 8 blocks: the prompt (3) and three choices of 10 + 16 tokens (7 blocks each, 2 shared)
    # do not fit at once, so choices are preempted and recompute, some from the prefix cache.
    params = replace(SEEDED, n=3, max_tokens=16)
    engine = make_engine(tiny_llama_path, num_blocks=8)
    req = engine.add_request("r", PROMPT, params)
    finish_as_singles(engine, req, tiny_llama_path)
    assert engine.scheduler.num_preemptions > 0


def test_a_fork_without_a_block_for_its_copy_is_preempted_and_recomputes(
    tiny_llama_path: Path,
) -> None:
    # 3 blocks: the prompt takes them all, so no fork gets a block for its partial copy.
    params = replace(SEEDED, n=2, max_tokens=2)
    engine = make_engine(tiny_llama_path, num_blocks=3)
    req = engine.add_request("r", PROMPT, params)
    engine.step()
    assert req.forks[0].status == RequestStatus.PREEMPTED
    assert req.forks[0].output_token_ids  # its first token kept: it recomputes through it
    finish_as_singles(engine, req, tiny_llama_path)


def test_n_is_validated(tiny_llama_path: Path) -> None:
    engine = make_engine(tiny_llama_path, max_num_seqs=4)
    with pytest.raises(ValueError, match="n must be at most max_num_seqs=4"):
        engine.add_request("r", PROMPT, replace(SEEDED, n=5))
    with pytest.raises(ValueError, match=r"n must be in \[1, 128\]"):
        engine.add_request("r", PROMPT, replace(SEEDED, n=0))
    engine.add_request("r/c1", PROMPT, SEEDED)
    with pytest.raises(ValueError, match="'r/c1' is already in use"):
        engine.add_request("r", PROMPT, replace(SEEDED, n=2))
    engine.abort("r/c1")
    assert_all_free(engine)


def test_disaggregated_choices_one_prefill_n_first_tokens(tiny_llama_path: Path) -> None:
    params = replace(SEEDED, n=3)
    p_engine = make_engine(tiny_llama_path, PrefillRole())
    d_engine = make_engine(tiny_llama_path, DecodeRole(), num_blocks=100)
    decoding = d_engine.add_request("r", PROMPT, params)
    d_engine.step()  # reserves the prompt's blocks, once
    assert d_engine.kv_cache.num_free_blocks == 100 - 3
    d_table = d_engine.kv_cache.block_table("r")

    prefilling = p_engine.add_request("r", PROMPT, params)
    run(p_engine)
    assert prefilling.status == RequestStatus.FINISHED_PREFILLED
    firsts = [r.output_token_ids for r in choices_of(prefilling)]
    assert all(len(f) == 1 for f in firsts)
    assert "r/c1" not in p_engine.scheduler.requests  # P holds the prompt's blocks once

    copy_kv(p_engine, p_engine.kv_cache.block_table("r"), d_engine, d_table)
    fork_tokens = [f[0] for f in firsts[1:]]
    d_engine.remote_kv_arrived("r", firsts[0][0], {}, fork_tokens)
    p_engine.scheduler.release("r")
    assert_all_free(p_engine)
    assert d_engine.kv_cache.num_free_blocks == 100 - 2 - 3  # full blocks shared, partial copied
    finish_as_singles(d_engine, decoding, tiny_llama_path)


def test_disaggregated_arrival_needs_a_first_token_per_fork(tiny_llama_path: Path) -> None:
    d_engine = make_engine(tiny_llama_path, DecodeRole())
    d_engine.add_request("r", PROMPT, replace(SEEDED, n=3))
    d_engine.step()
    with pytest.raises(ValueError, match="2 forks, got 1 tokens"):
        d_engine.remote_kv_arrived("r", 5, {}, [6])
    d_engine.abort("r")
    assert_all_free(d_engine)


def test_greedy_choices_agree_token_for_token(tiny_llama_path: Path) -> None:
    engine = make_engine(tiny_llama_path)
    req = engine.add_request("r", PROMPT, SamplingParams(max_tokens=6, temperature=0.0, n=4))
    run(engine)
    outs = [r.output_token_ids for r in choices_of(req)]
    assert all(o == outs[0] for o in outs) and len(outs[0]) == 6
