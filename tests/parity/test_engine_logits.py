"""Engine logits equal transformers' on tiny random Llama / Qwen2 / Qwen3 models (fp32).

Every path goes through the real engine: one prompt, a batch of different lengths, chunked
prefill, a prefix-cache hit, and decode steps. The logits the engine sampled from at each step are
recorded and compared with one transformers forward over prompt + generated tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from tandem.config import EngineConfig
from tandem.engine.engine_core import EngineCore
from tandem.sampling_params import SamplingParams

ATOL = 1e-4
CONFIGS = {
    "llama": lambda tiny: LlamaConfig(**tiny, rope_theta=10000.0),
    "llama3-scaled": lambda tiny: LlamaConfig(
        **tiny,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2": lambda tiny: Qwen2Config(**tiny),
    "qwen3": lambda tiny: Qwen3Config(**tiny, head_dim=16),
    "tied": lambda tiny: LlamaConfig(**tiny, tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny_model(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_llama_kwargs: dict[str, int],
):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(CONFIGS[request.param](tiny_llama_kwargs)).eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return path, hf


def record_logits(engine: EngineCore) -> dict[str, list[torch.Tensor]]:
    """Wrap the model and runner so each sampled request's logits rows are kept, per request."""
    rows: list[torch.Tensor] = []
    per_req: dict[str, list[torch.Tensor]] = {}
    compute_logits, execute = engine.model.compute_logits, engine.runner.execute

    def logits_hook(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(logits := compute_logits(hidden))
        return logits

    def execute_hook(*args):
        rows.clear()
        result = execute(*args)
        # The sampled tokens come back in the order of the logits rows.
        for rid, row in zip(result.tokens, rows[0] if rows else [], strict=True):
            per_req.setdefault(rid, []).append(row)
        return result

    engine.model.compute_logits = logits_hook  # type: ignore[method-assign]
    engine.runner.execute = execute_hook  # type: ignore[method-assign]
    return per_req


def run(engine: EngineCore, prompts: list[list[int]], max_tokens: int) -> dict:
    """Greedy-generate; request id -> the logits rows it was sampled from, and its tokens."""
    per_req = record_logits(engine)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return {**per_req, **{f"{r.request_id}:tokens": r.all_token_ids for r in reqs}}


def check(hf, prompts: list[list[int]], result: dict, max_tokens: int) -> None:
    for i, prompt in enumerate(prompts):
        tokens = result[f"r{i}:tokens"]
        with torch.no_grad():
            ref = hf(torch.tensor([tokens[:-1]])).logits[0]  # [len - 1, vocab]
        ours = torch.stack(result[f"r{i}"])  # [max_tokens, vocab]
        assert ours.shape[0] == max_tokens
        expected = ref[len(prompt) - 1 :]
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)


def make_engine(path: Path, **overrides) -> EngineCore:
    return EngineCore(EngineConfig.create(str(path), num_blocks=64, block_size=4, **overrides))


def prompts_of(lengths: list[int], vocab_size: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


def test_one_prompt(tiny_model) -> None:
    path, hf = tiny_model
    prompts = prompts_of([13], hf.config.vocab_size)
    check(hf, prompts, run(make_engine(path), prompts, 6), 6)


def test_batch_of_different_lengths(tiny_model) -> None:
    path, hf = tiny_model
    prompts = prompts_of([3, 17, 9, 1, 30], hf.config.vocab_size)
    check(hf, prompts, run(make_engine(path), prompts, 5), 5)


def test_chunked_prefill(tiny_model) -> None:
    path, hf = tiny_model
    prompts = prompts_of([45, 7], hf.config.vocab_size)
    engine = make_engine(path, max_num_batched_tokens=8)
    check(hf, prompts, run(engine, prompts, 4), 4)


def test_prefix_cache_hit(tiny_model) -> None:
    path, hf = tiny_model
    engine = make_engine(path)
    shared = prompts_of([21], hf.config.vocab_size)[0]
    run(engine, [shared], 2)
    hits_before = engine.kv_cache.stats.prefix_hits
    prompts = [[*shared, 5, 6, 7], shared[:10]]
    check(hf, prompts, run(engine, prompts, 3), 3)
    assert engine.kv_cache.stats.prefix_hits - hits_before >= 20 + 8


def test_prompt_logprobs(tiny_model) -> None:
    """Each prompt token's logprob (and rank, and top-3) is transformers' log-softmax of the row
    before it, across prefill chunks, for a prompt whose prefix is cached too (not read)."""
    path, hf = tiny_model
    engine = make_engine(path, max_num_batched_tokens=8)
    prompt = prompts_of([19], hf.config.vocab_size)[0]
    engine.add_request("cached", prompt, SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        engine.step()  # the prompt's full blocks are cached now
    hits_before = engine.kv_cache.stats.prefix_hits
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3)
    req = engine.add_request("scored", prompt, params)
    deltas = [d for _ in range(10) if engine.has_unfinished() for d in engine.step()]
    assert engine.kv_cache.stats.prefix_hits == hits_before
    scored = [lp for d in deltas for lp in d.prompt_logprobs]
    assert scored == req.prompt_logprobs and len(scored) == len(prompt) - 1
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)  # [len - 1, V]
    ours = torch.tensor([lp.logprob for lp in scored])
    torch.testing.assert_close(ours, ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0])
    top = ref.topk(3)
    assert [lp.top_token_ids for lp in scored] == [tuple(t) for t in top.indices.tolist()]
    assert [lp.token_id for lp in scored] == prompt[1:]
    ranks = (ref >= ref.gather(1, torch.tensor(prompt[1:])[:, None])).sum(-1)
    assert [lp.rank for lp in scored] == ranks.tolist()
