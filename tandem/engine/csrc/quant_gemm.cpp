// int4 / int8 weight tiles times bfloat16 rows, into bfloat16 or float32: the checks and the output around the level's
// kernel (kernels/quant_gemm.h says what it computes; quant/tiles.py lays the tiles out).

#include "native.h"

namespace {
constexpr int64_t kTile = isa::kQuantTile;  // output channels a tile
}

at::Tensor quant_gemm(const isa::Kernels& kernels, at::Tensor x, at::Tensor tiles,
                      at::Tensor scales_zeros, int64_t group_size, bool float32_out) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 &&
                  x.scalar_type() == at::kBFloat16,
              "x: bfloat16 CPU rows [rows, in_features], unit stride within a row");
  const bool int4 = tiles.scalar_type() == at::kByte;
  TORCH_CHECK((int4 || tiles.scalar_type() == at::kChar) && tiles.dim() == 3 &&
                  tiles.size(2) == (int4 ? kTile : 2 * kTile) && tiles.is_contiguous() &&
                  tiles.device().is_cpu(),
              "tiles: uint8 [out_features / 16, in_features / 2, 16] (int4) or int8 "
              "[out_features / 16, in_features / 2, 32] (int8), quant/tiles.py");
  const int64_t rows = x.size(0), in = x.size(1), num_tiles = tiles.size(0);
  TORCH_CHECK(2 * tiles.size(1) == in, "x has ", in, " input channels, the tiles ",
              2 * tiles.size(1));
  TORCH_CHECK(group_size >= 2 && group_size % 2 == 0 && in % group_size == 0,
              "group_size must be even and divide in_features");
  const int64_t groups = in / group_size;
  TORCH_CHECK(scales_zeros.is_contiguous() && scales_zeros.scalar_type() == at::kBFloat16 &&
                  scales_zeros.dim() == 4 && scales_zeros.size(0) == num_tiles &&
                  scales_zeros.size(1) == groups && scales_zeros.size(2) == 2 &&
                  scales_zeros.size(3) == kTile && scales_zeros.device().is_cpu(),
              "scales_zeros: bfloat16 [out_features / 16, groups, 2, 16] (quant/tiles.py)");
  auto y = at::empty({rows, num_tiles * kTile},
                     x.options().dtype(float32_out ? at::kFloat : at::kBFloat16));
  if (rows == 0) return y;
  kernels.quant_gemm({reinterpret_cast<const uint16_t*>(x.data_ptr()), rows, in, x.stride(0),
                      reinterpret_cast<const uint8_t*>(tiles.data_ptr()),
                      reinterpret_cast<const uint16_t*>(scales_zeros.data_ptr()), num_tiles,
                      group_size, int4, y.data_ptr(), float32_out});
  return y;
}
