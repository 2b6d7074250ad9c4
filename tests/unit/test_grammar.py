"""Structured outputs in the engine: the matcher's masks along drafts, and constrained decoding
with speculation, preemption and a resumed (migrated) request, on the tiny byte-level Llama; the
router's torch-free validation of schemas, regexes, choices and grammars."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from tandem.config import EngineConfig
from tandem.engine.engine_core import EngineCore
from tandem.engine.grammar import GrammarCache, token_masks
from tandem.sampling_params import SamplingParams
from tandem.structured import StructuredOutput

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")
VOCAB = 256
EOS = 2
REGEX = r"[abc]{4,9}(-[abc]{4,9}){1,3}"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def regex(pattern: str) -> StructuredOutput:
    return StructuredOutput("regex", pattern, "guided_regex")


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_llama_path / "tokenizer.json"))


@pytest.fixture(scope="module")
def grammars(tiny_llama_path: Path) -> GrammarCache:
    return GrammarCache(lambda: (tiny_llama_path / "tokenizer.json").read_text(), VOCAB, [EOS])


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text).ids)


def allowed_text(tokenizer: Tokenizer, row: torch.Tensor) -> set[str]:
    return {tokenizer.decode([t]) for t in row.nonzero().flatten().tolist() if t != EOS}


def test_masks_follow_the_drafts_and_leave_the_matcher_where_it_was(
    grammars: GrammarCache, tokenizer: Tokenizer
) -> None:
    matcher = grammars.matcher(regex("ab+c"), ids(tokenizer, "a"))
    drafts = ids(tokenizer, "bxb")
    assert matcher.valid_prefix(drafts) == 1
    masks = token_masks([(None, ()), (matcher, drafts)], VOCAB, CPU)
    assert masks is not None and masks.shape == (5, VOCAB)
    assert bool(masks[0].all()), "an unconstrained row allows everything"
    assert allowed_text(tokenizer, masks[1]) == {"b"}
    assert allowed_text(tokenizer, masks[2]) == {"b", "c"}
    # "x" is refused: the rows after it copy the row of the refusal (never sampled from).
    assert torch.equal(masks[3], masks[2]) and torch.equal(masks[4], masks[2])
    again = token_masks([(matcher, ())], VOCAB, CPU)
    assert again is not None and torch.equal(again[0], masks[1])
    assert token_masks([(None, ()), (None, (5,))], VOCAB, CPU) is None


def test_a_complete_grammar_allows_only_eos(grammars: GrammarCache, tokenizer: Tokenizer) -> None:
    matcher = grammars.matcher(regex("abc"), ids(tokenizer, "abc"))
    masks = token_masks([(matcher, ())], VOCAB, CPU)
    assert masks is not None and masks[0].nonzero().flatten().tolist() == [EOS]


def test_a_matcher_in_error_allows_only_eos(tiny_llama_path: Path, tokenizer: Tokenizer) -> None:
    eos_ids = [2, 63]  # 63: the top bit of its 32-bit word
    grammars = GrammarCache(
        lambda: (tiny_llama_path / "tokenizer.json").read_text(), VOCAB, eos_ids
    )
    matcher = grammars.matcher(regex("ab+c"), [])
    assert not matcher.accept(ids(tokenizer, "x")[0])
    masks = token_masks([(matcher, ())], VOCAB, CPU)
    assert masks is not None and masks[0].nonzero().flatten().tolist() == eos_ids


def test_each_grammar_compiles_once_and_the_cache_keeps_the_newest(
    tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import llguidance

    patterns = ("ab+c", "ab+c", "x+", "ab+c", "y+", "x+")
    outputs = {p: regex(p) for p in patterns}
    keys = {p: outputs[p].grammar for p in patterns}  # before the patch, which they use too
    compiled: list[str] = []
    real = llguidance.LLMatcher

    def counting(tokenizer: object, grammar: str, **kwargs: object) -> object:
        compiled.append(grammar)
        return real(tokenizer, grammar, **kwargs)

    monkeypatch.setattr(llguidance, "LLMatcher", counting)
    grammars = GrammarCache(
        lambda: (tiny_llama_path / "tokenizer.json").read_text(), VOCAB, [EOS], capacity=2
    )
    for pattern in patterns:
        grammars.matcher(outputs[pattern], [])
    # "ab+c" once; "x+" compiled again after "y+" pushed the least recently used out
    assert compiled == [keys[p] for p in ("ab+c", "x+", "y+", "x+")]


def test_an_output_the_grammar_refuses_is_a_value_error(
    grammars: GrammarCache, tokenizer: Tokenizer
) -> None:
    with pytest.raises(ValueError, match="guided_regex: output token"):
        grammars.matcher(regex("ab+c"), ids(tokenizer, "ax"))
    with pytest.raises(ValueError, match="guided_regex"):
        grammars.matcher(regex("(unclosed"), [])


def make(path: Path, spec: dict | None = None, num_blocks: int = 256) -> EngineCore:
    config = EngineConfig.create(str(path), speculative=spec, num_blocks=num_blocks, block_size=4)
    return EngineCore(config)


def run(engine: EngineCore, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    reqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
        engine.kv_cache.check_integrity()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    return [r.output_token_ids for r in reqs]


@pytest.fixture(scope="module")
def prompts(tokenizer: Tokenizer) -> list[list[int]]:
    # Prompts full of legal text, so the n-gram proposer drafts what the grammar allows (and
    # sometimes what it does not: "b-a" where a run is too short).
    return [ids(tokenizer, t) for t in ("abca-abcab-cabc-ab", "ccaab-ba-ccaab-b", "b-a-bbbb-a")]


@pytest.mark.parametrize("spec", [NGRAM, {"method": "layerskip", "num_layers": 1}], ids=str)
def test_constrained_greedy_is_the_same_with_drafts(
    tiny_llama_path: Path, tokenizer: Tokenizer, prompts: list[list[int]], spec: dict
) -> None:
    """n-gram drafts (one-hot, cut at the grammar) and a self-draft's (the model's first layer,
    drafts outside the grammar rejected by the masked target)."""
    params = SamplingParams(max_tokens=40, temperature=0.0, structured_output=regex(REGEX))
    plain = run(make(tiny_llama_path), prompts, params)
    spec_engine = make(tiny_llama_path, spec)
    assert run(spec_engine, prompts, params) == plain
    assert spec_engine.scheduler.spec_stats.num_draft_tokens > 0
    for out in plain:
        assert out[-1] == EOS and re.fullmatch(REGEX, tokenizer.decode(out[:-1])), out
    # Free text is not what the grammar allows: the mask did the work.
    free = run(make(tiny_llama_path), prompts, SamplingParams(max_tokens=40, temperature=0.0))
    assert free != plain


@pytest.mark.parametrize("spec", [NGRAM, {"method": "layerskip", "num_layers": 1}], ids=str)
def test_sampled_constrained_output_matches_with_drafts(
    tiny_llama_path: Path, tokenizer: Tokenizer, prompts: list[list[int]], spec: dict
) -> None:
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, structured_output=regex(REGEX))
    for out in run(make(tiny_llama_path, spec), prompts * 2, params):
        assert out[-1] == EOS and re.fullmatch(REGEX, tokenizer.decode(out[:-1])), out


def test_preempted_and_resumed_requests_keep_their_matcher(
    tiny_llama_path: Path, prompts: list[list[int]]
) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, structured_output=regex(REGEX))
    reference = run(make(tiny_llama_path), prompts, params)
    small = make(tiny_llama_path, num_blocks=20)  # too few blocks for all three: preemption
    assert run(small, prompts, params) == reference
    assert small.scheduler.num_preemptions > 0
    # Migration: a decode worker resumes with the output so far ending the prompt.
    k = 5
    resumed = [p + out[:k] for p, out in zip(prompts, reference, strict=True)]
    tail = run(make(tiny_llama_path), resumed, replace(params, max_tokens=40 - k, output_offset=k))
    assert tail == [out[k:] for out in reference]


def test_structured_output_validation_names_the_field() -> None:
    StructuredOutput.json_schema({"type": "object"}, "response_format").validate()
    StructuredOutput.choice(["a", 'b"c'], "guided_choice").validate()
    StructuredOutput("grammar", 'root ::= "yes" | "no"', "guided_grammar").validate()  # GBNF
    for bad, field in [
        (lambda: StructuredOutput.json_schema('{"type": "nope"}', "guided_json"), "guided_json"),
        (lambda: StructuredOutput.json_schema("[1, 2]", "guided_json"), "guided_json"),
        (lambda: StructuredOutput("regex", "[a-", "guided_regex"), "guided_regex"),
        (lambda: StructuredOutput.choice([], "guided_choice"), "guided_choice"),
        (lambda: StructuredOutput("grammar", "start: nowhere", "guided_grammar"), "guided_grammar"),
    ]:
        with pytest.raises(ValueError, match=f"^{field}: "):
            bad().validate()
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_output=regex("a+")).validate(VOCAB)


def test_the_router_side_imports_no_torch() -> None:
    code = "import sys, tandem.structured; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("spec", [NGRAM, {"method": "grammar"}], ids=str)
def test_forced_tokens_are_free_drafts(
    tiny_llama_path: Path, tokenizer: Tokenizer, spec: dict
) -> None:
    """With n-gram lookup or with no proposer at all (`grammar`: forced tokens are the only
    drafts, free text gets none)."""
    pattern = r"name=[ab]{2,4};kind=(cat|dog);end"
    params = SamplingParams(max_tokens=40, temperature=0.0, structured_output=regex(pattern))
    prompts = [ids(tokenizer, "xyz"), ids(tokenizer, "qrs")]  # nothing for n-gram lookup
    plain = run(make(tiny_llama_path), prompts, params)
    spec_engine = make(tiny_llama_path, spec)
    assert run(spec_engine, prompts, params) == plain
    stats = spec_engine.scheduler.spec_stats
    # "name=", ";kind=", "at"/"og", ";end" are forced: most of them verified as drafts.
    assert stats.num_accepted_tokens >= 10, stats
    if spec["method"] == "grammar":
        assert stats.num_draft_tokens == stats.num_accepted_tokens  # forced: always kept
        drafted = stats.num_draft_tokens
        run(spec_engine, prompts, SamplingParams(max_tokens=8, temperature=0.0))
        assert stats.num_draft_tokens == drafted
    for out in plain:
        assert re.fullmatch(pattern, tokenizer.decode(out[:-1])), out


@pytest.mark.parametrize(
    ("structured", "pattern"),
    [
        (
            StructuredOutput("grammar", 'root ::= [ab]{2,5} "=" ("yes" | "no")'),
            r"[ab]{2,5}=(yes|no)",
        ),
        (
            StructuredOutput("grammar", 'start: /[ab]{2,5}/ "=" ("yes" | "no")'),
            r"[ab]{2,5}=(yes|no)",
        ),
        (StructuredOutput.choice(["cat", "dog", 'say "hi"'], "guided_choice"), r'cat|dog|say "hi"'),
    ],
    ids=["gbnf", "lark", "choice"],
)
def test_grammars_and_choices_constrain_the_tiny_model(
    tiny_llama_path: Path,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
    structured: StructuredOutput,
    pattern: str,
) -> None:
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=7, structured_output=structured)
    for out in run(make(tiny_llama_path), prompts, params):
        assert out[-1] == EOS and re.fullmatch(pattern, tokenizer.decode(out[:-1])), out
