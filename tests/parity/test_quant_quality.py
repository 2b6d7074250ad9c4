"""Quality of weight-only int8 / int4 on the real SmolLM2-135M-Instruct, against bfloat16.

All three engines run in bfloat16 (activations, the KV cache and the embeddings); the baseline
holds the GGUF's weights dequantized to bfloat16. The file is Q4_1, so int4 with groups of 32
takes its blocks as they are (the same weights, up to the scales' bfloat16 rounding) while int8
requantizes each row. Both quantized engines compute decode logits through an int8 copy of the
(tied) LM head, so perplexities take the logits a few rows at a time, as decode steps do.

- Perplexity of the reference answers of Spec-Bench dev questions (`tandem/data`), each after
  its chat-templated question: int8 within 1% of bfloat16, int4 within 5%.
- Greedy output: the fraction of prompts (the first 4 of 6 categories) whose first 16 tokens
  equal the bfloat16 engine's, printed; at least half must. (With 6 prompts the fraction moved by
  a prompt whenever attention's rounding changed: bfloat16 greedy near-ties flip.)

The measures live in quality_measures.py; the bfloat16 reference is scored once per session
(conftest.py), shared with test_kv_quant_quality.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from quality_measures import GREEDY_TOKENS, score

pytestmark = pytest.mark.slow

MAX_PERPLEXITY_INCREASE = {"int8": 0.01, "int4": 0.05}


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_weights_against_bfloat16(
    smollm2_path: Path,
    prompt_logits: Callable[..., torch.Tensor],
    bf16_quality: tuple[float, list[list[int]]],
    method: str,
) -> None:
    base_ppl, base_tokens = bf16_quality
    ppl, tokens = score(smollm2_path, prompt_logits, quantization=method)
    increase = ppl / base_ppl - 1
    same = sum(a == b for a, b in zip(tokens, base_tokens, strict=True)) / len(tokens)
    print(
        f"{method}: perplexity {ppl:.4f} vs bfloat16 {base_ppl:.4f} ({increase:+.2%}); "
        f"first {GREEDY_TOKENS} greedy tokens equal on {same:.0%} of {len(tokens)} prompts"
    )
    assert increase <= MAX_PERPLEXITY_INCREASE[method]
    assert same >= 0.5
