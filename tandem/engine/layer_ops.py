"""The elementwise work of a decoder layer: RMSNorm (with the residual add before it),
SiLU-and-multiply, and the write of new keys / values into their KV slots (RoPE: `rope.py`).

A small-batch decode step spends more time dispatching these tiny ops than computing them: on
SmolLM2 at batch 1 (bf16, 2 threads), an RMSNorm took ~19 us as torch's ~6 ops, RoPE ~24 us as
~10, while the int4 projection beside them takes ~40 us. On CPU, with the native extension built
(`csrc/layer_ops.cpp`), each is one call that reads its inputs once and rounds once; elsewhere
(CUDA, no extension, other dtypes, autograd) the torch ops run. The fused ops compute in float32
and round once; torch's bfloat16 / float16 SiLU and RoPE round after every op, so the two agree
up to that rounding (`tests/unit/test_layer_ops.py`).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from tandem.engine import native

NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def extension_for(*tensors: torch.Tensor) -> ModuleType | None:
    """The extension, if it takes these tensors: CPU (checked first: other devices never build
    it), a float dtype it knows, rows whose elements are contiguous, and no autograd (training
    runs the torch ops); else None."""
    if not all(t.device.type == "cpu" for t in tensors):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    if not all(t.dtype in NATIVE_DTYPES and t.stride(-1) == 1 for t in tensors):
        return None
    return native.extension()


def rms_norm(
    x: torch.Tensor,  # [rows, hidden]
    weight: torch.Tensor,  # [hidden] float32
    eps: float,
    dtype: torch.dtype,
) -> torch.Tensor:  # [rows, hidden] in dtype
    """RMSNorm of x's rows in float32, returned in `dtype`."""
    ext = extension_for(x, weight) if x.dim() == 2 and weight.dtype == torch.float32 else None
    if ext is not None:
        out: torch.Tensor = ext.rms_norm(x, None, weight, eps, dtype)
        return out
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(dtype)


def add_rms_norm(
    x: torch.Tensor,  # [rows, hidden] float32, the residual stream
    delta: torch.Tensor,  # [rows, hidden] a sublayer's output
    weight: torch.Tensor,
    eps: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # x + delta, and its RMSNorm in dtype
    """The residual add and the next norm in one pass; natively x takes the sum in place (the
    caller hands its residual stream over)."""
    fits = x.dim() == 2 and x.dtype == weight.dtype == torch.float32 and x.is_contiguous()
    ext = extension_for(x, delta, weight) if fits else None
    if ext is not None:
        return x, ext.rms_norm(x, delta, weight, eps, dtype)
    x = x + delta
    return x, rms_norm(x, weight, eps, dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [rows, 2 * inter] -> [rows, inter]
    """silu(gate) * up for `gate_up` = [gate | up] (the fused MLP projection's output)."""
    ext = extension_for(gate_up) if gate_up.dim() == 2 else None
    if ext is not None:
        out: torch.Tensor = ext.silu_mul(gate_up)
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def scatter_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> bool:
    """dst[index[i]] = src[i] over whole rows, as bytes, where the extension runs it (CPU, dst
    contiguous, each src row contiguous, int64 index): returns whether it did."""
    if dst.device.type != "cpu" or src.device.type != "cpu" or index.device.type != "cpu":
        return False
    if index.dtype != torch.int64 or not dst.is_contiguous() or src.dim() != dst.dim():
        return False
    if src.shape[0] and not src[0].is_contiguous():
        return False
    ext = native.extension()
    if ext is None:
        return False
    ext.scatter_rows(dst, index, src)
    return True
