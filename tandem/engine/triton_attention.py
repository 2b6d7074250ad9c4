"""Triton kernels over the paged KV cache, read in place: one attention kernel for every step.

The cache layout is the runner's (`attention.py`): one tensor per layer,
`[2, num_blocks, block_size, num_kv_heads, head_dim]` in a float dtype. A step's tokens are the
concatenation of its requests' queries (`query_starts`); request b's `query_len` queries sit at
positions `context_len - query_len ..`, after its computed tokens, and each sees the keys at
positions up to its own. So one kernel covers prefill (fresh, chunked or after a prefix-cache hit:
`num_computed_tokens > 0`), decode (one query) and speculative verification (several queries,
causal among them).

A program attends one tile of one request's queries for one KV head, over that request's keys,
`TILE_N` at a time, whose blocks it looks up in the block table as it goes (online softmax,
FlashAttention-style); the
query heads of a KV head (GQA) are folded into the tile's rows, so keys and values are read once
per group. When a step has too few (request, tile, KV head) programs to fill the GPU (decode at
small batch), the context is split over `num_splits` programs whose partial results are merged by
their log-sum-exp (flash-decoding).

`store_kv` writes the step's keys and values into their slots and skips slots < 0: the padding
tokens of a CUDA graph's batch (`cuda_graphs.py`) write nowhere.

Triton is imported here only; the CPU engine never imports this module. Under Triton's
interpreter (`TRITON_INTERPRET=1`, CPU tensors) the kernels compute in float32, since the
interpreter has no bfloat16 arithmetic; on a GPU the dot products take the cache's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Query rows (query tokens x query heads of a KV head) a prefill program attends at most.
MAX_TILE_ROWS = 64
MAX_SPLITS = 16
MIN_DOT = 16  # tl.dot's smallest dimension
# Keys a program attends per iteration, gathered from as many blocks as they span: a larger
# load than one block of 16 keeps more bytes in flight, and any block size works.
TILE_N = 64
DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def tile_shape(max_query_len: int, group: int) -> tuple[int, int]:
    """(query tokens, rows) of one program's tile: rows = tokens x group, padded to a power of 2
    of at least `MIN_DOT`."""
    per_group = max(1, MAX_TILE_ROWS // triton.next_power_of_2(group))
    block_q = min(triton.next_power_of_2(max_query_len), per_group)
    return block_q, max(MIN_DOT, triton.next_power_of_2(block_q * group))


def num_splits_for(num_programs: int, device: torch.device) -> int:
    """Context splits that give a step at least two programs per streaming multiprocessor."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLITS, 2 * sms // max(1, num_programs)))


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [num_tokens, num_heads * head_dim], rows strided
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] of one layer
    v_cache_ptr,
    block_tables_ptr,  # [B, max_blocks]
    query_starts_ptr,  # [B + 1]
    context_lens_ptr,  # [B]
    out_ptr,  # [num_tokens, num_heads * head_dim]; or [splits, num_tokens, num_heads, head_dim]
    lse_ptr,  # [splits, num_tokens, num_heads] float32 (split runs only)
    scale,
    stride_q,
    stride_out,
    stride_block,
    stride_slot,
    stride_head,
    stride_table,
    num_tokens,
    GROUP: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    first_q = tl.program_id(1) * BLOCK_Q
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(query_starts_ptr + b)
    query_len = tl.load(query_starts_ptr + b + 1) - q_start
    if first_q >= query_len:
        return
    num_computed = tl.load(context_lens_ptr + b) - query_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = first_q + rows // GROUP  # [M] query index within the request
    head = kv_head * GROUP + rows % GROUP  # [M] query head
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < query_len)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_q + head[:, None] * HEAD_DIM + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    ).to(DOT_DTYPE)  # [M, D]
    q_pos = num_computed + q_idx  # [M]

    # The tile's last query sees keys [0, kv_len); this split takes its share of their tiles.
    kv_len = num_computed + tl.minimum(first_q + BLOCK_Q, query_len)
    num_tiles = tl.cdiv(kv_len, TILE_N)
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    tile = tl.arange(0, TILE_N)
    for t in range(tile_lo, tile_hi):
        k_pos = t * TILE_N + tile  # [N] key positions; their blocks from the block table
        in_ctx = k_pos < kv_len
        block = tl.load(
            block_tables_ptr + b * stride_table + k_pos // BLOCK_SIZE, mask=in_ctx, other=0
        ).to(tl.int64)
        offsets = (
            block[:, None] * stride_block
            + (k_pos % BLOCK_SIZE)[:, None] * stride_slot
            + kv_head * stride_head
            + dims[None, :]
        )
        kv_mask = in_ctx[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + offsets, mask=kv_mask, other=0.0).to(DOT_DTYPE)  # [N, D]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [M, N] float32
        s = tl.where(k_pos[None, :] <= q_pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + offsets, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    store_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        out_offsets = token[:, None] * stride_out + head[:, None] * HEAD_DIM + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        row = (split * num_tokens + token) * NUM_HEADS + head  # [M] of [splits, tokens, heads]
        tl.store(out_ptr + row[:, None] * HEAD_DIM + dims[None, :], out, mask=store_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=row_ok)


@triton.jit
def _store_kv_kernel(
    k_ptr,  # [num_tokens, num_kv_heads * head_dim], rows strided
    v_ptr,
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] of one layer
    v_cache_ptr,
    slot_mapping_ptr,  # [num_tokens]
    stride_k,
    stride_v,
    stride_block,
    stride_slot,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ELEMENTS_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offsets = tl.arange(0, ELEMENTS_P)  # the token's heads x dims, contiguous in the slot
    mask = offsets < NUM_KV_HEADS * HEAD_DIM
    dst = (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_slot + offsets
    k = tl.load(k_ptr + token * stride_k + offsets, mask=mask)
    v = tl.load(v_ptr + token * stride_v + offsets, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]; < 0: write nothing
) -> None:
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    if k.shape[0] == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _store_kv_kernel[(k.shape[0],)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        v.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        ELEMENTS_P=triton.next_power_of_2(num_kv_heads * head_dim),
        BLOCK_SIZE=block_size,
    )


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads * head_dim], rows may be strided
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, max_blocks] int32 / int64
    query_starts: torch.Tensor,  # [B + 1]: request b's queries are rows [s[b], s[b + 1])
    context_lens: torch.Tensor,  # [B]: its tokens, computed ones and this step's
    max_query_len: int,  # of the step's requests, or more (a CUDA graph's bucket)
    scale: float,
    num_splits: int = 1,
) -> torch.Tensor:  # [num_tokens, num_heads * head_dim] in q's dtype; rows of no request: 0
    """Each request's queries attend causally over its paged context, read in place."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_tokens = q.shape[0]
    num_heads = q.shape[1] // head_dim
    group = num_heads // num_kv_heads
    block_q, block_m = tile_shape(max_query_len, group)
    num_reqs = block_tables.shape[0]
    grid = (num_reqs, triton.cdiv(max_query_len, block_q), num_kv_heads * num_splits)
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = q.new_zeros(num_tokens, num_heads * head_dim)
    if num_splits == 1:
        parts, lse = out, out  # lse unused
    else:
        parts = q.new_zeros(num_splits, num_tokens, num_heads, head_dim, dtype=torch.float32)
        lse = q.new_full((num_splits, num_tokens, num_heads), float("-inf"), dtype=torch.float32)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    on_gpu = q.device.type != "cpu"  # on CPU the kernels run under Triton's interpreter
    dot_dtype = DOT_DTYPES.get(kv_cache.dtype, tl.float32) if on_gpu else tl.float32
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        query_starts,
        context_lens,
        parts,
        lse,
        scale,
        q.stride(0),
        out.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        num_tokens,
        GROUP=group,
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        TILE_N=TILE_N,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        NUM_SPLITS=num_splits,
        DOT_DTYPE=dot_dtype,
        PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
    )
    if num_splits == 1:
        return out
    # Merge the splits by their log-sum-exp; a split that saw no key has lse -inf, weight 0.
    top = lse.amax(0).clamp(min=torch.finfo(torch.float32).min)  # [tokens, heads]
    weights = torch.exp(lse - top)  # [splits, tokens, heads]
    merged = (parts * weights[..., None]).sum(0) / weights.sum(0).clamp(min=1e-30)[..., None]
    return merged.view(num_tokens, -1).to(q.dtype)
