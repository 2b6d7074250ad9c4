"""Speculative decoding over a quantized target: greedy output equals the quantized target's own
greedy output token for token (n-gram, layer-skip, a draft model quantized like the target).

Why it is exact: the quantized layers and the int8 LM head compute each row on its own, so a
verified position gets the same logits as in a plain decode step, as long as both steps take the
same route: at most 32 tokens (int8 layers; int4: 128) and 8 logits rows (the int8 LM head) a
step. Steps past those limits take dequantize-then-matmul or the float head, whose rounding
differs, and greedy near-ties may then break differently. Hence small batches here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_spec_decode import make, prompts, run
from test_spec_draft import spec_run

from tandem.data import SPECBENCH_PATH
from tandem.engine import LLM, SamplingParams
from tandem.engine.quant.int4 import Int4Linear
from tandem.engine.quant.int8 import Int8Linear
from tandem.engine.quant.lm_head import KERNEL_MAX_ROWS
from tandem.engine.spec.draft import DraftModelProposer

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
K = 3  # two requests verify 2 * (K + 1) = 8 rows a step: the int8 LM head's limit
SPECS = {
    "ngram": {"method": "ngram"},
    "layerskip": {"method": "layerskip", "num_layers": 1},
    "self-draft": {"method": "draft"},  # draft_model: the target itself, quantized alike
}


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_rows_do_not_depend_on_the_step(tiny_llama_path: Path, method: str) -> None:
    engine = make(tiny_llama_path, quantization=method)
    hidden = torch.randn(KERNEL_MAX_ROWS, 64, generator=torch.Generator().manual_seed(0))
    layer = engine.model.layers[0].mlp.gate_up_proj
    assert isinstance(layer, Int8Linear | Int4Linear) and layer.use_kernel
    with torch.inference_mode():
        for fn in (layer, engine.model.compute_logits):
            assert torch.equal(fn(hidden), torch.cat([fn(row[None]) for row in hidden]))


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_output_equals_the_quantized_targets(
    tiny_llama_path: Path, method: str, name: str
) -> None:
    batch = prompts(1, [30, 9])  # the prompts repeat themselves: n-grams find matches
    plain = run(make(tiny_llama_path, quantization=method), batch, GREEDY)
    spec = SPECS[name] | {"num_speculative_tokens": K}
    if name == "self-draft":
        spec["draft_model"] = str(tiny_llama_path)
    engine = make(tiny_llama_path, spec, quantization=method)
    out, num_drafted, num_accepted = spec_run(engine, batch, GREEDY)
    assert out == plain
    assert num_drafted > 0
    if name == "self-draft":
        assert engine.spec_decoder is not None
        proposer = engine.spec_decoder.proposer
        assert isinstance(proposer, DraftModelProposer)
        assert isinstance(proposer.model.layers[0].mlp.down_proj, Int8Linear | Int4Linear)
        assert num_accepted == num_drafted  # the quantized target drafting for itself


@pytest.mark.slow
def test_smollm2_int4_greedy_with_ngram_equals_plain(smollm2_path: Path) -> None:
    """Two input-grounded Spec-Bench prompts (the shortest summarization and rag ones), one at a
    time: int4 SmolLM2 with n-gram drafts decodes int4 SmolLM2's own greedy tokens."""
    rows = [json.loads(line) for line in SPECBENCH_PATH.read_text().splitlines() if line.strip()]
    chats = [
        [{"role": "user", "content": min(texts, key=len)}]
        for texts in (
            [r["turns"][0] for r in rows if r["category"] == category]
            for category in ("summarization", "rag")
        )
    ]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    options = {"quantization": "int4", "dtype": "bfloat16", "memory_gib": 0.05}
    plain = LLM(str(smollm2_path), **options)
    spec = LLM(str(smollm2_path), speculative={"method": "ngram"}, **options)
    drafted = 0
    for chat in chats:  # batch 1: 6 rows a verify step (k = 5)
        (want,) = plain.chat([chat], params)
        (got,) = spec.chat([chat], params)
        assert got.token_ids == want.token_ids
        assert got.metrics is not None
        drafted += got.metrics.num_draft_tokens
    assert drafted > 0
