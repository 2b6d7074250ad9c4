"""Weight tiles for the native few-row product of quantized weights (`csrc/kernels/quant_gemm.h`).

The int4 and int8 layers (and the int8 LM head) can multiply through one native kernel, built for
every ISA level, that decodes each weight once per chunk of rows and sums exact products in
float32 (`routes.py` measures it against torch's packed kernels and dequantize-then-GEMM). It
reads the weights in
tiles of 16 output channels, the input channels in pairs: tile t, pair p holds channel n = 16 t + i
in lane i, codes q[n, 2p] and q[n, 2p + 1] (int4: one byte, the first in the low nibble; int8:
two bytes), and per group of input channels the bfloat16 scale and zero of each channel,
`[out // 16, groups, 2, 16]`, so that w = (q - 8) * scale + zero for int4 (the kernel computes
min = zero - 8 * scale in float32) and w = q * scale for int8 (one group, zero 0). The layers'
scales and zeros are bfloat16 already, so the tiles hold them exactly, in half the bytes of
float32 ones: with groups of 32, 1/8 byte a weight beside the codes' 1/2 (SmolLM2 int4: 13 MB
fewer read a decode step, of 108).

Measured on SmolLM2's projections (bfloat16 rows, 2 threads, AVX-512 BF16), against torch's int4
kernel: 1.5-1.7x faster at one row and 2.1-2.25x at sixteen (gate/up 152 us against 341).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine import native

TILE = 16  # output channels of a tile
SCALE_DTYPE = torch.bfloat16  # of the tiles' scales and zeros


def supported(device: torch.device, out_features: int, in_features: int) -> bool:
    """Whether the native kernel takes a layer of this shape on `device`."""
    if device.type != "cpu" or out_features % TILE or in_features % 2:
        return False
    return native.extension() is not None


@dataclass(frozen=True)
class TileCall:
    """The native kernel bound to one layer's tiles, [rows, in] bfloat16 -> [rows, out]
    bfloat16 (or its float32 sums); the decode plan's native layer loop reads its tensors
    (`models/decode_plan.py`)."""

    tiles: torch.Tensor
    scales_zeros: torch.Tensor
    group_size: int
    float32_out: bool = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return multiply(x, self.tiles, self.scales_zeros, self.group_size, self.float32_out)


def multiply(
    x: torch.Tensor,  # [rows, in] bfloat16, unit stride within a row
    tiles: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    float32_out: bool = False,
) -> torch.Tensor:  # [rows, out] bfloat16 (float32: the sums unrounded)
    ext = native.extension()
    assert ext is not None
    out: torch.Tensor = ext.quant_gemm(x, tiles, scales_zeros, group_size, float32_out)
    return out


def _per_tile(values: torch.Tensor) -> torch.Tensor:
    """[groups, 2, out] -> [out // 16, groups, 2, 16]"""
    groups, _, out = values.shape
    return values.view(groups, 2, out // TILE, TILE).permute(2, 0, 1, 3).contiguous()


def tile_int4(
    codes: torch.Tensor,  # [out, in] uint8 in [0, 15]
    scales: torch.Tensor,  # [groups, out] bfloat16
    zeros: torch.Tensor,  # [groups, out] bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:  # uint8 [out // 16, in // 2, 16], bfloat16 scales / zeros
    out, in_features = codes.shape
    pairs = codes.view(out // TILE, TILE, in_features // 2, 2).transpose(1, 2)
    tiles = (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()
    return tiles, _per_tile(torch.stack([scales, zeros], dim=1).to(SCALE_DTYPE))


def tile_int8(
    qweight: torch.Tensor,  # [out, in] int8
    scales: torch.Tensor,  # [out] bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:  # int8 [out // 16, in // 2, 32], bfloat16 scales / zeros
    out, in_features = qweight.shape
    tiles = qweight.view(out // TILE, TILE, in_features // 2, 2).transpose(1, 2)
    scale = scales.to(SCALE_DTYPE)[None]  # one group: [1, out]
    return tiles.reshape(out // TILE, in_features // 2, 2 * TILE).contiguous(), _per_tile(
        torch.stack([scale, torch.zeros_like(scale)], dim=1)
    )
