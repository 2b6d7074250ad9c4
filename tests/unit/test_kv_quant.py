"""Quantized KV cache (int8 and fp8 e4m3, a float32 scale per token and head).

Round-trip error bounds of each format; paged attention over a quantized cache equals attention
over the dequantized keys/values and stays close to a float cache; the engine runs greedy with
prefix caching, chunked prefill, n-gram speculation and preemption over it, with the same tokens
whichever of those it uses; and the memory budget counts the scales.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from test_attention import BLOCK_SIZE, HEAD_DIM, NUM_BLOCKS, NUM_HEADS, NUM_KV_HEADS, reference

from kv_transfer import KVLayout
from tandem.config import KV_CACHE_DTYPES, CacheConfig, EngineConfig
from tandem.engine import SamplingParams
from tandem.engine.attention import MAX_BATCHED_QUERY_LEN, SeqSpec, TorchSDPABackend
from tandem.engine.dtypes import KV_TORCH_DTYPES, kv_dtype
from tandem.engine.engine_core import EngineCore
from tandem.engine.kv_quant import SCALE_BYTES, decode, encode, slot_dim

pytestmark = pytest.mark.usefixtures("one_thread")
QUANTIZED = sorted(KV_CACHE_DTYPES)  # ["fp8", "int8"]


def round_trip(x: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    return decode(encode(x, KV_TORCH_DTYPES[kv_cache_dtype]), torch.float32)


# -- the formats ---------------------------------------------------------------------------------


def test_int8_round_trip_error_is_at_most_half_a_step_per_token_and_head() -> None:
    g = torch.Generator().manual_seed(0)
    # Heads of very different magnitudes: each (token, head) gets its own scale.
    x = torch.randn(64, 3, 64, generator=g) * torch.tensor([1e-3, 1.0, 300.0])[None, :, None]
    slots = encode(x, torch.int8)
    assert slots.dtype == torch.int8 and slots.shape == (64, 3, 64 + SCALE_BYTES)
    step = x.abs().amax(-1, keepdim=True) / 127  # one quantization step of each slot
    err = (round_trip(x, "int8") - x).abs()
    assert bool((err <= step * (0.5 + 1e-4)).all())
    assert float((err / step).max()) > 0.4  # the bound is tight, not vacuous


def test_fp8_round_trip_error_is_relative() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 3, 64, generator=g) * torch.tensor([1e-3, 1.0, 300.0])[None, :, None]
    scale = x.abs().amax(-1, keepdim=True) / 448
    err = (round_trip(x, "fp8") - x).abs()
    # e4m3: 3 mantissa bits (half a step is 2^-4 of the value); subnormals below 2^-6 step 2^-9.
    assert bool((err <= x.abs() * 2**-4 + scale * 2**-10 + 1e-12).all())


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_zero_and_extreme_slots_round_trip(kv_cache_dtype: str) -> None:
    x = torch.zeros(2, 1, 8)
    x[1, 0, 3] = -65504.0  # one large element, the rest zero
    back = round_trip(x, kv_cache_dtype)
    assert not back.isnan().any()
    torch.testing.assert_close(back, x, atol=0, rtol=1e-6)  # the scale's own rounding


def test_a_slot_holds_its_scale_bytes_and_float_caches_are_casts() -> None:
    x = torch.tensor([[[0.5, -1.0, 0.25, 0.0]]])
    slots = encode(x, torch.int8)  # [1, 1, 4 + 4]
    assert slots[0, 0, :4].tolist() == [64, -127, 32, 0]
    assert slots[0, 0, 4:].contiguous().view(torch.float32).item() == pytest.approx(1 / 127)
    assert slot_dim(torch.bfloat16, 64) == 64 and slot_dim(torch.int8, 64) == 68
    assert torch.equal(decode(encode(x, torch.bfloat16), torch.float32), x)


def test_kv_bytes_per_token_of_smollm2_shape() -> None:
    """SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64. int8 + float32 scales <= 0.55x bf16."""
    nbytes = {
        dtype: KVLayout(30, 3, 64, 16, dtype).layer_nbytes(1) * 30
        for dtype in ("float32", "bfloat16", "int8", "fp8")
    }
    assert nbytes == {"float32": 46080, "bfloat16": 23040, "int8": 12240, "fp8": 12240}
    assert nbytes["int8"] / nbytes["bfloat16"] == pytest.approx(68 / 128)


def test_kv_cache_dtype_is_validated() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="int4")
    config = EngineConfig.create("m", dtype="bfloat16")
    assert kv_dtype(config) == torch.bfloat16
    assert kv_dtype(EngineConfig.create("m", kv_cache_dtype="fp8")) == torch.float8_e4m3fn


# -- attention over a quantized paged cache ------------------------------------------------------


def paged_attention(
    shapes: list[tuple[int, int]], kv_dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Attention output of random requests (num_computed, query_len) over a paged cache of
    `kv_dtype`, and the exact expected output over the keys/values that cache holds."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    backend = TorchSDPABackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE)
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, slot_dim(kv_dtype, HEAD_DIM))
    kv_cache = torch.zeros(shape, dtype=kv_dtype)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    seqs, ks, vs = [], [], []
    for num_computed, query_len in sorted(shapes, key=lambda s: s[1] > MAX_BATCHED_QUERY_LEN):
        ctx = num_computed + query_len
        table = [free.pop() for _ in range(-(-ctx // BLOCK_SIZE))]
        k, v = torch.randn(2, ctx, NUM_KV_HEADS, HEAD_DIM)
        for pos in range(num_computed):
            block, offset = table[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            kv_cache[0, block, offset] = encode(k[pos], kv_dtype)
            kv_cache[1, block, offset] = encode(v[pos], kv_dtype)
        seqs.append(SeqSpec(num_computed, query_len, table))
        ks.append(k)
        vs.append(v)
    qs = [torch.randn(s.query_len, NUM_HEADS, HEAD_DIM) for s in seqs]
    new_k = torch.cat([k[s.num_computed_tokens :] for s, k in zip(seqs, ks, strict=True)])
    new_v = torch.cat([v[s.num_computed_tokens :] for s, v in zip(seqs, vs, strict=True)])
    meta = backend.build_metadata(seqs, torch.device("cpu"))
    out = backend.forward(
        torch.cat(qs).flatten(1), new_k.flatten(1), new_v.flatten(1), kv_cache, meta
    )
    # Every request reads the cache's (quantized) KV, a fresh prompt included.
    expected = [
        reference(
            q,
            decode(encode(k, kv_dtype), torch.float32),
            decode(encode(v, kv_dtype), torch.float32),
            s.num_computed_tokens,
        ).flatten(1)
        for s, q, k, v in zip(seqs, qs, ks, vs, strict=True)
    ]
    return out, expected


SHAPES = [(10, 1), (3, 1), (5, 4), (0, 3), (0, 40), (23, 30)]  # decodes, verification, prefills


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_attention_reads_the_dequantized_cache(kv_cache_dtype: str) -> None:
    out, expected = paged_attention(SHAPES, KV_TORCH_DTYPES[kv_cache_dtype], seed=0)
    torch.testing.assert_close(out, torch.cat(expected), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kv_cache_dtype, atol", [("int8", 0.03), ("fp8", 0.15)])
def test_attention_with_a_quantized_cache_is_close_to_a_float_cache(
    kv_cache_dtype: str, atol: float
) -> None:
    quantized, _ = paged_attention(SHAPES, KV_TORCH_DTYPES[kv_cache_dtype], seed=1)
    exact, _ = paged_attention(SHAPES, torch.float32, seed=1)
    torch.testing.assert_close(quantized, exact, atol=atol, rtol=0)


# -- the engine ----------------------------------------------------------------------------------


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    """Prompts that share a 20-token prefix (prefix caching) and repeat themselves (n-grams)."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 256, (20,), generator=g).tolist()
    out = []
    for n in (30, 9, 50, 17):
        motif = torch.randint(3, 256, (7,), generator=g).tolist()
        out.append(prefix + (motif * (n // 7 + 1))[:n])
    return out


def run_greedy(path: Path, kv_cache_dtype: str, **options: object) -> tuple[list[list[int]], int]:
    """Greedy outputs, checking the block pool after every step; and the preemption count."""
    engine = EngineCore(
        EngineConfig.create(str(path), kv_cache_dtype=kv_cache_dtype, block_size=4, **options)
    )
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(f"r{i}", p, greedy) for i, p in enumerate(shared_prefix_prompts(0))]
    while engine.has_unfinished():
        engine.step()
        engine.kv_cache.check_integrity()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    return [r.output_token_ids for r in reqs], sum(r.metrics.num_preemptions for r in reqs)


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_engine_tokens_do_not_depend_on_chunking_caching_speculation_or_preemption(
    tiny_llama_path: Path, kv_cache_dtype: str
) -> None:
    plain, _ = run_greedy(tiny_llama_path, kv_cache_dtype, num_blocks=256)
    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    chunked_spec, _ = run_greedy(
        tiny_llama_path,
        kv_cache_dtype,
        num_blocks=256,
        max_num_batched_tokens=12,
        speculative=ngram,
    )
    assert chunked_spec == plain
    # 4 requests of up to 20 + 50 + 24 tokens on 40 blocks of 4: some are preempted, recompute
    # and read prefix-cached blocks.
    preempted, num_preemptions = run_greedy(
        tiny_llama_path, kv_cache_dtype, num_blocks=40, speculative=ngram
    )
    assert num_preemptions > 0
    assert preempted == plain


def test_memory_budget_counts_the_scales(tiny_llama_path: Path) -> None:
    """Tiny model: 2 layers, 2 KV heads, head_dim 16. A float32 slot is 64 bytes, int8 16 + 4."""
    blocks = {
        kv: EngineCore(
            EngineConfig.create(str(tiny_llama_path), kv_cache_dtype=kv, memory_gib=1 / 1024)
        ).kv_cache.num_blocks
        for kv in ("auto", "int8")
    }
    per_block = {"auto": 2 * 2 * 2 * 16 * 64, "int8": 2 * 2 * 2 * 16 * 20}
    assert blocks == {kv: 2**20 // n for kv, n in per_block.items()}
