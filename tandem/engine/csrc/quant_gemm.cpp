// int4 / int8 weights times bfloat16 rows, for the few-row products of decoding
// (tandem/engine/quant/tiles.py lays the weights out; int4.py, int8.py and lm_head.py call it).
//
// torch's CPU weight-only kernels dequantize each weight to float32 for every row they multiply,
// so their time grows with the rows: on SmolLM2's gate/up projection the int4 one takes 70 us
// for one row, 390 for sixteen. Here a weight is decoded once for all the rows of a call, to
// bfloat16 (int4 codes 0..15 and int8 codes -127..127 are exact there), and multiplied with
// AVX-512 BF16 dot products (`vdpbf16ps`: 32 products a register, summed in float32). With
// w = q * scale + min per group of input channels (int8: one group, min 0):
//
//   y[m, n] = sum_g scale[g, n] * sum_{k in g} x[m, k] q[n, k]  +  min[g, n] * sum_{k in g} x[m, k]
//
// The inner sums are exact products added in float32; the scales apply once per group.
//
// Weights come in tiles of 16 output channels, the input channels in pairs: tile t, pair p holds
// q[n, 2p] and q[n, 2p + 1] for n = 16 t + i, lane i. int4: one byte a lane, the low nibble
// first (16 bytes a pair); int8: two bytes a lane (32 bytes a pair). A tile's pair decodes to 32
// bfloat16, the operand `vdpbf16ps` multiplies with a row's two inputs broadcast to every lane.
// Tiles are spread over the threads; the rows of a call go through in chunks of up to 16.
//
// Built only where the compiler targets AVX-512 BF16 (`-march=native` on such a CPU);
// `quant_gemm_supported()` says so, and the layers keep torch's kernels otherwise.

#include "native.h"
#include "simd.h"

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TANDEM_QUANT_GEMM 1
#endif

namespace {

constexpr int64_t kTile = 16;   // output channels a tile: one float32 register of results
constexpr int64_t kChunk = 16;  // rows multiplied with one decoded tile at most

#ifdef TANDEM_QUANT_GEMM

// A tile's pair p of int4 codes as 32 bfloat16 (lane i: its channel's two weights).
struct Int4Pairs {
  static constexpr int64_t kBytes = kTile;  // a pair's bytes in a tile
  static __m512bh decode(const uint8_t* pair) {
    // code c -> the bfloat16 bits of c: 1.0 = 0x3F80, 2^e (1 + f / 128) for the rest
    alignas(64) static const uint16_t kCodes[32] = {
        0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
        0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
    const __m512i bytes =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair)));
    // lane: the low nibble in its low 16 bits, the high nibble in its high 16 bits
    const __m512i codes = _mm512_or_si512(
        _mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)),
        _mm512_slli_epi32(_mm512_and_si512(bytes, _mm512_set1_epi32(0xF0)), 12));
    return (__m512bh)_mm512_permutexvar_epi16(codes, _mm512_load_si512(kCodes));
  }
};

// A tile's pair p of int8 codes as 32 bfloat16: byte j becomes bfloat16 j.
struct Int8Pairs {
  static constexpr int64_t kBytes = 2 * kTile;
  static __m512bh decode(const uint8_t* pair) {
    const __m128i* p = reinterpret_cast<const __m128i*>(pair);
    const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
    const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
    return _mm512_cvtne2ps_pbh(high, low);  // bfloat16 0..15 from `low`, 16..31 from `high`
  }
};

// Rows [m0, m0 + MT) of x against one tile, all groups: y[MT][16] float32 results.
//   x: bfloat16 bits, row m at x + m * stride; xs: [rows][G] group sums of the rows
//   tile: [K / 2][Pairs::kBytes] bytes; sm: [G][2][16] float32 (scale, min) of its channels
template <typename Pairs, int MT>
void tile_rows(const uint16_t* x, int64_t stride, const float* xs, const uint8_t* tile,
               const float* sm, int64_t m0, int64_t pairs, int64_t group_pairs, float* y) {
  const uint16_t* row[MT];
  for (int m = 0; m < MT; ++m) row[m] = x + (m0 + m) * stride;
  __m512 out[MT];
  for (int m = 0; m < MT; ++m) out[m] = _mm512_setzero_ps();
  const int64_t groups = pairs / group_pairs;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t p = g * group_pairs; p < (g + 1) * group_pairs; ++p) {
      const __m512bh w = Pairs::decode(tile + p * Pairs::kBytes);
      for (int m = 0; m < MT; ++m) {
        int32_t inputs;  // x[m, 2p] and x[m, 2p + 1]
        std::memcpy(&inputs, row[m] + 2 * p, sizeof inputs);
        acc[m] = _mm512_dpbf16_ps(acc[m], w, (__m512bh)_mm512_set1_epi32(inputs));
      }
    }
    const __m512 scale = _mm512_loadu_ps(sm + g * 2 * kTile);
    const __m512 min = _mm512_loadu_ps(sm + g * 2 * kTile + kTile);
    for (int m = 0; m < MT; ++m) {
      out[m] = _mm512_fmadd_ps(acc[m], scale, out[m]);
      out[m] = _mm512_fmadd_ps(_mm512_set1_ps(xs[(m0 + m) * groups + g]), min, out[m]);
    }
  }
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(y + m * kTile, out[m]);
}

// Sums of each group of `group_size` inputs of a row, in float32.
void group_sums(const uint16_t* row, int64_t in, int64_t group_size, float* sums) {
  for (int64_t g = 0; g < in / group_size; ++g) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) s += simd::widen(row[k]);
    sums[g] = s;
  }
}

using TileRows = void (*)(const uint16_t*, int64_t, const float*, const uint8_t*, const float*,
                          int64_t, int64_t, int64_t, float*);

// The rows go through as 16s, then an 8, 4, 2 and 1 for the rest.
constexpr int kSizes[] = {16, 8, 4, 2, 1};
static_assert(kSizes[0] == kChunk, "the largest chunk");

template <typename Pairs>
void multiply(const torch::Tensor& x, const uint8_t* tiles, const float* sm, int64_t num_tiles,
              int64_t group_size, torch::Tensor& y) {
  static constexpr TileRows kKernels[] = {tile_rows<Pairs, 16>, tile_rows<Pairs, 8>,
                                          tile_rows<Pairs, 4>, tile_rows<Pairs, 2>,
                                          tile_rows<Pairs, 1>};
  const int64_t rows = x.size(0), in = x.size(1), stride = x.stride(0);
  const int64_t pairs = in / 2, groups = in / group_size, out_features = num_tiles * kTile;
  const auto* xbits = reinterpret_cast<const uint16_t*>(x.data_ptr());
  std::vector<float> xs(rows * groups);
  for (int64_t m = 0; m < rows; ++m)
    group_sums(xbits + m * stride, in, group_size, xs.data() + m * groups);
  auto* out = reinterpret_cast<c10::BFloat16*>(y.data_ptr());
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float result[kChunk * kTile];
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile = tiles + t * pairs * Pairs::kBytes;
      const float* tile_sm = sm + t * groups * 2 * kTile;
      int64_t m0 = 0;
      for (int i = 0; m0 < rows; ++i) {
        const int64_t mt = kSizes[i];
        for (; m0 + mt <= rows; m0 += mt) {
          kKernels[i](xbits, stride, xs.data(), tile, tile_sm, m0, pairs, group_size / 2,
                      result);
          for (int64_t m = 0; m < mt; ++m) {
            const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_loadu_ps(result + m * kTile));
            std::memcpy(out + (m0 + m) * out_features + t * kTile, &rounded, sizeof rounded);
          }
        }
      }
    }
  });
}

#endif  // TANDEM_QUANT_GEMM

}  // namespace

bool quant_gemm_supported() {
#ifdef TANDEM_QUANT_GEMM
  return true;
#else
  return false;
#endif
}

torch::Tensor quant_gemm(torch::Tensor x, torch::Tensor tiles, torch::Tensor scales_mins,
                         int64_t group_size) {
#ifdef TANDEM_QUANT_GEMM
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 &&
                  x.scalar_type() == torch::kBFloat16,
              "x: bfloat16 CPU rows [rows, in_features], unit stride within a row");
  const bool int4 = tiles.scalar_type() == torch::kUInt8;
  TORCH_CHECK((int4 || tiles.scalar_type() == torch::kInt8) && tiles.dim() == 3 &&
                  tiles.size(2) == (int4 ? kTile : 2 * kTile) && tiles.is_contiguous(),
              "tiles: uint8 [out_features / 16, in_features / 2, 16] (int4) or int8 "
              "[out_features / 16, in_features / 2, 32] (int8), quant/tiles.py");
  const int64_t rows = x.size(0), in = x.size(1), num_tiles = tiles.size(0);
  TORCH_CHECK(2 * tiles.size(1) == in, "x has ", in, " input channels, the tiles ",
              2 * tiles.size(1));
  TORCH_CHECK(group_size >= 2 && group_size % 2 == 0 && in % group_size == 0,
              "group_size must be even and divide in_features");
  const int64_t groups = in / group_size;
  TORCH_CHECK(scales_mins.is_contiguous() && scales_mins.scalar_type() == torch::kFloat32 &&
                  scales_mins.dim() == 4 && scales_mins.size(0) == num_tiles &&
                  scales_mins.size(1) == groups && scales_mins.size(2) == 2 &&
                  scales_mins.size(3) == kTile,
              "scales_mins: float32 [out_features / 16, groups, 2, 16] (quant/tiles.py)");
  auto y = torch::empty({rows, num_tiles * kTile}, x.options());
  if (rows == 0) return y;
  const auto* bytes = reinterpret_cast<const uint8_t*>(tiles.data_ptr());
  const float* sm = scales_mins.data_ptr<float>();
  if (int4)
    multiply<Int4Pairs>(x, bytes, sm, num_tiles, group_size, y);
  else
    multiply<Int8Pairs>(x, bytes, sm, num_tiles, group_size, y);
  return y;
#else
  TORCH_CHECK(false, "quant_gemm needs a CPU with AVX-512 BF16 (quant_gemm_supported())");
#endif
}
