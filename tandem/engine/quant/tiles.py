"""Weight tiles for the native few-row product of quantized weights (`csrc/kernels/quant_gemm.h`).

The int4 and int8 layers (and the int8 LM head) can multiply through one native kernel, built for
every ISA level, that decodes each weight once per chunk of rows and sums exact products in
float32 (`routes.py` measures it against torch's packed kernels and dequantize-then-GEMM). It
reads the weights in
tiles of 16 output channels, the input channels in pairs: tile t, pair p holds channel n = 16 t + i
in lane i, codes q[n, 2p] and q[n, 2p + 1] (int4: one byte, the first in the low nibble; int8:
two bytes), and per group of input channels the float32 scale and min of each channel,
`[out // 16, groups, 2, 16]`, so that w = q * scale + min (int8: one group, min 0).

Measured on SmolLM2's projections (bfloat16 rows, 2 threads, AVX-512 BF16), against torch's int4
kernel: 1.5-1.7x faster at one row and 2.1-2.25x at sixteen (gate/up 152 us against 341).
"""

from __future__ import annotations

import torch

from tandem.engine import native

TILE = 16  # output channels of a tile


def supported(device: torch.device, out_features: int, in_features: int) -> bool:
    """Whether the native kernel takes a layer of this shape on `device`."""
    if device.type != "cpu" or out_features % TILE or in_features % 2:
        return False
    return native.extension() is not None


def multiply(
    x: torch.Tensor,  # [rows, in] bfloat16, unit stride within a row
    tiles: torch.Tensor,
    scales_mins: torch.Tensor,
    group_size: int,
) -> torch.Tensor:  # [rows, out] bfloat16
    ext = native.extension()
    assert ext is not None
    out: torch.Tensor = ext.quant_gemm(x, tiles, scales_mins, group_size)
    return out


def _per_tile(values: torch.Tensor) -> torch.Tensor:
    """[groups, 2, out] -> [out // 16, groups, 2, 16]"""
    groups, _, out = values.shape
    return values.view(groups, 2, out // TILE, TILE).permute(2, 0, 1, 3).contiguous()


def tile_int4(
    codes: torch.Tensor,  # [out, in] uint8 in [0, 15]
    scales: torch.Tensor,  # [groups, out]
    mins: torch.Tensor,  # [groups, out]
) -> tuple[torch.Tensor, torch.Tensor]:  # uint8 [out // 16, in // 2, 16], float32 scales / mins
    out, in_features = codes.shape
    pairs = codes.view(out // TILE, TILE, in_features // 2, 2).transpose(1, 2)
    tiles = (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()
    return tiles, _per_tile(torch.stack([scales.float(), mins.float()], dim=1))


def tile_int8(
    qweight: torch.Tensor,  # [out, in] int8
    scales: torch.Tensor,  # [out]
) -> tuple[torch.Tensor, torch.Tensor]:  # int8 [out // 16, in // 2, 32], float32 scales / zeros
    out, in_features = qweight.shape
    tiles = qweight.view(out // TILE, TILE, in_features // 2, 2).transpose(1, 2)
    scale = scales.float()[None]  # one group: [1, out]
    return tiles.reshape(out // TILE, in_features // 2, 2 * TILE).contiguous(), _per_tile(
        torch.stack([scale, torch.zeros_like(scale)], dim=1)
    )
