"""KV cache formats: the model's float dtype, or int8 / fp8 (e4m3) with a scale per token and head.

A cache is one tensor per layer, `[2, num_blocks, block_size, num_kv_heads, slot_dim]`, in the
cache dtype. In a float cache a slot (one head's key or value of one token) is `head_dim` values.
In a quantized cache (int8 or float8_e4m3fn, one byte per element) a slot is `head_dim` quantized
values followed by the 4 bytes of their float32 scale, `slot_dim = head_dim + 4`:

    x ~= values * scale,    scale = max(|x|) / qmax    (qmax 127 for int8, 448 for e4m3)

With a scale per (token, head) a slot is written once and never rescaled, so prefix-cache
sharing, speculative rollback (rejected slots are overwritten) and preemption treat it like a
float slot, and moving a token's KV anywhere (KV transfer, shared memory) is a byte copy that
carries its scales. A slot costs `head_dim + 4` bytes against `2 * head_dim` in bf16 (0.53x at
head_dim 64). Rounding is to nearest; the int8 error of one element is at most scale / 2.

Slots move through uint8 views: `index_copy_` and `index_select` lack float8 kernels on some
devices, and a byte copy is what a move is anyway. On CPU they move through NumPy, whose
single-threaded gathers and scatters run 4-6x faster than torch's here (8k tokens of one SmolLM2
layer: scatter 2 ms against 12 ms for `index_copy_`), and on a busy host far faster than an
OpenMP parallel copy whose threads wait for each other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from tandem.engine import layer_ops

if TYPE_CHECKING:
    from tandem.model_config import ModelConfig

SCALE_BYTES = 4  # one float32 scale per slot
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in _QMAX


def slot_dim(dtype: torch.dtype, head_dim: int) -> int:
    """Elements of one (token, head) slot in a cache of `dtype`."""
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def head_dim_of(dtype: torch.dtype, slot_dim: int) -> int:
    return slot_dim - SCALE_BYTES if is_quantized(dtype) else slot_dim


def slot_nbytes(dtype: torch.dtype, head_dim: int) -> int:
    return slot_dim(dtype, head_dim) * dtype.itemsize


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """KV cache bytes of one token over all layers, scales included."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * slot_nbytes(dtype, cfg.head_dim)


def encode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values as cache slots: [..., head_dim] -> [..., slot_dim] in `dtype`."""
    if not is_quantized(dtype):
        return x.to(dtype)
    qmax = _QMAX[dtype]
    x = x.float()
    # A floor keeps an all-zero slot's scale a normal float (0 / scale = 0, never NaN). Times
    # the reciprocal: CUDA divides by a scalar that way, so the bytes are the same on any device.
    amax = x.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    scale = amax * (1.0 / qmax)
    q = x / scale
    if not dtype.is_floating_point:
        q = q.round()  # a cast to int truncates
    values = q.clamp(-qmax, qmax).to(dtype).view(torch.uint8)
    return torch.cat((values, scale.view(torch.uint8)), dim=-1).view(dtype)


def decode(slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache slots as keys or values: [..., slot_dim] -> [..., head_dim] in `dtype`."""
    if not is_quantized(slots.dtype):
        return slots.to(dtype)
    head_dim = slots.shape[-1] - SCALE_BYTES
    scale = slots[..., head_dim:].contiguous().view(torch.float32)  # [..., 1]
    # In the target dtype: int8 values are exact in bf16/fp16 and e4m3 ones in any of them; a
    # float32 intermediate costs a pass over the context and gains only the scale's rounding.
    return slots[..., :head_dim].to(dtype) * scale.to(dtype)


def select_slots(cache: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """`cache.index_select(dim, index)` as a byte copy (any dtype; `dim` not the last)."""
    raw = cache.view(torch.uint8)
    if raw.device.type == "cpu":
        return torch.from_numpy(np.take(raw.numpy(), index.numpy(), axis=dim)).view(cache.dtype)
    return raw.index_select(dim, index).view(cache.dtype)


def copy_slots(cache: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> None:
    """`cache.index_copy_(dim, index, src)` as a byte copy; `src` has the cache's dtype."""
    if dim == 0 and src.dtype == cache.dtype and layer_ops.scatter_rows(cache, index, src):
        return
    raw, src_raw = cache.view(torch.uint8), src.view(torch.uint8)
    if raw.device.type == "cpu":
        raw.numpy()[(slice(None),) * dim + (index.numpy(),)] = src_raw.numpy()
    else:
        raw.index_copy_(dim, index, src_raw)
