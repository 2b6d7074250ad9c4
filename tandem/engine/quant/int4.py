"""int4 weights in groups along the input channels: w ~= (q - 8) * scale + zero, q in [0, 15].

That affine form is the one torch's int4 kernels dequantize; with zero = min + 8 * scale it is
`q * scale + min`, which is also llama.cpp's Q4_1 (`q * d + m`) and, with zero = 0, Q4_0
(`(q - 8) * d`). Storage (`Int4Weight.qweight`): two codes a byte, code 2j in the high nibble of
byte j, `[out, in // 2]` uint8; scales and zeros `[out, in // group_size]`.

Kernels (the layer passes activations in bfloat16, `probe.py`; on CPU the route of each row
bucket is measured among them and dequantize-then-matmul, `routes.py`):
- CPU: the native tiled kernel (`tiles.py`, every ISA level), fed the layer's bfloat16 scales
  and zeros; and torch's
  `_convert_weight_to_int4pack_for_cpu(q int32 [out, in], inner_k_tiles)` -> uint8
  `[out, in // 2]` in a blocked layout of its own (inner_k_tiles is ignored), then
  `_weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)`; out a multiple of 16.
  Scales and zeros as `[in // group_size, out, 2]` bfloat16 for this one and CUDA's.
- CUDA: `_convert_weight_to_int4pack(qweight uint8 [out, in // 2], inner_k_tiles)` -> int32
  `[out // 8, in // (16 * inner_k_tiles), 32, inner_k_tiles // 2]`, then `_weight_int4pack_mm`
  (bfloat16 activations; out a multiple of 8, in a multiple of 16 * inner_k_tiles, which
  groups of >= 32 guarantee).
torch's kernels read half a byte per weight but do not batch rows, so past `KERNEL_MAX_TOKENS`
the layer dequantizes and runs one dense matmul; it keeps the nibble copy for that (and for
devices without a kernel), so a weight takes one byte of memory while a decode step reads half a
byte.
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
# SmolLM2's four layer shapes x 30 layers, bfloat16, 2 threads: at 32 tokens the kernel took
# 44 ms a step against 98 ms, at 128 tokens 171 ms against 180 ms, at 512 tokens 403 ms against
# 177 ms.
KERNEL_MAX_TOKENS = 128
MIN_GROUP_SIZE = 32  # the smallest group torch's int4 kernels take


@dataclass(frozen=True)
class Int4Weight:
    qweight: torch.Tensor  # [out_features, in_features // 2] uint8, two codes a byte
    scales: torch.Tensor  # [out_features, in_features // group_size] float32
    zeros: torch.Tensor  # [out_features, in_features // group_size] float32

    @property
    def group_size(self) -> int:
        return 2 * self.qweight.shape[1] // self.scales.shape[1]

    def dequantize(self) -> torch.Tensor:  # [out_features, in_features] float32
        return dequantize_int4(self.qweight, self.scales.float(), self.zeros.float())


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[out, in] codes in [0, 15] -> [out, in // 2] uint8, code 2j in the high nibble of byte j."""
    c = codes.to(torch.uint8)
    return (c[:, 0::2] << 4) | c[:, 1::2]


def unpack_codes(qweight: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_codes`: [out, in // 2] uint8 -> [out, in] uint8."""
    return torch.stack([qweight >> 4, qweight & 0xF], dim=-1).view(qweight.shape[0], -1)


def dequantize_int4(
    qweight: torch.Tensor,  # [out, in // 2] uint8
    scales: torch.Tensor,  # [out, in // group_size]
    zeros: torch.Tensor,  # [out, in // group_size]
) -> torch.Tensor:  # [out, in] in the scales' dtype
    out, groups = scales.shape
    codes = unpack_codes(qweight).view(out, groups, -1).to(scales.dtype)  # [out, groups, group]
    return ((codes - 8) * scales[..., None] + zeros[..., None]).view(out, -1)


def quantize_int4(weight: torch.Tensor, group_size: int) -> Int4Weight:
    """Each group of `group_size` input channels spans its minimum to its maximum in 15 steps."""
    out, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"in_features {in_features} is not a multiple of group_size {group_size}")
    w = weight.float().view(out, in_features // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # [out, groups]
    scales = (hi - lo).clamp(min=1e-12) / 15  # a constant group keeps a positive scale
    codes = torch.round((w - lo[..., None]) / scales[..., None]).clamp(0, 15)
    return Int4Weight(pack_codes(codes.view(out, in_features)), scales, lo + 8 * scales)


def layer_group_size(in_features: int, group_size: int) -> int:
    """`group_size`, halved until it divides `in_features` (SmolLM2's 576 takes 64 for 128)."""
    group = group_size
    while in_features % group and group > MIN_GROUP_SIZE:
        group //= 2
    if in_features % group:
        raise ValueError(
            f"int4 needs in_features to be a multiple of {MIN_GROUP_SIZE}, got {in_features}"
        )
    return group


def _inner_k_tiles(in_features: int) -> int:
    return next(t for t in (8, 4, 2) if in_features % (16 * t) == 0)


def _kernel_fits(device: torch.device, out_features: int, in_features: int) -> bool:
    """The shapes each device's kernel takes (in is already a multiple of the group size)."""
    if device.type == "cpu":
        return out_features % 16 == 0
    return device.type == "cuda" and out_features % 8 == 0


def _pack(qweight: torch.Tensor) -> torch.Tensor:
    """Our nibbles -> the layout of the device's kernel."""
    if qweight.device.type == "cpu":
        codes = unpack_codes(qweight).to(torch.int32)  # [out, in]
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    in_features = 2 * qweight.shape[1]
    return torch.ops.aten._convert_weight_to_int4pack(qweight, _inner_k_tiles(in_features))


def _mm(
    x: torch.Tensor,  # [num_tokens, in]
    packed: torch.Tensor,
    group_size: int,
    scales_and_zeros: torch.Tensor,  # [in // group_size, out, 2]
) -> torch.Tensor:  # [num_tokens, out]
    if x.device.type == "cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)
    return torch.ops.aten._weight_int4pack_mm(x, packed, group_size, scales_and_zeros)


def _scales_and_zeros(weight: Int4Weight) -> torch.Tensor:  # [groups, out, 2] as kernels take
    return torch.stack([weight.scales.T, weight.zeros.T], dim=-1).to(KERNEL_DTYPE).contiguous()


@functools.cache
def kernel_works(device: torch.device, group_size: int) -> bool:
    """Whether the device's int4 kernel runs with `group_size` and computes what it should."""
    if not _kernel_fits(device, 64, 256):
        return False
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(3, 256, generator=gen, device=device).to(KERNEL_DTYPE)  # [tokens, in]
    weight = quantize_int4(torch.randn(64, 256, generator=gen, device=device), group_size)
    sz = _scales_and_zeros(weight)
    return kernel_agrees(
        f"int4 kernel on {device}, group {group_size}",
        lambda: _mm(x, _pack(weight.qweight), group_size, sz),
        lambda: F.linear(x.float(), weight.dequantize()),
    )


class Int4Linear(QuantizedLinear):
    """A linear layer over int4 weights; input, bias and output in `dtype`, scales and zeros in
    bfloat16; `tp`: a row-parallel layer's group (`layer.py`)."""

    def __init__(
        self,
        weight: Int4Weight,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.model_dtype = dtype
        self.tp = tp
        self.out_features = weight.qweight.shape[0]
        self.in_features = 2 * weight.qweight.shape[1]
        self.group_size = weight.group_size
        self.max_kernel_tokens = KERNEL_MAX_TOKENS
        self.qweight: torch.Tensor
        self.scales_and_zeros: torch.Tensor
        self.tiles: torch.Tensor | None
        self.tile_scales: torch.Tensor | None
        self.packed: torch.Tensor | None
        self.register_buffer("qweight", weight.qweight.to(device))
        self.register_buffer("scales_and_zeros", _scales_and_zeros(weight).to(device))
        self.register_buffer("bias", None if bias is None else bias.to(device, dtype))
        tiled = tiles.supported(device, self.out_features, self.in_features)
        sz = self.scales_and_zeros  # [groups, out, 2] bfloat16, as torch's kernels take them
        tiled_weights = (
            tiles.tile_int4(unpack_codes(self.qweight), sz[..., 0], sz[..., 1])
            if tiled
            else (None, None)
        )
        self.register_buffer("tiles", tiled_weights[0])
        self.register_buffer("tile_scales", tiled_weights[1])
        torch_kernel = not tiled and self.torch_kernel_runs()
        self.register_buffer("packed", _pack(self.qweight) if torch_kernel else None)
        self.use_kernel = tiled or torch_kernel

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [out, in]
        sz = self.scales_and_zeros.float()  # [groups, out, 2]
        return dequantize_int4(self.qweight, sz[..., 0].T, sz[..., 1].T).to(dtype)

    @property
    def method(self) -> str:
        return "int4"

    @property
    def tile_group(self) -> int:
        return self.group_size

    def kernel(self) -> RowKernel | None:
        tile_kernel = self.tile_kernel()
        if tile_kernel is not None or self.packed is None:
            return tile_kernel
        return self.torch_kernel()

    def torch_kernel_runs(self) -> bool:
        device = self.qweight.device
        return _kernel_fits(device, self.out_features, self.in_features) and kernel_works(
            device, self.group_size
        )

    def torch_kernel(self) -> RowKernel | None:
        if not self.torch_kernel_runs():
            return None
        if self.packed is None:
            self.packed = _pack(self.qweight)
        packed, sz, group = self.packed, self.scales_and_zeros, self.group_size
        return lambda x: _mm(x, packed, group, sz)

    def drop_packed(self) -> None:
        self.packed = None

    def scale_tensors(self) -> list[torch.Tensor]:
        return [self.scales_and_zeros]

    def packed_weights(self) -> torch.Tensor:
        return self.packed if self.packed is not None else self.qweight

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int4 group {self.group_size}"
        )
