"""Linear layers with faster routes for the few-row products of decoding on CPU.

With float32 on CPU, a decode step's products (1-32 rows: small-batch decode, speculative
verification of a few drafts) are bound by reading the weights, and `F.linear` is far from that
bound. Two routes, by rows:

- 1-2 rows: `weight @ x.T`, a single row padded to two (torch's matrix-vector route is the slow
  one): 1.5-5x `F.linear` on every SmolLM2 projection and its LM head, near the machine's read
  bandwidth (2 threads, torch 2.13).
- 3-32 rows: the native `row_gemm` (csrc/row_gemm.cpp), which reads each weight once per 8 rows.
  Per call on SmolLM2 in the engine, against `weight @ x.T`: 228 us against 287 at 3 rows, 304
  against 481 at 8, 453 against 741 at 16, 783 against 989 at 32; decode throughput at batch
  8 / 16 / 32 went from 92 / 115 / 147 to 127 / 153 / 167 tok/s (same tokens). At 1-2 rows it
  was 2-5% slower, so those keep the route above.

From 33 rows on (prefill chunks), for bfloat16, for tensors that need gradients, without the
native extension and on CUDA, `F.linear` runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine import native

MATVEC_MAX_ROWS = 2  # up to here `weight @ x.T`
MAX_FEW_ROWS = 32  # up to here `row_gemm`

# A linear layer's product bound to its weights: [rows, in] -> [rows, out] (`row_kernel`).
RowKernel = Callable[[torch.Tensor], torch.Tensor]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x of shape [rows, in_features]."""
    rows = x.shape[0] if x.dim() == 2 else 0
    if x.device.type != "cpu" or x.dtype != torch.float32 or not 1 <= rows <= MAX_FEW_ROWS:
        return F.linear(x, weight, bias)
    if rows <= MATVEC_MAX_ROWS:
        padded = x.expand(2, -1).contiguous() if rows == 1 else x  # [2, in]
        y = torch.mm(weight, padded.t()).t()[:rows].contiguous()
    else:
        ext = native.extension()
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        if ext is None or needs_grad or not weight.is_contiguous():
            return F.linear(x, weight, bias)
        y = ext.row_gemm(x, weight)
    return y if bias is None else y + bias


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def row_kernel(self, dtype: torch.dtype) -> tuple[RowKernel, int] | None:
        """The call `forward` makes for 2-D inputs of `dtype`, bound to this layer's tensors, and
        the most rows it holds for (any); every linear layer of the decoder has this method
        (`models/decode_plan.py` calls it once, not per step)."""
        weight, bias = self.weight, self.bias
        return (lambda x: linear(x, weight, bias)), 1 << 62
