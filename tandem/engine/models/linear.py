"""Linear layers with a faster kernel route for the few-row products of decoding on CPU.

With float32 on CPU, `F.linear` on 1-8 rows (small-batch decode, speculative verification of a
few drafts) runs slower than the same product written as `weight @ x.T`, which reaches a
better-blocked GEMM: 1.5-5x for 1-4 rows on every SmolLM2 projection and its LM head (2 threads,
torch 2.13; a single row is padded to two, as the matrix-vector route is the slow one), and for
5-8 rows a SmolLM2 step still takes 29-39 ms instead of 47-67. From 9 rows on, and for bfloat16,
`F.linear` is as fast or faster, and on CUDA it is left alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

MAX_FEW_ROWS = 8

# A linear layer's product bound to its weights: [rows, in] -> [rows, out] (`row_kernel`).
RowKernel = Callable[[torch.Tensor], torch.Tensor]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x of shape [rows, in_features]."""
    rows = x.shape[0]
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or rows > MAX_FEW_ROWS:
        return F.linear(x, weight, bias)
    padded = x.expand(2, -1).contiguous() if rows == 1 else x  # [max(rows, 2), in]
    y = torch.mm(weight, padded.t()).t()[:rows].contiguous()  # [rows, out]
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
