"""Attention over the paged KV cache, behind a small backend interface.

The runner builds one `AttentionMetadata` per step (shared by every layer); each layer then calls
`backend.forward`, which writes the step's new keys/values into their slots and attends over each
request's whole context. `TorchSDPABackend` is the portable implementation (CPU, tests, any CUDA
device); `TritonPagedBackend` runs Triton kernels that read the blocks in place
(`triton_attention.py`, imported only when that backend is built) and is what a CUDA engine
takes by default (`backend_class`: `attention_backend="auto"`), SDPA staying its fallback.

KV cache layout, one tensor per layer: `[2, num_blocks, block_size, num_kv_heads, slot_dim]`;
`slot_dim = head_dim` in a float cache, and a quantized cache (int8, fp8) appends each slot's
scale (`kv_quant.py`). Keys/values are encoded into the cache's format as they are written and
decoded to the compute dtype as they are read; a quantized cache is read back even by a fresh
prompt, so every query sees the same KV whether its prompt was chunked, prefix-cached, recomputed
or transferred. Query heads are grouped per KV head (GQA) by folding the group into the
query-length axis, so keys and values are never repeated.

On CPU the batched short queries go to a compiled kernel that reads the paged blocks in place
(`cpu_attention.py`) when it is built and the step suits it (`KERNEL_WORK_RATIO`); SDPA over
gathered blocks is the path everywhere else.
"""

from __future__ import annotations

import functools
import importlib.util
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.engine import cpu_attention
from tandem.engine.kv_quant import copy_slots, decode, encode, is_quantized, select_slots

# Requests whose step covers at most this many tokens (decodes, speculative verification) attend
# together in one padded SDPA call; longer prefill chunks attend one request at a time.
MAX_BATCHED_QUERY_LEN = 16
# The CPU kernel's work grows with query rows x context (sum of context_len * query_len), SDPA's
# mostly with the gathered, padded context (batch x longest context). Measured on SmolLM2's heads,
# bf16, 2 threads, 400-1400-token contexts, per layer, kernel against SDPA (the vectorized kernel
# of 3 Dec): 16 decodes 1.0 ms against 4.4, 16 x 6 queries 3.7 against 6.0, 16 x 16 13.7 against
# 18.6, 4 x 11 2.2 against 2.9; 4 x 16 3.3 against 3.0 and 2 x 16 2.3 against 1.6 (rows x context
# 13-14 times the padded context); one request of 6 queries 0.28 against 0.43. So the kernel
# takes a step whose rows x context is at most this many times the padded context, and any lone
# request.
KERNEL_WORK_RATIO = 12


@dataclass(frozen=True)
class SeqSpec:
    """One request's part of a step: `query_len` new tokens after `num_computed_tokens`."""

    num_computed_tokens: int
    query_len: int
    block_table: list[int]

    @property
    def context_len(self) -> int:
        return self.num_computed_tokens + self.query_len


@dataclass
class BatchedGroup:
    """Short-query requests attended in one padded call; their tokens are `token_slice`."""

    token_slice: slice
    block_tables: torch.Tensor  # [B, max_blocks] int64
    mask: torch.Tensor | None  # [B, 1, group * max_q, max_ctx] bool; None for equal decodes
    query_len: int  # max_q
    context_len: int  # max_ctx
    pad_index: torch.Tensor | None  # [num_tokens_in_group] rows of the padded [B * max_q] layout
    context_lens: torch.Tensor  # [B] int64
    query_starts: torch.Tensor  # [B + 1] int64: request b's tokens are [s[b], s[b + 1])
    kernel: bool  # attended by the CPU kernel (built, a CPU device, and cheaper there than SDPA)


@dataclass
class LongSeq:
    """A prefill chunk attended on its own."""

    token_slice: slice
    num_computed_tokens: int
    block_table: torch.Tensor  # [num_blocks] int64
    mask: torch.Tensor  # [1, 1, group * query_len, context_len] bool, causal


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat slot = block_id * block_size + offset
    batched: BatchedGroup | None
    long_seqs: list[LongSeq]


@dataclass
class PagedMetadata(AttentionMetadata):
    """`TritonPagedBackend`'s: the requests' block tables and lengths, read by its kernel; the
    SDPA fields stay empty."""

    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_starts: torch.Tensor  # [B + 1] int32: request b's tokens are [s[b], s[b + 1])
    context_lens: torch.Tensor  # [B] int32
    max_query_len: int
    num_splits: int  # programs the kernel splits each request's context over


class AttentionBackend(ABC):
    """Builds per-step metadata once and runs attention for every layer."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.scale = head_dim**-0.5

    @abstractmethod
    def build_metadata(self, seqs: list[SeqSpec], device: torch.device) -> AttentionMetadata:
        """`seqs` in token order: the step's tokens are the concatenation of their queries."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, slot_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        ...


def slot_mapping_for(seqs: list[SeqSpec], block_size: int) -> list[int]:
    slots: list[int] = []
    for s in seqs:
        for pos in range(s.num_computed_tokens, s.context_len):
            slots.append(s.block_table[pos // block_size] * block_size + pos % block_size)
    return slots


@dataclass(frozen=True)
class PagedLists:
    """A step's attention inputs as plain ints (`paged_lists`), before they become tensors."""

    slot_mapping: list[int]  # [num_tokens]
    block_tables: list[list[int]]  # [B][max_blocks], each padded with block 0
    query_starts: list[int]  # [B + 1]
    context_lens: list[int]  # [B]


def paged_lists(seqs: list[SeqSpec], block_size: int) -> PagedLists:
    width = max((-(-s.context_len // block_size) for s in seqs), default=0)
    starts = [0]
    for s in seqs:
        starts.append(starts[-1] + s.query_len)
    return PagedLists(
        slot_mapping_for(seqs, block_size),
        [pad_table(s.block_table[:width], width) for s in seqs],
        starts,
        [s.context_len for s in seqs],
    )


def pad_table(table: list[int], width: int) -> list[int]:
    return table + [0] * (width - len(table))


class TorchSDPABackend(AttentionBackend):
    """`torch.nn.functional.scaled_dot_product_attention` over gathered KV blocks."""

    def build_metadata(self, seqs: list[SeqSpec], device: torch.device) -> AttentionMetadata:
        slot_mapping = torch.tensor(slot_mapping_for(seqs, self.block_size), device=device)
        # Short queries first (the runner orders them so), as one padded batch.
        n_short = 0
        while n_short < len(seqs) and seqs[n_short].query_len <= MAX_BATCHED_QUERY_LEN:
            n_short += 1
        batched = self._batched_group(seqs[:n_short], device) if n_short else None
        long_seqs = []
        start = sum(s.query_len for s in seqs[:n_short])
        for s in seqs[n_short:]:
            n_blocks = -(-s.context_len // self.block_size)
            table = torch.tensor(s.block_table[:n_blocks], device=device)
            q_pos = torch.arange(s.query_len, device=device) + s.num_computed_tokens
            k_pos = torch.arange(s.context_len, device=device)
            mask = (k_pos[None, :] <= q_pos[:, None]).repeat(self.num_heads // self.num_kv_heads, 1)
            tokens = slice(start, start + s.query_len)
            long_seqs.append(LongSeq(tokens, s.num_computed_tokens, table, mask[None, None]))
            start += s.query_len
        return AttentionMetadata(slot_mapping, batched, long_seqs)

    def _batched_group(self, seqs: list[SeqSpec], device: torch.device) -> BatchedGroup:
        bs = self.block_size
        max_q = max(s.query_len for s in seqs)
        max_ctx = max(s.context_len for s in seqs)
        max_blocks = -(-max_ctx // bs)
        tables = [pad_table(s.block_table[:max_blocks], max_blocks) for s in seqs]
        work = sum(s.context_len * s.query_len for s in seqs)
        kernel = cpu_attention.runs_on(device, bs) and (
            len(seqs) == 1 or work <= KERNEL_WORK_RATIO * len(seqs) * max_ctx
        )
        mask = pad_index = None  # the kernel needs neither
        if not kernel and (max_q > 1 or any(s.context_len != max_ctx for s in seqs)):
            # Query row i of a request sits at position context_len - query_len + i (right-aligned
            # in the padded layout); it sees keys at positions <= its own.
            q_pos = torch.tensor([s.context_len - max_q for s in seqs], device=device)
            q_pos = q_pos[:, None] + torch.arange(max_q, device=device)  # [B, max_q]
            k_pos = torch.arange(max_ctx, device=device)
            mask = (k_pos[None, None, :] <= q_pos[:, :, None])[:, None]  # [B, 1, max_q, ctx]
            pad_rows = [
                b * max_q + max_q - s.query_len + i
                for b, s in enumerate(seqs)
                for i in range(s.query_len)
            ]
            if len(pad_rows) != len(seqs) * max_q:
                pad_index = torch.tensor(pad_rows, device=device)
                # Padded query rows attend to position 0 only, so softmax stays finite.
                mask[:, :, :, 0] = True
            mask = mask.repeat(1, 1, self.num_heads // self.num_kv_heads, 1)  # rows (group, q)
        starts = [0]
        for s in seqs:
            starts.append(starts[-1] + s.query_len)
        return BatchedGroup(
            slice(0, starts[-1]),
            torch.tensor(tables, device=device),
            mask,
            max_q,
            max_ctx,
            pad_index,
            torch.tensor([s.context_len for s in seqs], device=device),
            torch.tensor(starts, device=device),
            kernel,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hkv, d = self.num_kv_heads, self.head_dim
        group = self.num_heads // hkv
        # Write this step's keys/values into their slots.
        flat = kv_cache.view(2, -1, hkv, kv_cache.shape[-1])  # [2, num_slots, hkv, slot_dim]
        copy_slots(flat[0], 0, meta.slot_mapping, encode(k.view(-1, hkv, d), kv_cache.dtype))
        copy_slots(flat[1], 0, meta.slot_mapping, encode(v.view(-1, hkv, d), kv_cache.dtype))
        b = meta.batched
        if b is not None and not meta.long_seqs:  # decodes and verifications only
            return self._batched(q, kv_cache, b, group)
        out = q.new_empty(q.shape)
        if b is not None:
            out[b.token_slice] = self._batched(q[b.token_slice], kv_cache, b, group)
        for s in meta.long_seqs:
            out[s.token_slice] = self._long(
                q[s.token_slice], k[s.token_slice], v[s.token_slice], kv_cache, s, group
            )
        return out

    def _batched(
        self, q: torch.Tensor, kv_cache: torch.Tensor, b: BatchedGroup, group: int
    ) -> torch.Tensor:
        hkv, d = self.num_kv_heads, self.head_dim
        num_b, max_q = b.block_tables.shape[0], b.query_len
        if b.kernel:
            return cpu_attention.paged_attention(
                q, kv_cache, b.block_tables, b.context_lens, b.query_starts, d, self.scale
            )
        if b.pad_index is not None:
            padded = q.new_zeros(num_b * max_q, q.shape[1])
            q = padded.index_copy_(0, b.pad_index, q)
        # [B, max_q, hkv, group, d] -> [B, hkv, group * max_q, d]
        qh = (
            q.view(num_b, max_q, hkv, group, d)
            .permute(0, 2, 3, 1, 4)
            .reshape(num_b, hkv, group * max_q, d)
        )
        keys = _gather(kv_cache[0], b.block_tables, q.dtype, b.context_len).transpose(1, 2)
        values = _gather(kv_cache[1], b.block_tables, q.dtype, b.context_len).transpose(1, 2)
        o = F.scaled_dot_product_attention(qh, keys, values, attn_mask=b.mask, scale=self.scale)
        # [B, hkv, group * max_q, d] -> [B * max_q, hkv * group * d]
        o = o.view(num_b, hkv, group, max_q, d).permute(0, 3, 1, 2, 4).reshape(num_b * max_q, -1)
        return o if b.pad_index is None else o[b.pad_index]

    def _long(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        s: LongSeq,
        group: int,
    ) -> torch.Tensor:
        hkv, d = self.num_kv_heads, self.head_dim
        n = q.shape[0]
        # [n, hkv, group, d] -> [1, hkv, group * n, d]
        qh = q.view(n, hkv, group, d).permute(1, 2, 0, 3).reshape(1, hkv, group * n, d)
        if s.num_computed_tokens == 0 and not is_quantized(kv_cache.dtype):
            keys, values = k.view(n, hkv, d), v.view(n, hkv, d)
        else:
            ctx = s.num_computed_tokens + n
            keys = _gather(kv_cache[0], s.block_table, q.dtype, ctx)
            values = _gather(kv_cache[1], s.block_table, q.dtype, ctx)
        keys, values = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(qh, keys, values, attn_mask=s.mask, scale=self.scale)
        return o.view(hkv, group, n, d).permute(2, 0, 1, 3).reshape(n, -1)


class TritonPagedBackend(AttentionBackend):
    """Triton kernels over the paged cache, read in place (`triton_attention.py`): one launch
    per layer attends every request of the step, whatever its query length."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, block_size)
        from tandem.engine import triton_attention  # Triton only where this backend runs

        if head_dim < triton_attention.MIN_DOT:
            raise ValueError(f"the Triton kernels need head_dim >= 16, not {head_dim}")
        self.kernels = triton_attention

    def build_metadata(self, seqs: list[SeqSpec], device: torch.device) -> PagedMetadata:
        lists = paged_lists(seqs, self.block_size)
        max_q = max((s.query_len for s in seqs), default=1)

        def tensor(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return PagedMetadata(
            tensor(lists.slot_mapping, torch.int64),
            None,
            [],
            tensor(lists.block_tables, torch.int32),
            tensor(lists.query_starts, torch.int32),
            tensor(lists.context_lens, torch.int32),
            max_q,
            self.num_splits(len(seqs), max_q, device),
        )

    def num_splits(self, num_reqs: int, max_query_len: int, device: torch.device) -> int:
        """Programs each request's context is split over (one, unless the step has too few
        programs to fill the GPU)."""
        block_q, _ = self.kernels.tile_shape(max_query_len, self.num_heads // self.num_kv_heads)
        programs = num_reqs * -(-max_query_len // block_q) * self.num_kv_heads
        return int(self.kernels.num_splits_for(programs, device))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        assert isinstance(meta, PagedMetadata), "metadata of another backend"
        self.kernels.store_kv(k, v, kv_cache, meta.slot_mapping)
        out: torch.Tensor = self.kernels.paged_attention(
            q,
            kv_cache,
            meta.block_tables,
            meta.query_starts,
            meta.context_lens,
            meta.max_query_len,
            self.scale,
            meta.num_splits,
        )
        return out


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def backend_class(name: str, device: torch.device, kv_dtype: torch.dtype) -> type[AttentionBackend]:
    """The backend `attention_backend=name` ("auto" | "triton" | "sdpa") means for an engine on
    `device` with a cache of `kv_dtype`: "auto" takes the Triton kernels where they apply (CUDA,
    a float cache, Triton installed) and SDPA elsewhere; "triton" where they do not apply is a
    ValueError that says why."""
    unfit = None
    if device.type != "cuda":
        unfit = f"needs a CUDA device, not {device.type!r}"
    elif is_quantized(kv_dtype):
        unfit = f"reads float caches only, not {kv_dtype}"
    elif not triton_installed():
        unfit = "needs the triton package"
    if name == "sdpa" or (name == "auto" and unfit is not None):
        return TorchSDPABackend
    if unfit is not None:
        raise ValueError(f"attention_backend 'triton' {unfit}")
    return TritonPagedBackend


def _gather(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, slot_dim], one layer's K or V
    block_ids: torch.Tensor,  # [num_blocks_per_seq] or [B, num_blocks_per_seq]
    dtype: torch.dtype,
    context_len: int,
) -> torch.Tensor:  # [context_len, hkv, head_dim] or [B, context_len, hkv, head_dim], in dtype
    """The first `context_len` tokens of the blocks `block_ids`, decoded to `dtype`.

    `index_select` over a 2-D view copies each block as one contiguous row; on CPU it is ~6x
    faster than advanced indexing of the 4-D cache.
    """
    rows = cache.view(cache.shape[0], -1)  # [num_blocks, block_size * num_kv_heads * slot_dim]
    blocks = select_slots(rows, 0, block_ids.reshape(-1))
    tokens = blocks.view(*block_ids.shape[:-1], -1, *cache.shape[2:])
    return decode(tokens[..., :context_len, :, :], dtype)
