"""The elementwise work of a decoder layer: RMSNorm (with the residual add before it),
SiLU-and-multiply, and the write of new keys / values into their KV slots (RoPE: `rope.py`).

A small-batch decode step spends more time dispatching these tiny ops than computing them: on
SmolLM2 at batch 1 (bf16, 2 threads), an RMSNorm took ~19 us as torch's ~6 ops, RoPE ~24 us as
~10, while the int4 projection beside them takes ~40 us. On CPU, with the native extension built
(`csrc/layer_ops.cpp`), each is one call that reads its inputs once and rounds once; elsewhere
(CUDA, no extension, other dtypes) the torch ops run. Both compute in float32: they agree up to
the rounding of the output dtype (`tests/unit/test_layer_ops.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.engine import native

NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def takes(*tensors: torch.Tensor) -> bool:
    """Whether the extension takes these tensors: built, CPU, a float dtype it knows, rows whose
    elements are contiguous, and no autograd (training runs the torch ops)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return native.extension() is not None and all(
        t.device.type == "cpu" and t.dtype in NATIVE_DTYPES and t.stride(-1) == 1 for t in tensors
    )


def rms_norm(
    x: torch.Tensor,  # [rows, hidden]
    weight: torch.Tensor,  # [hidden] float32
    eps: float,
    dtype: torch.dtype,
) -> torch.Tensor:  # [rows, hidden] in dtype
    """RMSNorm of x's rows in float32, returned in `dtype`."""
    ext = native.extension()
    if ext is not None and x.dim() == 2 and takes(x, weight):
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
    ext = native.extension()
    if ext is not None and x.dim() == 2 and x.dtype == torch.float32 and takes(x, delta, weight):
        return x, ext.rms_norm(x, delta, weight, eps, dtype)
    x = x + delta
    return x, rms_norm(x, weight, eps, dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [rows, 2 * inter] -> [rows, inter]
    """silu(gate) * up for `gate_up` = [gate | up] (the fused MLP projection's output)."""
    ext = native.extension()
    if gate_up.dim() == 2 and ext is not None and takes(gate_up):
        out: torch.Tensor = ext.silu_mul(gate_up)
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def scatter_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> bool:
    """dst[index[i]] = src[i] over whole rows, as bytes, where the extension runs it (CPU, dst
    contiguous, each src row contiguous): returns whether it did."""
    ext = native.extension()
    if (
        ext is None
        or dst.device.type != "cpu"
        or src.device.type != "cpu"
        or not dst.is_contiguous()
        or src.dim() != dst.dim()
        or (src.shape[0] and not src[0].is_contiguous())
    ):
        return False
    ext.scatter_rows(dst, index, src)
    return True
