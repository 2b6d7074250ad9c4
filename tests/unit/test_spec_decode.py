"""Speculative decoding in the engine: n-gram drafts verified in one pass per step.

Greedy output must equal non-speculative greedy output token for token (tiny random model and the
real SmolLM2, batched, with chunked prefill in the same batches); blocks stay consistent through
many accept/reject steps; seeded sampling stays reproducible. The verification rule itself is
tested statistically in test_rejection_sampler.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem.config import EngineConfig, parse_speculative
from tandem.data import SPECBENCH_PATH
from tandem.engine import LLM, SamplingParams
from tandem.engine.engine_core import EngineCore
from tandem.engine.request import Request
from tandem.engine.spec.proposer import Draft, Proposer, StepHidden

pytestmark = pytest.mark.usefixtures("one_thread")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    """Random prompts that repeat themselves, so n-grams find matches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        motif = torch.randint(3, 256, (7,), generator=g).tolist()
        out.append((motif * (n // 7 + 1))[:n])
    return out


def run(engine: EngineCore, batch: list[list[int]], params: SamplingParams) -> list[list[int]]:
    reqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(batch)]
    while engine.has_unfinished():
        engine.step()
        engine.kv_cache.check_integrity()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    return [r.output_token_ids for r in reqs]


def make(path: Path, spec: dict | None = None, **options: object) -> EngineCore:
    return EngineCore(
        EngineConfig.create(str(path), speculative=spec, num_blocks=256, block_size=4, **options)
    )


@pytest.mark.parametrize("budget", [2048, 12])  # 12: prompts are chunked while others verify
def test_greedy_output_equals_plain_decoding(tiny_llama_path: Path, budget: int) -> None:
    batch = prompts(0, [30, 9, 50, 17, 3])
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = run(make(tiny_llama_path, max_num_batched_tokens=budget), batch, greedy)
    engine = make(tiny_llama_path, NGRAM, max_num_batched_tokens=budget)
    reqs = [engine.add_request(f"r{i}", p, greedy) for i, p in enumerate(batch)]
    while engine.has_unfinished():
        engine.step()
    assert [r.output_token_ids for r in reqs] == plain
    drafted = sum(r.metrics.num_draft_tokens for r in reqs)
    accepted = sum(r.metrics.num_accepted_tokens for r in reqs)
    assert drafted > 0 and 0 < accepted <= drafted


def test_a_request_can_opt_out_of_speculation(tiny_llama_path: Path) -> None:
    engine = make(tiny_llama_path, NGRAM)
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    batch = prompts(4, [30, 30])
    on = engine.add_request("on", batch[0], greedy)
    off = engine.add_request("off", batch[1], greedy, speculative=False)
    while engine.has_unfinished():
        engine.step()
    assert on.metrics.num_draft_tokens > 0
    assert off.metrics.num_draft_tokens == 0
    assert off.output_token_ids == run(make(tiny_llama_path), batch[1:], greedy)[0]


def test_blocks_stay_consistent_through_accepts_and_rejects(tiny_llama_path: Path) -> None:
    engine = make(tiny_llama_path, NGRAM)
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=3, ignore_eos=True)
    run(engine, prompts(1, [20, 35, 8, 44]), params)  # checks integrity after every step


def test_verified_tokens_carry_the_logprobs_of_plain_decoding(tiny_llama_path: Path) -> None:
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=3)
    batch = prompts(5, [30, 12])

    def logprobs(engine: EngineCore) -> tuple[list[list[int]], list[list[float]], int]:
        reqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(batch)]
        got: dict[str, list[float]] = {r.request_id: [] for r in reqs}
        while engine.has_unfinished():
            for delta in engine.step():
                assert len(delta.logprobs) == len(delta.new_token_ids)
                assert [lp.token_id for lp in delta.logprobs] == delta.new_token_ids
                got[delta.request.request_id] += [lp.logprob for lp in delta.logprobs]
        drafted = sum(r.metrics.num_draft_tokens for r in reqs)
        return [r.output_token_ids for r in reqs], list(got.values()), drafted

    plain_ids, plain_lps, _ = logprobs(make(tiny_llama_path))
    spec_ids, spec_lps, drafted = logprobs(make(tiny_llama_path, NGRAM))
    assert drafted > 0
    assert spec_ids == plain_ids
    for a, b in zip(spec_lps, plain_lps, strict=True):
        assert a == pytest.approx(b, abs=1e-4)


def test_seeded_sampling_is_reproducible(tiny_llama_path: Path) -> None:
    params = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    batch = prompts(2, [25, 14])
    first = run(make(tiny_llama_path, NGRAM), batch, params)
    assert run(make(tiny_llama_path, NGRAM), batch, params) == first
    assert run(make(tiny_llama_path, NGRAM), batch[:1], params) == first[:1]


def test_drafts_never_pass_max_tokens(tiny_llama_path: Path) -> None:
    engine = make(tiny_llama_path, NGRAM)
    for max_tokens in (1, 2, 5):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        (out,) = run(engine, prompts(3, [30]), params)
        assert len(out) == max_tokens


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "medusa"}, "method"),
        ({"method": "ngram", "ngram_min": 3, "ngram_max": 2}, "ngram_min"),
        ({"method": "eagle", "path": "heads", "draft_vocab_size": -1}, "draft_vocab_size"),
    ],
)
def test_bad_config_names_the_field(spec: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig.create("x", speculative=spec)


@pytest.mark.parametrize(
    ("text", "options", "expected"),
    [
        ("ngram", {}, {"method": "ngram"}),
        ("layerskip:8", {}, {"method": "layerskip", "num_layers": 8}),
        ("draft:smollm2-135m", {}, {"method": "draft", "draft_model": "smollm2-135m"}),
        ("draft", {"draft_model": "m"}, {"method": "draft", "draft_model": "m"}),
        ("medusa:/h", {}, {"method": "medusa", "path": "/h"}),
        ("eagle:/h", {"cost_aware": False}, {"method": "eagle", "path": "/h", "cost_aware": False}),
    ],
)
def test_speculative_from_method_and_argument(text: str, options: dict, expected: dict) -> None:
    assert parse_speculative(text, **options) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("beam", "unknown speculative method"),
        ("eagle", "write eagle:PATH"),
        ("ngram:3", "no argument"),
        ("layerskip:x", "write layerskip:N"),
        ("layerskip:0", "num_layers must be >= 1"),
    ],
)
def test_bad_speculative_text_names_the_problem(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_speculative(text)


@pytest.mark.slow
def test_smollm2_greedy_with_ngram_equals_plain(smollm2_path: Path) -> None:
    rows = [json.loads(line) for line in SPECBENCH_PATH.read_text().splitlines()]
    texts = [r["turns"][0] for r in rows if r["category"] in ("summarization", "rag")][:2]
    texts.append(next(r["turns"][0] for r in rows if r["category"] == "writing"))
    chats = [[{"role": "user", "content": t}] for t in texts]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(smollm2_path)).chat(chats, params)]
    spec = LLM(str(smollm2_path), speculative=NGRAM, max_num_batched_tokens=256)
    outs = spec.chat(chats, params)
    assert [o.token_ids for o in outs] == plain


class KnownContinuation(Proposer):
    """Test double: drafts the tokens that plain greedy decoding produced, so every draft is right
    and a verify step recomputes exactly the positions that decode steps computed."""

    def __init__(self, continuation: list[int]) -> None:
        self.continuation = continuation

    def propose(
        self, batch: list[tuple[Request, int]], hidden: StepHidden | None = None
    ) -> list[Draft]:
        drafts = []
        for req, k in batch:
            done = len(req.output_token_ids)
            drafts.append(Draft(self.continuation[done : done + k]))
        return drafts


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "engine_level"),
    [("float32", "in use"), ("bfloat16", "in use"), ("bfloat16", "avx2")],
    indirect=["engine_level"],
)
def test_smollm2_verified_tokens_score_as_decoded_ones(
    smollm2_path: Path, dtype: str, engine_level: str
) -> None:
    """A token verified among drafts gets the logits of the decode step that would compute it:
    drafts equal to plain greedy output are all accepted, with the logprobs plain decoding gave
    (bit for bit in bfloat16, whose linear layers run row-invariant kernels up to 16 rows), at
    the CPU's own level and with the native kernels capped at AVX2."""
    chat = [{"role": "user", "content": "Write a short poem about the sea and the wind."}]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=0)
    plain = LLM(str(smollm2_path), dtype=dtype).chat([chat], params)[0]
    spec = LLM(str(smollm2_path), dtype=dtype, speculative={**NGRAM, "cost_aware": False})
    assert spec.engine.spec_decoder is not None
    spec.engine.spec_decoder.proposer = KnownContinuation(list(plain.token_ids))
    out = spec.chat([chat], params)[0]
    stats = spec.engine.scheduler.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert out.token_ids == plain.token_ids
    got = [lp.logprob for lp in out.logprobs or []]
    want = [lp.logprob for lp in plain.logprobs or []]
    if dtype == "bfloat16":
        assert got == want
    else:  # float32's 1-2 row products take another route (models/linear.py)
        assert got == pytest.approx(want, abs=1e-4)
