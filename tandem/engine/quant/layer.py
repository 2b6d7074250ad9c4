"""What the int8 and int4 linear layers share: on CPU, the routes `routes.bind` gives them, one
per row bucket (the native tiles, torch's packed kernel, dequantize-then-matmul in bfloat16 or
float32); elsewhere, and before `bind`, their device kernel for the rows of a decode step and
dequantize-then-matmul for longer inputs and where there is no kernel.

A row-parallel layer under tensor parallelism (`tp`: o_proj and down_proj, whose input channels
are split over the ranks) sums the ranks' products with one all-reduce. On CPU its routes give
each rank's partial sum in float32, unrounded, and the sum rounds once, where the single-device
route rounds its product (to bfloat16 after the kernels, to the model dtype after
dequantize-then-matmul): the layer's output equals the single-device one up to the order of
float32 sums. torch's packed kernels give bfloat16 only: they are no route of a row-parallel
layer. Elsewhere (CUDA) the ranks' products are summed as they come."""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine import routes
from tandem.engine.quant import tiles
from tandem.engine.quant.probe import KERNEL_DTYPE

if TYPE_CHECKING:  # tandem.engine.models imports this module
    from tandem.engine.models.linear import RowKernel
    from tandem.engine.tp.group import TPGroup


class QuantizedLinear(nn.Module):
    """A linear layer over quantized weights; input, bias and output in the model dtype. Up to
    `max_kernel_tokens` rows go through `kernel()` in `KERNEL_DTYPE` (while `use_kernel`), more
    through `dequantize()`."""

    in_features: int
    out_features: int
    qweight: torch.Tensor
    model_dtype: torch.dtype  # of the inputs, bias and outputs
    max_kernel_tokens: int
    use_kernel: bool
    bias: torch.Tensor | None
    tiles: torch.Tensor | None
    tile_scales: torch.Tensor | None
    tp: TPGroup | None  # a row-parallel layer's group (the module docstring)
    chosen: routes.RouteSet | None = None  # by routes.bind
    _route_calls: tuple[RowKernel, ...] | None = None

    @abstractmethod
    def kernel(self) -> RowKernel | None:
        """The device kernel bound to this layer's tensors, [rows, in] -> [rows, out] in
        `KERNEL_DTYPE`; None where there is none."""

    @abstractmethod
    def torch_kernel_runs(self) -> bool:
        """Whether torch's packed weight-only kernel runs for this layer on its device."""

    @abstractmethod
    def torch_kernel(self) -> RowKernel | None:
        """torch's packed weight-only kernel on this layer's weights (packed on first use), or
        None where it does not run."""

    def tile_kernel(self, float32_out: bool = False) -> RowKernel | None:
        """The native tiles' kernel on this layer's tiles (its sums rounded to bfloat16, or
        float32 ones), or None where there are none."""
        weight_tiles, scales_zeros = self.tiles, self.tile_scales
        if weight_tiles is None or scales_zeros is None:
            return None
        return tiles.TileCall(weight_tiles, scales_zeros, self.tile_group, float32_out)

    @abstractmethod
    def drop_packed(self) -> None:
        """Forget the torch kernel's copy of the weights."""

    @property
    def tile_group(self) -> int:
        """The input channels of a scale in the tiles."""
        return self.in_features

    @abstractmethod
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [out, in]
        """The weights as floats."""

    # routes.Routed
    @property
    def route_kind(self) -> str | None:
        return None if self.qweight.device.type != "cpu" else self.method

    @property
    def method(self) -> str:
        return "int8"

    @property
    def shape_key(self) -> str:
        bias = " bias" if self.bias is not None else ""
        partial = " partial" if self.tp is not None else ""  # float32 products, other routes
        shape = f"{self.out_features}x{self.in_features} g{self.tile_group}"
        return f"{self.method} {shape}{bias}{partial}"

    @property
    def activation_dtype(self) -> torch.dtype:
        return self.model_dtype

    def available_routes(self) -> frozenset[str]:
        names = {"dequant", "dequant_fp32"}
        if self.tiles is not None:
            names.add("quant_gemm")
        if self.torch_kernel_runs() and self.tp is None:
            names.add("torch_packed")
        return frozenset(names)

    def route_call(self, name: str) -> RowKernel:
        """The route's product of rows [rows, in] -> [rows, out] in the model dtype, bias
        excluded; the kernels take them in bfloat16 (`probe.py`). A row-parallel layer's: this
        rank's partial sum in float32, rounded nowhere (`rounding` says where it rounds once
        summed)."""
        if self.tp is not None:
            if name == "quant_gemm":
                sums = self.tile_kernel(float32_out=True)
                assert sums is not None
                return lambda x: sums(x.to(KERNEL_DTYPE))
            weights = self.model_dtype if name == "dequant" else torch.float32  # as rounded here
            return lambda x: F.linear(x.float(), self.dequantize(weights).float())
        if name in ("quant_gemm", "torch_packed"):
            kernel = self.kernel_of(name)
            if self.model_dtype == KERNEL_DTYPE:
                return kernel
            return lambda x: kernel(x.to(KERNEL_DTYPE)).to(x.dtype)
        if name == "dequant_fp32":
            return lambda x: F.linear(x.float(), self.dequantize(torch.float32)).to(x.dtype)
        return lambda x: F.linear(x, self.dequantize(x.dtype))

    def kernel_of(self, name: str) -> RowKernel:
        """The native tiles' kernel or torch's packed one, on bfloat16 rows."""
        kernel = self.tile_kernel() if name == "quant_gemm" else self.torch_kernel()
        assert kernel is not None
        return kernel

    def rounding(self, name: str) -> torch.dtype:
        """The dtype the route rounds its product to on one device."""
        return KERNEL_DTYPE if name in ("quant_gemm", "torch_packed") else self.model_dtype

    def set_routes(self, chosen: routes.RouteSet) -> None:
        self.chosen = chosen
        if "torch_packed" not in chosen.names:
            self.drop_packed()
        self._route_calls = tuple(self._summed(name) for name in chosen.names)

    def _summed(self, name: str) -> RowKernel:
        """The route's product, a row-parallel layer's summed over the ranks and rounded once."""
        call, tp = self.route_call(name), self.tp
        if tp is None:
            return call
        rounding, dtype = self.rounding(name), self.model_dtype
        return lambda x: tp.all_reduce(call(x)).to(rounding).to(dtype)

    def read_bytes(self, rows: int) -> int:
        """Bytes of weights a product of `rows` rows reads through its route (before `bind`:
        the device kernel's weights): the tiles, torch's packed copy or the codes, and their
        scales."""
        name = self.chosen.route(rows) if self.chosen is not None else "quant_gemm"
        if name == "quant_gemm" and self.tiles is not None and self.tile_scales is not None:
            parts = [self.tiles, self.tile_scales]
        else:
            parts = [self.qweight, *self.scale_tensors()]
            if name == "torch_packed":
                parts[0] = self.packed_weights()
        return sum(t.nbytes for t in [*parts, self.bias] if t is not None)

    @abstractmethod
    def scale_tensors(self) -> list[torch.Tensor]:
        """The scales (and zeros) the codes are read with."""

    def packed_weights(self) -> torch.Tensor:
        """The weights as torch's packed kernel reads them (int8: the codes as stored)."""
        return self.qweight

    def row_kernel(self, dtype: torch.dtype, rows: int) -> RowKernel | None:
        """The call `forward` makes for `rows` rows of `dtype`, where they go straight to a
        kernel (the route of that many rows, once routes are bound); else None
        (`Linear.row_kernel`)."""
        calls = self._route_calls
        if calls is not None:
            if dtype != self.model_dtype or self.bias is not None:
                return None
            return calls[routes.bucket_of(rows)]
        # a row-parallel layer's sum over the ranks is `forward`'s: not a kernel's
        kernel = self.kernel() if self.use_kernel and self.tp is None else None
        if kernel is None or dtype != KERNEL_DTYPE or self.bias is not None:
            return None
        return kernel if rows <= self.max_kernel_tokens else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.numel() // self.in_features
        calls = self._route_calls
        if calls is not None and rows:
            x2 = x.reshape(-1, self.in_features).to(self.model_dtype)  # [num_tokens, in]
            y = calls[routes.bucket_of(rows)](x2).to(x.dtype)
            if self.bias is not None:
                y = y + self.bias
            return y.view(*x.shape[:-1], self.out_features)
        y = self._device_product(x)
        return y if self.tp is None else self.tp.all_reduce(y)

    def _device_product(self, x: torch.Tensor) -> torch.Tensor:
        """The product without routes: the device kernel's, or dequantize-then-matmul's."""
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
