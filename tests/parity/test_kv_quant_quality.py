"""Quality of the quantized KV cache on the real SmolLM2-135M-Instruct, against bfloat16.

The same bfloat16 engine with a bfloat16, an int8 and an fp8 (e4m3) KV cache; perplexity of the
reference answers of Spec-Bench dev questions, as in test_quant_quality.py (whose answer set and
measure this shares). A quantized cache is read back by the prompt's own forward, so every logit
here saw quantized keys and values. int8 must stay within 1% of bfloat16; fp8, three mantissa
bits, within 2%.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_quant_quality import perplexity

from tandem.engine import LLM

pytestmark = pytest.mark.slow

MAX_PERPLEXITY_INCREASE = {"int8": 0.01, "fp8": 0.02}


def kv_perplexity(
    model: Path, kv_cache_dtype: str, prompt_logits: Callable[..., torch.Tensor]
) -> float:
    llm = LLM(str(model), dtype="bfloat16", memory_gib=0.05, kv_cache_dtype=kv_cache_dtype)
    return perplexity(llm, prompt_logits)


@pytest.fixture(scope="module")
def bf16_kv(smollm2_path: Path, prompt_logits: Callable[..., torch.Tensor]) -> float:
    return kv_perplexity(smollm2_path, "auto", prompt_logits)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_kv_cache_against_bfloat16(
    smollm2_path: Path,
    prompt_logits: Callable[..., torch.Tensor],
    bf16_kv: float,
    kv_cache_dtype: str,
) -> None:
    ppl = kv_perplexity(smollm2_path, kv_cache_dtype, prompt_logits)
    increase = ppl / bf16_kv - 1
    print(
        f"{kv_cache_dtype} KV cache: perplexity {ppl:.4f} vs bfloat16 {bf16_kv:.4f} "
        f"({increase:+.2%})"
    )
    assert increase <= MAX_PERPLEXITY_INCREASE[kv_cache_dtype]
