"""int8 weights with one scale per output channel: w ~= q * scale, q in [-127, 127] (symmetric).

Kernels: the native tiled kernel (`tiles.py`), and
`torch.ops.aten._weight_int8pack_mm(x, q, scales)` = `(x @ q.T) * scales`, with `q` the int8
`[out, in]` matrix as stored (no repacking) and `x` and `scales` in the same floating dtype
(float32, bfloat16 or float16; the output comes in that dtype), here bfloat16 (`probe.py`). It
reads 1 byte per weight, but it does not batch rows: its time grows linearly with the number of
tokens, so past the layer's `max_kernel_tokens` (`KERNEL_MAX_TOKENS`: a long prefill) it
dequantizes and runs one dense matmul instead. Fallback, also used where the kernel is
unavailable: dequantize to the activation dtype, then `F.linear`. On CPU the route of each row
bucket is measured among these (`routes.py`); the thresholds here are the defaults, and the
routes of CUDA.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tandem.engine.quant import tiles
from tandem.engine.quant.layer import QuantizedLinear
from tandem.engine.quant.probe import KERNEL_DTYPE, kernel_agrees

if TYPE_CHECKING:  # tandem.engine.models imports this module
    from tandem.engine.models.linear import RowKernel
    from tandem.engine.tp.group import TPGroup

# Above this many tokens dequantize-then-matmul is faster than the kernel. Measured with
# SmolLM2's four layer shapes x 30 layers, bfloat16, 2 threads: at 8 tokens the kernel took 14 ms
# a step against 40 ms, at 32 tokens 47 ms against 49 ms, at 128 tokens 180 ms against 94 ms.
KERNEL_MAX_TOKENS = 32


@dataclass(frozen=True)
class Int8Weight:
    qweight: torch.Tensor  # [out_features, in_features] int8
    scales: torch.Tensor  # [out_features] float32

    def dequantize(self) -> torch.Tensor:  # [out_features, in_features] float32
        return self.qweight.float() * self.scales[:, None]


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Round each row to the nearest multiple of its absolute maximum / 127."""
    w = weight.float()  # [out, in]
    # A row of zeros keeps a positive scale (and codes of 0) rather than dividing by zero.
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # [out]
    qweight = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(qweight, scales)


@functools.cache
def kernel_works(device: torch.device) -> bool:
    """Whether `_weight_int8pack_mm` runs on `device` and computes what it should."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(3, 64, generator=gen, device=device).to(KERNEL_DTYPE)  # [tokens, in]
    weight = quantize_int8(torch.randn(32, 64, generator=gen, device=device))
    scales = weight.scales.to(KERNEL_DTYPE)
    return kernel_agrees(
        f"_weight_int8pack_mm on {device}",
        lambda: torch.ops.aten._weight_int8pack_mm(x, weight.qweight, scales),
        lambda: F.linear(x.float(), weight.qweight.float() * scales.float()[:, None]),
    )


class Int8Linear(QuantizedLinear):
    """A linear layer over int8 weights; input, bias and output in `dtype`, scales in
    bfloat16; `tp`: a row-parallel layer's group (`layer.py`)."""

    def __init__(
        self,
        weight: Int8Weight,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        device: torch.device,
        max_kernel_tokens: int = KERNEL_MAX_TOKENS,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.model_dtype = dtype
        self.tp = tp
        self.out_features, self.in_features = weight.qweight.shape
        self.max_kernel_tokens = max_kernel_tokens  # more tokens dequantize (or go elsewhere)
        self.qweight: torch.Tensor
        self.scales: torch.Tensor
        self.tiles: torch.Tensor | None
        self.tile_scales: torch.Tensor | None
        self.register_buffer("qweight", weight.qweight.to(device))
        self.register_buffer("scales", weight.scales.to(device, KERNEL_DTYPE))
        self.register_buffer("bias", None if bias is None else bias.to(device, dtype))
        tiled = tiles.supported(device, self.out_features, self.in_features)
        tiled_weights = tiles.tile_int8(self.qweight, self.scales) if tiled else (None, None)
        self.register_buffer("tiles", tiled_weights[0])
        self.register_buffer("tile_scales", tiled_weights[1])
        self.use_kernel = tiled or kernel_works(device)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [out, in]
        return self.qweight.to(dtype) * self.scales.to(dtype)[:, None]

    def kernel(self) -> RowKernel | None:
        return self.tile_kernel() or self.torch_kernel()

    def torch_kernel_runs(self) -> bool:
        return kernel_works(self.qweight.device)

    def torch_kernel(self) -> RowKernel | None:
        if not self.torch_kernel_runs():
            return None
        qweight, scales, mm = self.qweight, self.scales, torch.ops.aten._weight_int8pack_mm
        return lambda x: mm(x, qweight, scales)

    def drop_packed(self) -> None:
        pass  # the kernel reads the int8 weights as stored

    def scale_tensors(self) -> list[torch.Tensor]:
        return [self.scales]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"
