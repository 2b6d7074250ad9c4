"""What the int8 and int4 linear layers share: their kernel for the rows of a decode step, and
dequantize-then-matmul for longer inputs and where there is no kernel."""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.quant.probe import KERNEL_DTYPE

if TYPE_CHECKING:  # tandem.engine.models imports this module
    from tandem.engine.models.linear import RowKernel


class QuantizedLinear(nn.Module):
    """A linear layer over quantized weights; input, bias and output in the model dtype. Up to
    `max_kernel_tokens` rows go through `kernel()` in `KERNEL_DTYPE` (while `use_kernel`), more
    through `dequantize()`."""

    in_features: int
    out_features: int
    max_kernel_tokens: int
    use_kernel: bool
    bias: torch.Tensor | None

    @abstractmethod
    def kernel(self) -> RowKernel | None:
        """The kernel bound to this layer's tensors, [rows, in] -> [rows, out] in
        `KERNEL_DTYPE`; None where there is none."""

    @abstractmethod
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [out, in]
        """The weights as floats."""

    def row_kernel(self, dtype: torch.dtype) -> tuple[RowKernel, int] | None:
        """The kernel call and the most rows `forward` makes it for, where rows of `dtype` go
        straight to it; else None (`Linear.row_kernel`)."""
        kernel = self.kernel() if self.use_kernel else None
        if kernel is None or dtype != KERNEL_DTYPE or self.bias is not None:
            return None
        return kernel, self.max_kernel_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.numel() // self.in_features
        kernel = self.kernel() if self.use_kernel and rows <= self.max_kernel_tokens else None
        if kernel is not None and x.dim() == 2 and x.dtype == KERNEL_DTYPE and self.bias is None:
            return kernel(x)  # a decode step's rows: no reshape or cast around the call
        x2 = x.reshape(-1, self.in_features)  # [num_tokens, in]
        if kernel is not None:
            y = kernel(x2.to(KERNEL_DTYPE)).to(x.dtype)
        else:
            y = F.linear(x2, self.dequantize(x.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)
