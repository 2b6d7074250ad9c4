"""Medusa, EAGLE and layer-skip drafters under tensor parallelism (Gloo, local processes, float32):
Medusa and EAGLE run on rank 0 with the whole LM head and embedding gathered there at load
(tandem/engine/tp/vocab.py), layer-skip's draft forwards are steps every rank mirrors; all
draft what the single-device engine drafts: TP 2's tokens and drafts, step by step, equal
TP 1's with the same heads, and the tokens equal plain TP 1 decoding's. A grammar's forced tokens
(method `grammar`, no proposer) are drafts under TP too."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine.attention import TorchSDPABackend
from tandem.engine.engine_core import EngineCore
from tandem.engine.models import load_model
from tandem.engine.spec.draft_vocab import save_ranking
from tandem.engine.spec.heads import base_model_fields
from tandem.engine.spec.medusa import MedusaHeads, save_medusa
from tandem.engine.tp.ranks import TPModelRunner
from tandem.sampling_params import SamplingParams
from tandem.structured import StructuredOutput

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
OPTIONS = dict(num_blocks=24, block_size=4, max_num_batched_tokens=16, num_threads=1)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def heads(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_path: Path, tiny_eagle_path: Path
) -> dict[str, Path]:
    """Random Medusa heads (the target's LM head), and the EAGLE head with a draft vocabulary."""
    root = tmp_path_factory.mktemp("tp-heads")
    target = load_model(tiny_llama_path, TorchSDPABackend, 4, torch.float32, CPU)
    torch.manual_seed(3)
    cfg = target.cfg
    medusa = MedusaHeads(cfg.hidden_size, cfg.vocab_size, 3, 1, False, torch.float32, CPU)
    save_medusa(medusa, root / "medusa", base_model_fields(str(tiny_llama_path), target))
    eagle = shutil.copytree(tiny_eagle_path, root / "eagle")
    save_ranking(eagle, [torch.arange(3, 131)])  # 128 of the 256 tokens
    return {"medusa": root / "medusa", "eagle": eagle}


def generate(
    path: Path, size: int, spec: dict | None, params: SamplingParams = GREEDY
) -> tuple[list[list[int]], EngineCore, list[list[list[int]]]]:
    """The requests' tokens, the engine (to close), and each step's drafts of each request."""
    config = EngineConfig.create(str(path), tensor_parallel_size=size, speculative=spec, **OPTIONS)
    engine = EngineCore(config)
    reqs = [engine.add_request(str(i), p, params) for i, p in enumerate(PROMPTS)]
    drafts = []
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
        drafts.append([list(r.spec_token_ids) for r in reqs])
    return [r.output_token_ids for r in reqs], engine, drafts


@pytest.fixture(scope="module")
def plain(tiny_llama_path: Path) -> list[list[int]]:
    """Plain greedy decoding on one device."""
    outputs, engine, _ = generate(tiny_llama_path, 1, None)
    engine.close()
    return outputs


@pytest.mark.parametrize("method", ["medusa", "eagle", "layerskip"])
def test_drafts_under_tp_equal_one_device(
    tiny_llama_path: Path, heads: dict[str, Path], plain: list[list[int]], method: str
) -> None:
    """Medusa and EAGLE heads on rank 0 with the whole vocabulary; layer-skip's first layer,
    sharded: each draft forward is a one-layer step that rank 1 mirrors over its heads' KV."""
    source = {"num_layers": 1} if method == "layerskip" else {"path": str(heads[method])}
    spec = {"method": method, **source, "num_speculative_tokens": 3}
    single, engine, single_drafts = generate(tiny_llama_path, 1, spec)
    whole = engine.executor.model  # the single-device tables rank 0 must hold whole
    engine.close()
    tp, engine, tp_drafts = generate(tiny_llama_path, 2, spec)
    try:
        runner = engine.executor.runner
        assert isinstance(runner, TPModelRunner)
        if method == "layerskip":  # drafts with rank 0's shard of the LM head, gathered
            assert runner.whole_vocab is None
        else:
            assert runner.whole_vocab is not None
            assert torch.equal(runner.whole_vocab.lm_head_weight, whole.lm_head_weight)
        if method == "eagle":  # untied: the embedding gathered on its own
            assert runner.whole_vocab is not None and runner.whole_vocab.embedding is not None
            assert torch.equal(runner.whole_vocab.embedding, whole.embed_tokens.weight)
    finally:
        engine.close()
    assert tp == single == plain
    assert tp_drafts == single_drafts  # the same drafts, step by step
    assert any(draft for step in single_drafts for draft in step)


def test_grammar_forced_tokens_under_tp(tiny_llama_path: Path) -> None:
    structured = StructuredOutput("regex", r"name=[ab]{2,4};kind=(cat|dog);end", "guided_regex")
    params = SamplingParams(max_tokens=30, temperature=0.0, structured_output=structured)
    plain, engine, _ = generate(tiny_llama_path, 1, None, params)
    engine.close()
    tp, engine, _ = generate(tiny_llama_path, 2, {"method": "grammar"}, params)
    stats = engine.scheduler.spec_stats
    engine.close()
    assert tp == plain
    assert stats.num_draft_tokens == stats.num_accepted_tokens >= 10  # forced: always kept
