"""Short-query attention over the paged KV cache by the compiled kernel
(`csrc/paged_attention.cpp`, built by `native.py`).

Decodes and speculative verifications read every request's whole context each step; gathering
those blocks into a padded copy and running SDPA over it (`TorchSDPABackend`'s portable path)
costs three passes over the context plus the padding, which at batch 16 of ~800-token prompts
took most of a step. The kernel reads the blocks where they are, once for keys and once for
values, and dequantizes int8 / fp8 slots as it reads them. Without the extension, or with
`TANDEM_CPU_ATTENTION=sdpa`, CPU attention stays on the portable path.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from tandem.config import cpu_attention_kernel
from tandem.engine import layer_ops, native

MAX_BLOCK_SIZE = 64  # the kernel's `kMaxBlockSize`


@functools.cache  # asked every step and every layer: the environment is read once
def kernel() -> ModuleType | None:
    """The extension that holds the kernel, or None (switched off, or not built)."""
    return native.extension() if cpu_attention_kernel() else None


def runs_on(device: torch.device, block_size: int) -> bool:
    """Whether the kernel runs attention over caches of `block_size` on `device`."""
    return device.type == "cpu" and block_size <= MAX_BLOCK_SIZE and kernel() is not None


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads * head_dim], the requests' queries in order (rows
    # may be strided: a view of the fused qkv output)
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, slot_dim]
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    context_lens: torch.Tensor,  # [B] int64
    query_starts: torch.Tensor,  # [B + 1] int64: request b's queries are rows [s[b], s[b+1])
    head_dim: int,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads * head_dim] in q's dtype
    ext = kernel()
    assert ext is not None, "check runs_on() first"
    rows = q if q.dtype in layer_ops.NATIVE_DTYPES else q.float()
    out: torch.Tensor = ext.paged_attention(
        rows if rows.stride(-1) == 1 else rows.contiguous(),
        kv_cache[0],
        kv_cache[1],
        block_tables,
        context_lens,
        query_starts,
        head_dim,
        scale,
    )
    return out.to(q.dtype)
