"""The Triton paged-attention kernels under Triton's interpreter, against a plain reference.

`TRITON_INTERPRET=1` must be set before Triton is first imported, and it changes what Triton does
for the whole process; so the kernels run in a child interpreter (`_run_child`), one per test
module, and this process never imports Triton. The child computes every case and prints the
largest error of each; the tests assert on those numbers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)

ROOT = Path(__file__).resolve().parents[2]


def reference_attention(
    q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    tables: list[list[int]],
    query_lens: list[int],
    context_lens: list[int],
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads * head_dim] float32
    """Causal attention of each request's queries over its gathered context, in float32."""
    _, _, block_size, hkv, d = kv_cache.shape
    num_heads = q.shape[1] // d
    out = torch.zeros(q.shape[0], num_heads * d)
    start = 0
    for table, n, ctx in zip(tables, query_lens, context_lens, strict=True):
        pos = torch.arange(ctx)
        blocks = torch.tensor(table)[pos // block_size]
        k = kv_cache[0, blocks, pos % block_size].float()  # [ctx, hkv, d]
        v = kv_cache[1, blocks, pos % block_size].float()
        k = k.repeat_interleave(num_heads // hkv, dim=1).transpose(0, 1)  # [heads, ctx, d]
        v = v.repeat_interleave(num_heads // hkv, dim=1).transpose(0, 1)
        qh = q[start : start + n].float().view(n, num_heads, d).transpose(0, 1)
        q_pos = torch.arange(ctx - n, ctx)
        mask = pos[None, :] <= q_pos[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale)
        out[start : start + n] = o.transpose(0, 1).reshape(n, -1)
        start += n
    return out


# name -> (block_size, num_kv_heads, group, head_dim, query_lens, context_lens, dtype, splits)
KERNEL_CASES: dict[str, tuple[int, int, int, int, list[int], list[int], str, int]] = {
    "decode_bs16_gqa1": (16, 2, 1, 32, [1, 1, 1], [5, 17, 40], "float32", 1),
    "decode_bs32_gqa4_split": (32, 2, 4, 32, [1, 1, 1], [1, 33, 90], "float32", 3),
    "prefill_ragged_bs16_gqa8": (16, 1, 8, 32, [20, 7, 33], [20, 7, 33], "float32", 1),
    "prefix_hit_chunk_bs32_gqa4": (32, 2, 4, 32, [10, 40], [42, 104], "float32", 1),
    "verify_1_to_8_bs16_gqa4": (
        16,
        2,
        4,
        32,
        list(range(1, 9)),
        [9, 20, 3, 31, 5, 46, 7, 8],
        "float32",
        1,
    ),
    "verify_split_bs16_gqa8": (16, 1, 8, 32, [3, 8, 1], [40, 75, 2], "float32", 4),
    "gqa3_head64_bs16": (16, 3, 3, 64, [1, 6, 12], [30, 6, 40], "float32", 1),
    "mixed_bf16_bs16_gqa4": (16, 2, 4, 32, [1, 5, 30], [50, 21, 30], "bfloat16", 1),
    "verify_bf16_bs32_gqa8": (32, 1, 8, 32, [4, 8, 2], [70, 8, 33], "bfloat16", 2),
    "prefix_hit_bf16_bs32_gqa1": (32, 2, 1, 32, [17], [81], "bfloat16", 1),
}


def _cache_and_tables(
    block_size: int, hkv: int, d: int, context_lens: list[int], dtype: torch.dtype
) -> tuple[torch.Tensor, list[list[int]]]:
    """A cache of random KV with every request's blocks scattered over it."""
    needed = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(needed) + 3
    cache = torch.randn(2, num_blocks, block_size, hkv, d).to(dtype)
    order = torch.randperm(num_blocks).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(order[used : used + n])
        used += n
    return cache, tables


def _kernel_errors() -> dict[str, float]:
    from tandem.engine import triton_attention

    errors = {}
    for name, (bs, hkv, group, d, q_lens, ctx_lens, dtype_name, splits) in KERNEL_CASES.items():
        dtype = getattr(torch, dtype_name)
        cache, tables = _cache_and_tables(bs, hkv, d, ctx_lens, dtype)
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        q = torch.randn(sum(q_lens), hkv * group * d).to(dtype)
        scale = d**-0.5
        out = triton_attention.paged_attention(
            q, cache, block_tables, starts, torch.tensor(ctx_lens, dtype=torch.int32),
            max(q_lens), scale, splits,
        )  # fmt: skip
        ref = reference_attention(q, cache, tables, q_lens, ctx_lens, scale)
        assert out.dtype == dtype
        errors[name] = (out.float() - ref).abs().max().item()
    return errors


def _backend_errors() -> dict[str, float]:
    """TritonPagedBackend against TorchSDPABackend on one mixed step (decodes, a verification, a
    chunk after a prefix hit, a fresh prompt), and the same step padded to a CUDA graph's key."""
    from tandem.engine.attention import (
        SeqSpec,
        TorchSDPABackend,
        TritonPagedBackend,
        paged_lists,
    )
    from tandem.engine.cuda_graphs import GraphKey, pad_lists

    errors = {}
    for dtype in (torch.float32, torch.bfloat16):
        bs, hkv, heads, d = 16, 2, 8, 32
        ctx_lens, q_lens = [21, 40, 9, 50, 19], [1, 1, 5, 18, 19]
        cache, tables = _cache_and_tables(bs, hkv, d, ctx_lens, dtype)
        seqs = [SeqSpec(c - n, n, t) for c, n, t in zip(ctx_lens, q_lens, tables, strict=True)]
        num_tokens = sum(q_lens)
        q = torch.randn(num_tokens, heads * d).to(dtype)
        k = torch.randn(num_tokens, hkv * d).to(dtype)
        v = torch.randn(num_tokens, hkv * d).to(dtype)
        sdpa = TorchSDPABackend(heads, hkv, d, bs)
        triton = TritonPagedBackend(heads, hkv, d, bs)
        cpu = torch.device("cpu")
        ref_cache, tri_cache = cache.clone(), cache.clone()
        ref = sdpa.forward(q, k, v, ref_cache, sdpa.build_metadata(seqs, cpu))
        out = triton.forward(q, k, v, tri_cache, triton.build_metadata(seqs, cpu))
        tag = str(dtype).removeprefix("torch.")
        errors[f"backend_{tag}"] = (out.float() - ref.float()).abs().max().item()
        errors[f"backend_cache_{tag}"] = (tri_cache.float() - ref_cache.float()).abs().max().item()
        # Padded as a CUDA graph would: 7 requests x 19 tokens; padding writes no KV.
        key = GraphKey(7, 19)
        padded = pad_lists(paged_lists(seqs, bs), key)
        meta = TritonPagedBackend.metadata(padded, key.query_len, 2, cpu)
        pad_cache = cache.clone()

        rows = key.num_tokens - num_tokens
        q, k, v = (torch.cat([x, x.new_zeros(rows, x.shape[1])]) for x in (q, k, v))
        out_padded = triton.forward(q, k, v, pad_cache, meta)
        errors[f"padded_{tag}"] = (out_padded[:num_tokens].float() - ref.float()).abs().max().item()
        errors[f"padded_cache_{tag}"] = (pad_cache.float() - ref_cache.float()).abs().max().item()
    return errors


def _store_kv_errors() -> dict[str, float]:
    """Keys and values land in their slots; slot -1 writes nothing. (In the cache's dtype, as
    the engine's are: the interpreter rounds float32 to bf16 otherwise than a GPU.)"""
    from tandem.engine import triton_attention

    cache = torch.zeros(2, 4, 16, 2, 32, dtype=torch.bfloat16)
    k, v = torch.randn(5, 64, dtype=torch.bfloat16), torch.randn(5, 64, dtype=torch.bfloat16)
    slots = torch.tensor([3, -1, 17, 63, -1])
    triton_attention.store_kv(k, v, cache, slots)
    expected = torch.zeros_like(cache)
    flat = expected.view(2, 64, 2, 32)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            flat[0, slot], flat[1, slot] = k[row].view(2, 32), v[row].view(2, 32)
    return {"store_kv": (cache.float() - expected.float()).abs().max().item()}


@pytest.fixture(scope="module")
def errors() -> dict[str, float]:
    """Every case's largest error, computed under Triton's interpreter in a child process."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _tolerance(name: str) -> float:
    # bf16 outputs round to 8 bits of mantissa (|out| < 4 here); float32 is exact up to order
    return 3e-2 if "bf16" in name or "bfloat16" in name else 1e-5


@pytest.mark.parametrize("name", sorted(KERNEL_CASES))
def test_kernel_equals_reference(errors: dict[str, float], name: str) -> None:
    assert errors[name] <= _tolerance(name), errors[name]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_backend_equals_sdpa_backend(errors: dict[str, float], dtype: str) -> None:
    for part in ("backend", "backend_cache", "padded", "padded_cache"):
        name = f"{part}_{dtype}"
        assert errors[name] <= _tolerance(name), (name, errors[name])


def test_store_kv_skips_padding_slots(errors: dict[str, float]) -> None:
    assert errors["store_kv"] == 0.0


if __name__ == "__main__":  # the child: Triton under its interpreter
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.manual_seed(0)
    print(json.dumps({**_kernel_errors(), **_backend_errors(), **_store_kv_errors()}))
