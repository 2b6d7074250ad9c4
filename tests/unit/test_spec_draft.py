"""Model-based drafts (`draft` model, `layerskip:N` self-draft) through the real engine.

Greedy output equals plain greedy decoding token for token (batched, chunked prefill in the same
steps, preemption); the KV bookkeeping stays consistent after every step and every block is free
at the end; a target drafting for itself gets every draft accepted; seeded sampling is
reproducible; a bad draft config is refused naming its field.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from test_spec_decode import make, prompts, run

from tandem.config import EngineConfig
from tandem.data import SPECBENCH_PATH
from tandem.engine import LLM, SamplingParams
from tandem.engine.engine_core import EngineCore
from tandem.engine.spec.draft_vocab import save_ranking

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def save_with_tokenizer(model: Any, path: Path, tokenizer_from: Path) -> Path:
    """A transformers model saved in `path` with the tokenizer of `tokenizer_from`."""
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, path / name)
    return path


def save_random_llama(path: Path, tokenizer_from: Path, seed: int, **config: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(eos_token_id=2, initializer_range=0.2, **config))
    return save_with_tokenizer(model, path, tokenizer_from)


@pytest.fixture(scope="module")
def draft_path(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_path: Path, tiny_llama_kwargs: dict
) -> Path:
    """A smaller random model sharing the tiny Llama's tokenizer: 1 layer, hidden size 32."""
    shape = tiny_llama_kwargs | dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    return save_random_llama(tmp_path_factory.mktemp("draft"), tiny_llama_path, 1, **shape)


def drafted(reqs: list) -> tuple[int, int]:
    return (
        sum(r.metrics.num_draft_tokens for r in reqs),
        sum(r.metrics.num_accepted_tokens for r in reqs),
    )


def spec_run(
    engine: EngineCore, batch: list[list[int]], params: SamplingParams
) -> tuple[list[list[int]], int, int]:
    """Output ids, draft tokens and accepted tokens; integrity after every step, no block
    left at the end."""
    reqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(batch)]
    while engine.has_unfinished():
        engine.step()
        engine.kv_cache.check_integrity()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    return [r.output_token_ids for r in reqs], *drafted(reqs)


@pytest.fixture(scope="module")
def draft_vocab_path(tmp_path_factory: pytest.TempPathFactory, draft_path: Path) -> Path:
    """The same draft, saved with a ranking of 160 of the 256 tokens (a draft vocabulary)."""
    path = shutil.copytree(draft_path, tmp_path_factory.mktemp("vocab") / "draft")
    save_ranking(path, [torch.randperm(256, generator=torch.Generator().manual_seed(5))[:160]])
    return path


@pytest.fixture(params=["draft", "draft+vocab", "self", "layerskip"])
def spec(
    request: pytest.FixtureRequest, draft_path: Path, draft_vocab_path: Path, tiny_llama_path: Path
) -> dict:
    """A random smaller draft (also over a draft vocabulary), the target drafting for itself,
    its first layer drafting."""
    return {
        "draft": {"method": "draft", "draft_model": str(draft_path)},
        "draft+vocab": {"method": "draft", "draft_model": str(draft_vocab_path)},
        "self": {"method": "draft", "draft_model": str(tiny_llama_path)},
        "layerskip": {"method": "layerskip", "num_layers": 1},
    }[request.param] | {"num_speculative_tokens": 4}


@pytest.mark.parametrize("budget", [2048, 12])  # 12: prompts are chunked while others verify
def test_greedy_output_equals_plain_decoding(
    tiny_llama_path: Path, spec: dict, budget: int
) -> None:
    batch = prompts(0, [30, 9, 50, 17, 3])
    plain = run(make(tiny_llama_path, max_num_batched_tokens=budget), batch, GREEDY)
    engine = make(tiny_llama_path, spec, max_num_batched_tokens=budget)
    out, num_drafted, num_accepted = spec_run(engine, batch, GREEDY)
    assert out == plain
    assert num_drafted > 0
    if spec.get("draft_model") == str(tiny_llama_path):
        assert num_accepted == num_drafted  # the target drafting for itself


def test_greedy_output_survives_preemption(tiny_llama_path: Path, spec: dict) -> None:
    batch = prompts(6, [30, 21, 40, 13])
    plain = run(make(tiny_llama_path), batch, GREEDY)
    engine = EngineCore(
        EngineConfig.create(str(tiny_llama_path), speculative=spec, num_blocks=40, block_size=4)
    )
    reqs = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(batch)]
    while engine.has_unfinished():
        engine.step()
        engine.kv_cache.check_integrity()
    assert sum(r.metrics.num_preemptions for r in reqs) > 0
    assert [r.output_token_ids for r in reqs] == plain
    if spec.get("draft_model") == str(tiny_llama_path):
        assert len(set(drafted(reqs))) == 1  # every draft accepted
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


@pytest.fixture(scope="module")
def first_layer_path(tmp_path_factory: pytest.TempPathFactory, tiny_llama_path: Path) -> Path:
    """The tiny Llama cut to its first layer (what `layerskip:1` drafts with)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_llama_path)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    return save_with_tokenizer(model, tmp_path_factory.mktemp("first-layer"), tiny_llama_path)


@pytest.mark.parametrize("method", ["draft", "layerskip"])
@pytest.mark.parametrize("num_blocks", [256, 40])  # 40: requests are preempted
def test_drafts_are_the_drafting_models_own_greedy_continuation(
    tiny_llama_path: Path, draft_path: Path, first_layer_path: Path, method: str, num_blocks: int
) -> None:
    """The draft KV kept for accepted drafts and recomputed after rejected ones and after a
    preemption (draft model), or read from the target's cache (layer skip), is what a fresh run
    of the drafting model over the same tokens computes."""
    spec, reference_path = {
        "draft": ({"method": "draft", "draft_model": str(draft_path)}, draft_path),
        "layerskip": ({"method": "layerskip", "num_layers": 1}, first_layer_path),
    }[method]
    engine = EngineCore(
        EngineConfig.create(
            str(tiny_llama_path), speculative=spec | {"num_speculative_tokens": 4},
            num_blocks=num_blocks, block_size=4, max_num_batched_tokens=12,
        )
    )  # fmt: skip
    assert engine.spec_decoder is not None
    propose = engine.spec_decoder.proposer.propose
    seen: list[tuple[list[int], list[int]]] = []  # (the request's tokens, its drafts)

    def recording(batch: list, hidden: object = None) -> list:
        drafts = propose(batch, None)
        seen.extend(
            (list(r.all_token_ids), d.token_ids) for (r, _), d in zip(batch, drafts, strict=True)
        )
        return drafts

    engine.spec_decoder.proposer.propose = recording  # type: ignore[method-assign]
    batch = prompts(7, [30, 9, 50, 17])
    reqs = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(batch)]
    while engine.has_unfinished():
        engine.step()
    num_drafted, num_accepted = drafted(reqs)
    assert 0 < num_accepted < num_drafted  # some drafts were rejected
    assert (num_blocks == 40) == any(r.metrics.num_preemptions for r in reqs)
    reference = make(reference_path)
    expected = [
        reference.add_request(f"s{i}", tokens, replace(GREEDY, max_tokens=len(draft)))
        for i, (tokens, draft) in enumerate(seen)
        if draft
    ]
    while reference.has_unfinished():
        reference.step()
    assert [d for _, d in seen if d] == [r.output_token_ids for r in expected]


def test_seeded_sampling_is_reproducible(tiny_llama_path: Path, spec: dict) -> None:
    params = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    batch = prompts(2, [25, 14])
    first, _, _ = spec_run(make(tiny_llama_path, spec), batch, params)
    assert spec_run(make(tiny_llama_path, spec), batch, params)[0] == first
    assert spec_run(make(tiny_llama_path, spec), batch[:1], params)[0] == first[:1]


def test_sampling_accepts_some_drafts(tiny_llama_path: Path, spec: dict) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.8, ignore_eos=True)
    _, num_drafted, num_accepted = spec_run(
        make(tiny_llama_path, spec), prompts(3, [20, 35, 8]), params
    )
    assert num_drafted > 0
    assert 0 < num_accepted <= num_drafted


def test_draft_kv_is_budgeted(tiny_llama_path: Path, draft_path: Path) -> None:
    """The draft's KV comes out of the same memory budget: fewer blocks than without it."""
    options = dict(memory_gib=0.001, block_size=4)
    plain = EngineCore(EngineConfig.create(str(tiny_llama_path), **options))
    spec = {"method": "draft", "draft_model": str(draft_path)}
    drafting = EngineCore(EngineConfig.create(str(tiny_llama_path), speculative=spec, **options))
    # KV per token: the draft 1 layer x 2 heads x head_dim 8, the target 2 x 2 x 16 (4x more)
    assert drafting.kv_cache.num_blocks == plain.kv_cache.num_blocks * 4 // 5


@pytest.fixture(scope="module")
def other_tokenizer_path(tmp_path_factory: pytest.TempPathFactory, tiny_llama_path: Path) -> Path:
    """The tiny Llama with two tokens of its tokenizer swapped."""
    path = tmp_path_factory.mktemp("other-tokenizer")
    shutil.copytree(tiny_llama_path, path, dirs_exist_ok=True)
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = list(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    return path


@pytest.fixture(scope="module")
def other_vocab_path(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_path: Path, tiny_llama_kwargs: dict
) -> Path:
    shape = tiny_llama_kwargs | dict(vocab_size=320, num_hidden_layers=1)
    return save_random_llama(tmp_path_factory.mktemp("vocab"), tiny_llama_path, 2, **shape)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"method": "draft", "draft_model": "other_tokenizer"}, "draft_model"),
        ({"method": "draft", "draft_model": "other_vocab"}, "draft_model"),
        ({"method": "draft", "draft_model": "no-such-model"}, "draft_model"),
        ({"method": "layerskip", "num_layers": 2}, "num_layers"),
        ({"method": "layerskip", "num_layers": 0}, "num_layers"),
    ],
)
def test_bad_config_names_the_field(
    tiny_llama_path: Path,
    other_tokenizer_path: Path,
    other_vocab_path: Path,
    spec: dict,
    field: str,
) -> None:
    paths = {"other_tokenizer": other_tokenizer_path, "other_vocab": other_vocab_path}
    if spec.get("draft_model") in paths:
        spec = spec | {"draft_model": str(paths[spec["draft_model"]])}
    with pytest.raises(ValueError, match=field):
        make(tiny_llama_path, spec)


@pytest.fixture(scope="module")
def smollm2_greedy(smollm2_path: Path) -> tuple[list, SamplingParams, list[list[int]]]:
    """Two Spec-Bench chats (writing, rag), greedy params, and plain SmolLM2's output ids."""
    rows = [json.loads(line) for line in SPECBENCH_PATH.read_text().splitlines()]
    texts = [next(r["turns"][0] for r in rows if r["category"] == c) for c in ("writing", "rag")]
    chats = [[{"role": "user", "content": t}] for t in texts]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    return chats, params, [o.token_ids for o in LLM(str(smollm2_path)).chat(chats, params)]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["layerskip", "self"])
def test_smollm2_greedy_with_model_drafts_equals_plain(
    smollm2_path: Path, smollm2_greedy: tuple, method: str
) -> None:
    """SmolLM2's first 8 of 30 layers drafting (no extra weights), and SmolLM2 drafting for
    itself (the catalogue has no smaller model with its tokenizer): every draft accepted."""
    chats, params, plain = smollm2_greedy
    spec = {
        "layerskip": {"method": "layerskip", "num_layers": 8},
        "self": {"method": "draft", "draft_model": str(smollm2_path)},
    }[method] | {"num_speculative_tokens": 3}
    outs = LLM(str(smollm2_path), speculative=spec, max_num_batched_tokens=64).chat(chats, params)
    assert [o.token_ids for o in outs] == plain
    metrics = [o.metrics for o in outs if o.metrics is not None]
    num_drafted = sum(m.num_draft_tokens for m in metrics)
    num_accepted = sum(m.num_accepted_tokens for m in metrics)
    assert num_drafted > 0
    if method == "self":
        assert num_accepted == num_drafted
    print(f"{method}: acceptance {num_accepted}/{num_drafted} = {num_accepted / num_drafted:.2f}")
