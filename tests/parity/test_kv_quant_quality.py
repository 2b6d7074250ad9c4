"""Quality of the quantized KV cache on the real SmolLM2-135M-Instruct, against bfloat16.

The same bfloat16 engine with a bfloat16, an int8 and an fp8 (e4m3) KV cache; perplexity of the
reference answers of Spec-Bench dev questions, as in test_quant_quality.py (quality_measures.py
holds the answer set and the measure; conftest.py scores the bfloat16 reference once for both).
A quantized cache is read back by the prompt's own forward, so every logit here saw quantized
keys and values. int8 must stay within 1% of bfloat16; fp8, three mantissa bits, within 2%.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from quality_measures import perplexity

from tandem.engine import LLM

pytestmark = pytest.mark.slow

MAX_PERPLEXITY_INCREASE = {"int8": 0.01, "fp8": 0.02}


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_kv_cache_against_bfloat16(
    smollm2_path: Path,
    prompt_logits: Callable[..., torch.Tensor],
    bf16_quality: tuple[float, list[list[int]]],
    kv_cache_dtype: str,
) -> None:
    llm = LLM(str(smollm2_path), dtype="bfloat16", memory_gib=0.05, kv_cache_dtype=kv_cache_dtype)
    ppl = perplexity(llm, prompt_logits)
    base = bf16_quality[0]
    increase = ppl / base - 1
    print(
        f"{kv_cache_dtype} KV cache: perplexity {ppl:.4f} vs bfloat16 {base:.4f} ({increase:+.2%})"
    )
    assert increase <= MAX_PERPLEXITY_INCREASE[kv_cache_dtype]
