"""Medusa heads and the EAGLE head in the engine.

Untrained (random) heads must leave greedy output exactly as plain decoding produces it, batched,
with chunked prefill in the same steps and with prefix-cache hits (the EAGLE head's missing
prefix); the EAGLE head's incremental KV catch-up must equal a from-scratch pass over the same
pairs; checkpoints round-trip in our layouts and load from the public Medusa and EAGLE layouts;
heads for another hidden size or vocabulary are refused; each `tandem spec train` method runs a
few steps on a tiny model, saves, and the result loads into the engine. Heads saved with a token
ranking ("+vocab") draft only from its tokens and still leave the output exact.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import save_file
from torch import Tensor

from kv_transfer.wire import tensor_from_proto, tensor_to_proto
from tandem.config import EngineConfig
from tandem.engine import LLM, SamplingParams
from tandem.engine.attention import (
    AttentionBackend,
    AttentionMetadata,
    SeqSpec,
    TorchSDPABackend,
)
from tandem.engine.engine_core import EngineCore
from tandem.engine.models import load_model
from tandem.engine.models.llama import LlamaForCausalLM
from tandem.engine.request import Request, RequestStatus
from tandem.engine.scheduler import Role
from tandem.engine.spec.draft_vocab import VOCAB_FILE, DraftVocab, draft_lm_head, save_ranking
from tandem.engine.spec.eagle import (
    FIRST_POSITION,
    HIDDEN_STATES,
    EagleHead,
    EagleProposer,
    load_eagle,
    save_eagle,
)
from tandem.engine.spec.heads import base_model_fields, hf_config
from tandem.engine.spec.medusa import MedusaHeads, load_medusa, save_medusa
from tandem.training.distill import TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")
BLOCK_SIZE = 4
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tiny_llama_path: Path) -> LlamaForCausalLM:
    return load_model(tiny_llama_path, TorchSDPABackend, BLOCK_SIZE, torch.float32, CPU)


def random_eagle(target: LlamaForCausalLM, seed: int) -> EagleHead:
    torch.manual_seed(seed)
    cfg = replace(target.cfg, num_layers=1)
    backend = TorchSDPABackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, BLOCK_SIZE)
    return EagleHead(cfg, backend, True, cfg.max_position_embeddings, torch.float32, CPU)


DRAFT_VOCAB = torch.randperm(256, generator=torch.Generator().manual_seed(7))[:96]  # ids


@pytest.fixture(scope="module")
def head_dirs(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_path: Path, target: LlamaForCausalLM
) -> dict[str, Path]:
    """Random heads for the tiny model, in our layouts."""
    root = tmp_path_factory.mktemp("heads")
    base = base_model_fields(str(tiny_llama_path), target)
    torch.manual_seed(1)
    cfg = target.cfg
    medusa = MedusaHeads(cfg.hidden_size, cfg.vocab_size, 3, 1, False, torch.float32, CPU)
    save_medusa(medusa, root / "medusa", base)
    save_eagle(random_eagle(target, 2), root / "eagle", base)
    dirs = {"medusa": root / "medusa", "eagle": root / "eagle"}
    for method in ("medusa", "eagle"):  # the same heads with a draft vocabulary of 96 tokens
        dirs[f"{method}+vocab"] = shutil.copytree(dirs[method], root / f"{method}+vocab")
        save_ranking(dirs[f"{method}+vocab"], [DRAFT_VOCAB, DRAFT_VOCAB[:40]])
    return dirs


def spec_of(name: str, path: Path, k: int = 3) -> dict[str, object]:
    """`speculative` options for head_dirs' `name` ("eagle", "medusa+vocab", ...)."""
    return {"method": name.split("+")[0], "path": str(path), "num_speculative_tokens": k}


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def make(path: Path, spec: dict | None = None, **options: object) -> EngineCore:
    return EngineCore(
        EngineConfig.create(
            str(path), speculative=spec, num_blocks=256, block_size=BLOCK_SIZE, **options
        )
    )


def run(
    engine: EngineCore, batch: list[list[int]], params: SamplingParams, tag: str = "r"
) -> list[list[int]]:
    """Run to completion checking both KV pools after every step; everything freed at the end."""
    reqs = [engine.add_request(f"{tag}{i}", p, params) for i, p in enumerate(batch)]
    proposer = engine.spec_decoder.proposer if engine.spec_decoder is not None else None
    while engine.has_unfinished():
        engine.step()
        engine.kv_cache.check_integrity()
        if isinstance(proposer, EagleProposer):
            proposer.kv_cache.check_integrity()
            check_catch_up(proposer, engine)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    if isinstance(proposer, EagleProposer):
        assert proposer.kv_cache.num_free_blocks == proposer.kv_cache.num_blocks
        assert not proposer._seqs
    return [r.output_token_ids for r in reqs]


def check_catch_up(proposer: EagleProposer, engine: EngineCore) -> None:
    """Each request's latest head feature equals a from-scratch pass over its pairs
    (h_j, x_{j+1}), j in [base, done), with h from a fresh target forward."""
    target, head = engine.model, proposer.head
    for request_id, seq in proposer._seqs.items():
        if seq.feature is None:
            continue
        tokens = torch.tensor(engine.scheduler.requests[request_id].all_token_ids[: seq.done + 1])
        n = seq.done - seq.base
        with torch.inference_mode():
            caches, meta = scratch(target.backend, seq.done, target.cfg.num_layers)
            hidden = target(tokens[:-1], torch.arange(seq.done), caches, meta)
            caches, meta = scratch(head.backend, n, 1)
            embeds = target.embed_tokens(tokens[seq.base + 1 :])
            positions = torch.arange(seq.base, seq.done)
            features = head(embeds, hidden[seq.base :], positions, caches, meta)
        torch.testing.assert_close(features[-1], seq.feature, atol=1e-4, rtol=1e-4)


def scratch(
    backend: AttentionBackend, num_tokens: int, num_layers: int
) -> tuple[list[Tensor], AttentionMetadata]:
    """Fresh KV caches and metadata for one sequence of `num_tokens` from position 0."""
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    shape = (2, num_blocks, BLOCK_SIZE, backend.num_kv_heads, backend.head_dim)
    caches = [torch.zeros(shape) for _ in range(num_layers)]
    meta = backend.build_metadata([SeqSpec(0, num_tokens, list(range(num_blocks)))], CPU)
    return caches, meta


@pytest.mark.parametrize("method", ["medusa", "eagle", "medusa+vocab", "eagle+vocab"])
@pytest.mark.parametrize("budget", [2048, 12])  # 12: prompts are chunked while others verify
def test_greedy_output_equals_plain_decoding(
    tiny_llama_path: Path, head_dirs: dict[str, Path], method: str, budget: int
) -> None:
    batch = prompts(0, [30, 9, 50, 17, 3])
    plain = run(make(tiny_llama_path, max_num_batched_tokens=budget), batch, GREEDY)
    spec = spec_of(method, head_dirs[method])
    engine = make(tiny_llama_path, spec, max_num_batched_tokens=budget)
    assert run(engine, batch, GREEDY) == plain
    # Again on the same engine: the prompts' full blocks are prefix-cache hits, so the EAGLE
    # head gets no hidden states for them (as on a decode worker).
    assert run(engine, batch, GREEDY, tag="again") == plain
    assert engine.scheduler.spec_stats.num_draft_tokens > 0


class _HandOver(Role):
    """A prefill worker's role, without its transfer."""

    def hands_over_after_first_token(self, request: Request) -> bool:
        return True


def test_eagle_prompt_state_hands_over_as_if_computed_on_the_decode_side(
    tiny_llama_path: Path, head_dirs: dict[str, Path]
) -> None:
    """The hidden states a prefill engine hands over (through the KV transfer's tensor
    encoding) give a decode-side proposer exactly the drafts of an engine that computed the
    prompt itself."""
    spec = {"method": "eagle", "path": str(head_dirs["eagle"]), "num_speculative_tokens": 3}
    prompt = prompts(3, [23])[0]
    colocated = make(tiny_llama_path, spec)
    req = colocated.add_request("r", prompt, GREEDY)
    colocated.step()  # the prompt, its first token, and the drafts of the next step
    k = len(req.spec_token_ids)  # as many as the adaptive schedule allowed
    assert k > 0

    config = EngineConfig.create(
        str(tiny_llama_path), speculative=spec, num_blocks=256, block_size=BLOCK_SIZE
    )
    prefill = EngineCore(config, _HandOver())
    prefill.add_request("r", prompt, GREEDY)
    (delta,) = prefill.step()
    assert delta.request.status == RequestStatus.FINISHED_PREFILLED
    assert delta.new_token_ids == req.output_token_ids
    assert prefill.spec_decoder is not None
    assert not prefill.spec_decoder.proposer._seqs  # released here once handed over
    prefill.abort("r", RequestStatus.FINISHED_PREFILLED)
    state = {k: tensor_from_proto(tensor_to_proto(k, v)) for k, v in delta.handover.items()}
    assert state[HIDDEN_STATES].shape == (len(prompt), colocated.model.cfg.hidden_size)
    assert state[FIRST_POSITION].tolist() == [0]

    decode_spec = make(tiny_llama_path, spec).spec_decoder
    assert decode_spec is not None
    decode = decode_spec.proposer
    assert isinstance(decode, EagleProposer)
    decode.adopt_state("r", {HIDDEN_STATES: torch.zeros(4, 3), FIRST_POSITION: torch.tensor([0])})
    assert not decode._seqs  # another hidden size: ignored
    decode.adopt_state("r", state)
    (draft,) = decode.propose([(req, k)])
    assert draft.token_ids == req.spec_token_ids


@pytest.mark.parametrize("method", ["medusa", "eagle", "medusa+vocab", "eagle+vocab"])
def test_sampling_is_reproducible_and_accepts_drafts(
    tiny_llama_path: Path, head_dirs: dict[str, Path], method: str
) -> None:
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=5, ignore_eos=True)
    spec = spec_of(method, head_dirs[method])
    batch = prompts(1, [20, 35, 8])
    engine = make(tiny_llama_path, spec, max_num_batched_tokens=16)
    first = run(engine, batch, params)
    assert engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert run(make(tiny_llama_path, spec), batch, params) == first


@pytest.mark.parametrize("method", ["medusa+vocab", "eagle+vocab"])
def test_heads_draft_only_from_their_draft_vocabulary(
    tiny_llama_path: Path, head_dirs: dict[str, Path], method: str
) -> None:
    engine = make(tiny_llama_path, spec_of(method, head_dirs[method]))
    assert engine.spec_decoder is not None
    proposer = engine.spec_decoder.proposer
    drafted: list[int] = []
    propose = proposer.propose

    def recording(batch: list[tuple[Request, int]], hidden: object = None) -> list:
        drafts = propose(batch, hidden)  # type: ignore[arg-type]
        drafted.extend(t for d in drafts for t in d.token_ids)
        return drafts

    proposer.propose = recording  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True)
    run(engine, prompts(2, [20, 35, 8]), params)
    assert len(drafted) > 50 and set(drafted) <= set(DRAFT_VOCAB.tolist())


def test_draft_vocabulary_logits(target: LlamaForCausalLM, head_dirs: dict[str, Path]) -> None:
    """The target's logits on the vocabulary's tokens, -inf elsewhere; the ranking's first N
    tokens by count; the whole head without a ranking or with N = 0."""
    hidden = torch.randn(3, target.cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    full = target.compute_logits(hidden)
    lm_head = draft_lm_head(head_dirs["eagle+vocab"], 8192, target)
    assert isinstance(lm_head, DraftVocab) and len(lm_head) == 96
    logits = lm_head(hidden)
    inside = torch.zeros(256, dtype=torch.bool)
    inside[DRAFT_VOCAB] = True
    torch.testing.assert_close(logits[:, inside], full[:, inside])
    assert bool((logits[:, ~inside] == float("-inf")).all())
    ranked = json.loads((head_dirs["eagle+vocab"] / VOCAB_FILE).read_text())["ranked_token_ids"]
    assert set(ranked[:40]) == set(DRAFT_VOCAB[:40].tolist())  # counted twice: ranked first
    top = draft_lm_head(head_dirs["eagle+vocab"], 40, target)
    assert isinstance(top, DraftVocab) and set(top.token_ids.tolist()) == set(ranked[:40])
    for path, size in ((head_dirs["eagle"], 8192), (head_dirs["eagle+vocab"], 0)):
        assert draft_lm_head(path, size, target) == target.compute_logits


@pytest.mark.parametrize(
    "ranking", ['{"ranked_token_ids": [1, 2, 999]}', '{"ids": [1]}', '["x"]', "{", "[]"]
)
def test_a_bad_draft_vocabulary_is_refused_naming_its_file(
    tmp_path: Path, target: LlamaForCausalLM, ranking: str
) -> None:
    (tmp_path / VOCAB_FILE).write_text(ranking)
    with pytest.raises(ValueError, match=r"draft_vocab\.json"):  # names the file
        draft_lm_head(tmp_path, 8192, target)


def test_our_layouts_round_trip(target: LlamaForCausalLM, head_dirs: dict[str, Path]) -> None:
    medusa = load_medusa(head_dirs["medusa"], target, torch.float32, CPU)
    assert (len(medusa), medusa.num_layers, medusa.own_lm_head) == (3, 1, False)
    eagle = load_eagle(head_dirs["eagle"], target, BLOCK_SIZE, torch.float32, CPU)
    original = random_eagle(target, 2)
    for name, param in original.state_dict().items():
        torch.testing.assert_close(eagle.state_dict()[name], param, rtol=0, atol=0)
    # bfloat16 loads too (the engine's dtype decides)
    assert load_medusa(head_dirs["medusa"], target, torch.bfloat16, CPU)[0][
        0
    ].linear.weight.dtype == (torch.bfloat16)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_public_medusa_layout_loads(
    tmp_path: Path, tiny_llama_path: Path, target: LlamaForCausalLM, suffix: str
) -> None:
    """FasterDecoding/Medusa: `medusa_lm_head.{safetensors,pt}`, each head its own LM head."""
    hidden, vocab = target.cfg.hidden_size, target.cfg.vocab_size
    g = torch.Generator().manual_seed(3)
    state = {}
    for head in range(2):
        state[f"{head}.0.linear.weight"] = torch.randn(hidden, hidden, generator=g) * 0.05
        state[f"{head}.0.linear.bias"] = torch.randn(hidden, generator=g) * 0.05
        state[f"{head}.1.weight"] = torch.randn(vocab, hidden, generator=g)
    if suffix == ".pt":
        torch.save(state, tmp_path / "medusa_lm_head.pt")
    else:
        save_file(state, str(tmp_path / "medusa_lm_head.safetensors"))
    config = {"medusa_num_heads": 2, "medusa_num_layers": 1, "base_model_name_or_path": "tiny"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    heads = load_medusa(tmp_path, target, torch.float32, CPU)
    assert heads.own_lm_head and len(heads) == 2
    torch.testing.assert_close(heads[1][1].weight, state["1.1.weight"])
    batch = prompts(2, [12, 25])
    spec = {"method": "medusa", "path": str(tmp_path), "num_speculative_tokens": 2}
    assert run(make(tiny_llama_path, spec), batch, GREEDY) == run(
        make(tiny_llama_path), batch, GREEDY
    )


def test_public_eagle_layout_loads(
    tmp_path: Path, tiny_llama_path: Path, target: LlamaForCausalLM
) -> None:
    """SafeAILab/EAGLE (EAGLE-1/2): a Llama config with one layer, `pytorch_model.bin` with
    `fc.*`, `layers.0.*` under HF names (no input norm) and the embedding."""
    cfg = target.cfg
    g = torch.Generator().manual_seed(4)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.1

    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    state = {
        "embed_tokens.weight": rand(cfg.vocab_size, h),
        "fc.weight": rand(h, 2 * h),
        "layers.0.self_attn.q_proj.weight": rand(q, h),
        "layers.0.self_attn.k_proj.weight": rand(kv, h),
        "layers.0.self_attn.v_proj.weight": rand(kv, h),
        "layers.0.self_attn.o_proj.weight": rand(h, q),
        "layers.0.mlp.gate_proj.weight": rand(inter, h),
        "layers.0.mlp.up_proj.weight": rand(inter, h),
        "layers.0.mlp.down_proj.weight": rand(h, inter),
        "layers.0.post_attention_layernorm.weight": 1 + rand(h),
    }
    torch.save(state, tmp_path / "pytorch_model.bin")
    config = {**hf_config(replace(cfg, num_layers=1)), "bias": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    head = load_eagle(tmp_path, target, BLOCK_SIZE, torch.float32, CPU)
    assert head.fc.bias is None
    fused = torch.cat([state[f"layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    torch.testing.assert_close(head.layers[0].self_attn.qkv_proj.weight, fused)
    batch = prompts(3, [12, 25])
    spec = {"method": "eagle", "path": str(tmp_path), "num_speculative_tokens": 2}
    assert run(make(tiny_llama_path, spec), batch, GREEDY) == run(
        make(tiny_llama_path), batch, GREEDY
    )


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size"])
@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_heads_for_another_model_are_refused(
    tmp_path: Path, tiny_llama_path: Path, head_dirs: dict[str, Path], method: str, field: str
) -> None:
    heads = tmp_path / method
    heads.mkdir()
    for file in head_dirs[method].iterdir():
        (heads / file.name).write_bytes(file.read_bytes())
    config = json.loads((heads / "config.json").read_text())
    config[field] = 32 if field == "hidden_size" else 100
    (heads / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field):
        make(tiny_llama_path, {"method": method, "path": str(heads)})


@pytest.mark.parametrize("method", ["medusa", "eagle", "draft"])
def test_spec_train_runs_saves_and_loads(
    tmp_path: Path, tiny_llama_path: Path, method: str
) -> None:
    questions = tmp_path / "questions.jsonl"
    rows = [
        {"question_id": i, "category": "qa", "turns": [f"question {i}: " + "why? " * (i % 4 + 4)]}
        for i in range(8)
    ]
    questions.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / method
    config = TrainConfig(
        method=method,
        out=str(out),
        model=str(tiny_llama_path),
        minutes=0.01,
        prompts=str(questions),
        num_heads=2,
        draft_layers=1,
        gen_tokens=24,
        window=20,
        batch_positions=40,
        eval_prompts=2,
        eval_tokens=8,
    )
    result = train(config, Console(quiet=True))
    assert result.steps >= 1 and result.num_sequences >= 1
    assert result.acceptance["drafts"] > 0
    assert json.loads((out / "train_report.json").read_text())["method"] == method
    assert (out / VOCAB_FILE).is_file()  # the result drafts over the corpus's tokens
    key = "draft_model" if method == "draft" else "path"
    llm = LLM(str(tiny_llama_path), speculative={"method": method, key: str(out)})
    (output,) = llm.generate(["hello"], SamplingParams(max_tokens=8, temperature=0.0))
    plain = LLM(str(tiny_llama_path)).generate(
        ["hello"], SamplingParams(max_tokens=8, temperature=0.0)
    )
    assert output.token_ids == plain[0].token_ids


def test_eagle_kv_is_budgeted(tiny_llama_path: Path, head_dirs: dict[str, Path]) -> None:
    """The EAGLE head's one-layer KV comes out of the engine's memory budget."""
    options = dict(memory_gib=0.001, block_size=BLOCK_SIZE)
    plain = EngineCore(EngineConfig.create(str(tiny_llama_path), **options))
    spec = {"method": "eagle", "path": str(head_dirs["eagle"])}
    eagle = EngineCore(EngineConfig.create(str(tiny_llama_path), speculative=spec, **options))
    layers = plain.model.cfg.num_layers  # the head's layer is shaped as one of the target's
    assert eagle.kv_cache.num_blocks == plain.kv_cache.num_blocks * layers // (layers + 1)
