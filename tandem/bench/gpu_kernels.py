"""The Triton attention kernels against a plain reference, on any device Triton runs on.

The same cases run in `make test` on CPU under Triton's interpreter
(`tests/unit/test_triton_attention.py`) and on a GPU in the GPU check (`tandem bench gpu`), where
bfloat16 is computed in bfloat16. Each case reports its largest absolute error; `tolerance` says
what a case may reach.
"""

from __future__ import annotations

import torch

# name -> (block_size, num_kv_heads, group, head_dim, query_lens, context_lens, dtype, splits)
KERNEL_CASES: dict[str, tuple[int, int, int, int, list[int], list[int], str, int]] = {
    "decode_bs16_gqa1": (16, 2, 1, 32, [1, 1, 1], [5, 17, 40], "float32", 1),
    "decode_bs32_gqa4_split": (32, 2, 4, 32, [1, 1, 1], [1, 33, 90], "float32", 3),
    "prefill_ragged_bs16_gqa8": (16, 1, 8, 32, [20, 7, 33], [20, 7, 33], "float32", 1),
    "prefix_hit_chunk_bs32_gqa4": (32, 2, 4, 32, [10, 40], [42, 104], "float32", 1),
    "verify_1to8_gqa4": (16, 2, 4, 32, [*range(1, 9)], [9, 20, 3, 31, 5, 46, 7, 8], "float32", 1),
    "verify_split_bs16_gqa8": (16, 1, 8, 32, [3, 8, 1], [40, 75, 2], "float32", 4),
    "gqa3_head64_bs16": (16, 3, 3, 64, [1, 6, 12], [30, 6, 40], "float32", 1),
    "ragged_bs8_gqa4_split": (8, 2, 4, 32, [1, 3, 9], [70, 140, 9], "float32", 2),
    "ragged_bs48_gqa4": (48, 1, 4, 32, [2, 1, 20], [100, 7, 150], "float32", 1),
    "mixed_bf16_bs16_gqa4": (16, 2, 4, 32, [1, 5, 30], [50, 21, 30], "bfloat16", 1),
    "verify_bf16_bs32_gqa8": (32, 1, 8, 32, [4, 8, 2], [70, 8, 33], "bfloat16", 2),
    "prefix_hit_bf16_bs32_gqa1": (32, 2, 1, 32, [17], [81], "bfloat16", 1),
}


def tolerance(name: str) -> float:
    """bf16 outputs round to 8 bits of mantissa (|out| < 4 here; on a GPU the products are bf16
    too); float32 is exact up to the order of the sums."""
    return 3e-2 if "bf16" in name or "bfloat16" in name else 1e-5


def reference_attention(
    q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    tables: list[list[int]],
    query_lens: list[int],
    context_lens: list[int],
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads * head_dim] float32 (computed in float64)
    """Causal attention of each request's queries over its gathered context, in float64 (so
    that no device's attention kernel is the reference of its own kind)."""
    _, _, block_size, hkv, d = kv_cache.shape
    num_heads = q.shape[1] // d
    out = q.new_zeros(q.shape[0], num_heads * d, dtype=torch.float32)
    start = 0
    for table, n, ctx in zip(tables, query_lens, context_lens, strict=True):
        pos = torch.arange(ctx, device=q.device)
        blocks = torch.tensor(table, device=q.device)[pos // block_size]
        k = kv_cache[0, blocks, pos % block_size].double()  # [ctx, hkv, d]
        v = kv_cache[1, blocks, pos % block_size].double()
        k = k.repeat_interleave(num_heads // hkv, dim=1).transpose(0, 1)  # [heads, ctx, d]
        v = v.repeat_interleave(num_heads // hkv, dim=1).transpose(0, 1)
        qh = q[start : start + n].double().view(n, num_heads, d).transpose(0, 1)
        scores = (qh @ k.transpose(1, 2)) * scale  # [heads, n, ctx]
        visible = pos[None, :] <= pos[ctx - n :, None]  # [n, ctx]
        o = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v  # [heads, n, d]
        out[start : start + n] = o.transpose(0, 1).reshape(n, -1).float()
        start += n
    return out


def random_cache(
    block_size: int,
    hkv: int,
    d: int,
    context_lens: list[int],
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, list[list[int]]]:
    """A cache of random KV with every request's blocks scattered over it."""
    needed = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(needed) + 3
    cache = torch.randn(2, num_blocks, block_size, hkv, d, device=device).to(dtype)
    order = torch.randperm(num_blocks).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(order[used : used + n])
        used += n
    return cache, tables


def kernel_errors(device: torch.device) -> dict[str, float]:
    from tandem.engine import triton_attention

    errors = {}
    for name, (bs, hkv, group, d, q_lens, ctx_lens, dtype_name, splits) in KERNEL_CASES.items():
        dtype = getattr(torch, dtype_name)
        cache, tables = random_cache(bs, hkv, d, ctx_lens, dtype, device)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        starts = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
        q = torch.randn(sum(q_lens), hkv * group * d, device=device).to(dtype)
        scale = d**-0.5
        out = triton_attention.paged_attention(
            q,
            cache,
            torch.tensor(padded, dtype=torch.int32, device=device),
            torch.tensor(starts, dtype=torch.int32, device=device),
            torch.tensor(ctx_lens, dtype=torch.int32, device=device),
            max(q_lens),
            scale,
            splits,
        )
        ref = reference_attention(q, cache, tables, q_lens, ctx_lens, scale)
        errors[name] = (out.float() - ref).abs().max().item() if out.dtype == dtype else 1e9
    return errors


def backend_errors(device: torch.device) -> dict[str, float]:
    """TritonPagedBackend against TorchSDPABackend on one mixed step (decodes, a verification, a
    chunk after a prefix hit, a fresh prompt): outputs and the KV they write; and the same step
    padded and packed as a CUDA graph takes it (`cuda_graphs.py`)."""
    from tandem.engine.attention import SeqSpec, TorchSDPABackend, TritonPagedBackend, paged_lists
    from tandem.engine.cuda_graphs import GraphKey, pack, packed_metadata, packed_size, pad_lists

    errors = {}
    for dtype in (torch.float32, torch.bfloat16):
        bs, hkv, heads, d = 16, 2, 8, 32
        ctx_lens, q_lens = [21, 40, 9, 50, 19], [1, 1, 5, 18, 19]
        cache, tables = random_cache(bs, hkv, d, ctx_lens, dtype, device)
        seqs = [SeqSpec(c - n, n, t) for c, n, t in zip(ctx_lens, q_lens, tables, strict=True)]
        num_tokens = sum(q_lens)
        q = torch.randn(num_tokens, heads * d, device=device).to(dtype)
        k = torch.randn(num_tokens, hkv * d, device=device).to(dtype)
        v = torch.randn(num_tokens, hkv * d, device=device).to(dtype)
        sdpa = TorchSDPABackend(heads, hkv, d, bs)
        triton = TritonPagedBackend(heads, hkv, d, bs)
        ref_cache, tri_cache, pad_cache = cache.clone(), cache.clone(), cache.clone()
        ref = sdpa.forward(q, k, v, ref_cache, sdpa.build_metadata(seqs, device)).float()
        out = triton.forward(q, k, v, tri_cache, triton.build_metadata(seqs, device))
        tag = str(dtype).removeprefix("torch.")
        errors[f"backend_{tag}"] = (out.float() - ref).abs().max().item()
        errors[f"backend_cache_{tag}"] = (tri_cache.float() - ref_cache.float()).abs().max().item()
        # As a CUDA graph runs it: 7 requests x 19 tokens, the padding writing no KV, the block
        # tables wider than the step's, their unused columns holding block ids out of range.
        key, max_blocks = GraphKey(7, 19), 9
        packed = torch.full((packed_size(key, max_blocks),), 1 << 20, dtype=torch.int32)
        pack(pad_lists(paged_lists(seqs, bs), key), packed.numpy(), key)
        meta = packed_metadata(packed.to(device), key, max_blocks, num_splits=2)
        rows = key.num_tokens - num_tokens
        q, k, v = (torch.cat([x, x.new_zeros(rows, x.shape[1])]) for x in (q, k, v))
        padded = triton.forward(q, k, v, pad_cache, meta)[:num_tokens]
        errors[f"padded_{tag}"] = (padded.float() - ref).abs().max().item()
        errors[f"padded_cache_{tag}"] = (pad_cache.float() - ref_cache.float()).abs().max().item()
    return errors


def store_kv_errors(device: torch.device) -> dict[str, float]:
    """Keys and values land in their slots; slot -1 writes nothing. (In the cache's dtype, as
    the engine's are: the interpreter rounds float32 to bf16 otherwise than a GPU.)"""
    from tandem.engine import triton_attention

    cache = torch.zeros(2, 4, 16, 2, 32, dtype=torch.bfloat16, device=device)
    k = torch.randn(5, 64, device=device).to(torch.bfloat16)
    v = torch.randn(5, 64, device=device).to(torch.bfloat16)
    slots = torch.tensor([3, -1, 17, 63, -1], device=device)
    triton_attention.store_kv(k, v, cache, slots)
    expected = torch.zeros_like(cache)
    flat = expected.view(2, 64, 2, 32)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            flat[0, slot], flat[1, slot] = k[row].view(2, 32), v[row].view(2, 32)
    return {"store_kv": (cache.float() - expected.float()).abs().max().item()}


def all_errors(device: torch.device) -> dict[str, float]:
    """Every case's largest error, seeded."""
    torch.manual_seed(0)
    return {**kernel_errors(device), **backend_errors(device), **store_kv_errors(device)}


def failures(errors: dict[str, float]) -> list[str]:
    """The cases over their tolerance (store_kv must be exact)."""
    return [
        name
        for name, error in errors.items()
        if not error <= (0.0 if name == "store_kv" else tolerance(name))
    ]


if __name__ == "__main__":  # the CUDA tests of the GPU check (scripts/gpu_check.sh)
    import sys

    import torch.cuda

    if not torch.cuda.is_available():
        sys.exit("gpu_kernels: no CUDA device (torch.cuda.is_available() is False)")
    errors = all_errors(torch.device("cuda"))
    for name, error in errors.items():
        print(f"{name:32s} {error:.3g}  (tolerance {tolerance(name):.0e})")
    failed = failures(errors)
    print("FAILED: " + ", ".join(failed) if failed else "all kernel cases pass")
    sys.exit(1 if failed else 0)
