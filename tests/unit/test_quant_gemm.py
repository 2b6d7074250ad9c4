"""The native kernel of quantized weights (`csrc/quant_gemm.cpp`, `quant/tiles.py`) multiplies
exactly the layer's dequantized weights: bfloat16 inputs, float32 sums, one rounding of the output
to bfloat16 (or none: float32 out), for int4 and int8, every row count (its chunks of 16, 8, 4, 2
and 1), group size and row stride, at every instruction-set level the CPU runs; bad shapes are
refused."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from tandem.engine import native
from tandem.engine.quant import tiles
from tandem.engine.quant.int4 import Int4Linear
from tandem.engine.quant.int8 import Int8Linear
from tandem.engine.quant.model import quantize_linear

CPU = torch.device("cpu")


def _layer(
    method: str, out_features: int, in_features: int, group_size: int
) -> Int4Linear | Int8Linear:
    linear = torch.nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features) * 0.05)
    layer = quantize_linear(linear, method, group_size, [])
    assert isinstance(layer, Int4Linear | Int8Linear)
    assert layer.tiles is not None and layer.tile_scales is not None
    return layer


def _group(layer: Int4Linear | Int8Linear) -> int:
    return layer.group_size if isinstance(layer, Int4Linear) else layer.in_features


@pytest.mark.parametrize("method", ["int4", "int8"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 16, 31, 40])
@pytest.mark.parametrize(
    ("out_features", "in_features", "group_size"), [(48, 128, 32), (32, 192, 64), (64, 256, 128)]
)
def test_equals_the_dequantized_product(
    kernels: ModuleType,
    method: str,
    rows: int,
    out_features: int,
    in_features: int,
    group_size: int,
) -> None:
    layer = _layer(method, out_features, in_features, group_size)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    x = x.to(torch.bfloat16)
    assert layer.tiles is not None and layer.tile_scales is not None
    got = kernels.quant_gemm(x, layer.tiles, layer.tile_scales, _group(layer))
    want = F.linear(x.double(), layer.dequantize(torch.float64))
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    # the float32 sum, then one rounding to bfloat16 (relative 2^-9)
    err = (got.double() - want).abs() / want.abs().clamp(min=1e-3 * want.abs().max())
    assert err.max() < 2**-8
    # the same sums unrounded (a tensor-parallel rank's partial sums)
    sums = kernels.quant_gemm(x, layer.tiles, layer.tile_scales, _group(layer), float32_out=True)
    assert sums.dtype == torch.float32 and torch.equal(sums.bfloat16(), got)
    if rows <= layer.max_kernel_tokens and kernels.level == native.level_in_use():
        assert torch.equal(layer(x), got)  # the layer's own route


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_strided_rows(kernels: ModuleType, method: str) -> None:
    layer = _layer(method, 32, 128, 32)
    assert layer.tiles is not None and layer.tile_scales is not None
    wide = torch.randn(6, 300, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    x = wide[:, 50:178]  # rows 300 elements apart
    args = (layer.tiles, layer.tile_scales, _group(layer))
    assert torch.equal(kernels.quant_gemm(x, *args), kernels.quant_gemm(x.contiguous(), *args))


def test_int4_tiles_hold_every_code_where_the_kernel_reads_it() -> None:
    codes = torch.arange(32 * 64).remainder(16).view(32, 64).to(torch.uint8)  # [out, in]
    scales, zeros = torch.rand(2, 32).bfloat16(), torch.rand(2, 32).bfloat16()  # [groups, out]
    weight_tiles, scales_zeros = tiles.tile_int4(codes, scales, zeros)
    assert weight_tiles.shape == (2, 32, 16) and scales_zeros.shape == (2, 2, 2, 16)
    assert scales_zeros.dtype == torch.bfloat16
    for t, p, i in [(0, 0, 0), (1, 5, 3), (1, 31, 15)]:
        n, g = 16 * t + i, (2 * p) // 32
        assert weight_tiles[t, p, i] == codes[n, 2 * p] | codes[n, 2 * p + 1] << 4
        assert scales_zeros[t, g, 0, i] == scales[g, n] and scales_zeros[t, g, 1, i] == zeros[g, n]


def test_int8_tiles_hold_every_code_where_the_kernel_reads_it() -> None:
    qweight = (torch.arange(32 * 64).remainder(255) - 127).view(32, 64).to(torch.int8)
    scales = torch.rand(32).bfloat16()
    weight_tiles, scales_zeros = tiles.tile_int8(qweight, scales)
    assert weight_tiles.shape == (2, 32, 32) and scales_zeros.shape == (2, 1, 2, 16)
    for t, p, i in [(0, 0, 0), (1, 5, 3), (1, 31, 15)]:
        n = 16 * t + i
        assert weight_tiles[t, p, 2 * i] == qweight[n, 2 * p]
        assert weight_tiles[t, p, 2 * i + 1] == qweight[n, 2 * p + 1]
        assert scales_zeros[t, 0, 0, i] == scales[n] and scales_zeros[t, 0, 1, i] == 0


def test_bad_shapes_are_refused(kernels: ModuleType) -> None:
    layer = _layer("int4", 32, 128, 32)
    args = (layer.tiles, layer.tile_scales)
    with pytest.raises(RuntimeError, match="input channels"):
        kernels.quant_gemm(torch.zeros(2, 64, dtype=torch.bfloat16), *args, 32)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.quant_gemm(torch.zeros(2, 128), *args, 32)
    with pytest.raises(RuntimeError, match="scales_zeros"):
        kernels.quant_gemm(torch.zeros(2, 128, dtype=torch.bfloat16), *args, 64)
    with pytest.raises(RuntimeError, match="tiles"):
        kernels.quant_gemm(
            torch.zeros(2, 128, dtype=torch.bfloat16), layer.tile_scales, *args[1:], 32
        )


def test_where_the_layers_take_it() -> None:
    assert tiles.supported(CPU, 48, 128)
    assert not tiles.supported(CPU, 40, 128)  # not whole tiles: torch's kernels or dequantize
    assert not tiles.supported(CPU, 48, 127)
    assert not tiles.supported(torch.device("cuda"), 48, 128)
