// int4 / int8 weights times bfloat16 rows, for the few-row products of decoding (the wrapper:
// quant_gemm.cpp; tandem/engine/quant/tiles.py lays the weights out).
//
// torch's CPU weight-only kernels dequantize each weight to float32 for every row they multiply,
// so their time grows with the rows: on SmolLM2's gate/up projection the int4 one takes 70 us
// for one row, 390 for sixteen. Here a weight is decoded once for a chunk of rows, and the
// products are exact: int4 codes 0..15 and int8 codes -127..127 times a bfloat16 input need at
// most 16 significant bits, so float32 (or a bfloat16 pair of `vdpbf16ps`) holds them, and only
// the sums round. The float32 sums are stored as bfloat16, or as they are (a tensor-parallel
// rank's partial sums, rounded once after the all-reduce adds them). With w = q * scale + min per group of input channels (int8: one group, min 0):
//
//   y[m, n] = sum_g scale[g, n] * sum_{k in g} x[m, k] q[n, k]  +  min[g, n] * sum_{k in g} x[m, k]
//
// The scales apply once per group. Weights come in tiles of 16 output channels, the input
// channels in pairs: tile t, pair p holds q[n, 2p] and q[n, 2p + 1] for n = 16 t + i, lane i.
// int4: one byte a lane, the low nibble first (16 bytes a pair); int8: two bytes a lane (32
// bytes a pair). Tiles are spread over the threads; the rows of a call go through in chunks.
//
// Two ways through a tile, by level:
// - AVX-512 BF16: a pair decodes to 32 bfloat16, the operand `vdpbf16ps` multiplies with a row's
//   two inputs broadcast to every lane; chunks of 16 rows (16 accumulators of 32 registers).
// - Elsewhere: a pair decodes to float32 codes (inputs 2p and 2p + 1 of the 16 channels, in
//   registers of the level's width), multiplied with the row's inputs widened to float32
//   (exactly: the same products, summed in another order); a chunk holds as many rows
//   as the level's registers leave room for beside the decoded pair and two broadcast inputs
//   (AVX-512: 16; AVX2, 16 ymm, two a tile: 4; SSE: 1).
//
// Included once per instruction-set level, inside its namespace (isa_kernels.h): no includes.

namespace quant_gemm {

constexpr int64_t kTile = kQuantTile;  // output channels a tile

// Sums of each group of `group_size` inputs of a row, in float32.
inline void group_sums(const uint16_t* row, int64_t in, int64_t group_size, float* sums) {
  for (int64_t g = 0; g < in / group_size; ++g) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) s += simd::widen(row[k]);
    sums[g] = s;
  }
}

#if TANDEM_BF16_DOTS

constexpr int64_t kChunk = 16;  // rows multiplied with one decoded tile at most

// A tile's pair p of int4 codes as 32 bfloat16 (lane i: its channel's two weights).
struct Int4Pairs {
  static constexpr int64_t kBytes = kTile;  // a pair's bytes in a tile
  static constexpr float kOffset = 8.0f;    // w = (q - 8) * scale + zero
  static __m512bh decode(const uint8_t* pair) {
    // code c -> the bfloat16 bits of c: 1.0 = 0x3F80, 2^e (1 + f / 128) for the rest; twice, as
    // `vpermw` indexes by a word's low 5 bits, whose bit 4 may hold the high nibble's lowest
    alignas(64) static const uint16_t kCodes[32] = {
        0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
        0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
        0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
        0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
    const __m512i bytes =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair)));
    // lane b: the low nibble in its low word's bits 0-3, the high one as its high word (b >> 4);
    // no masks (two operations of six fewer: int4 products ~6% faster, Zen 4, 7 December)
    const __m512i codes = _mm512_or_si512(bytes, _mm512_slli_epi32(bytes, 12));
    return (__m512bh)_mm512_permutexvar_epi16(codes, _mm512_load_si512(kCodes));
  }
};

// A tile's pair p of int8 codes as 32 bfloat16: byte j becomes bfloat16 j.
struct Int8Pairs {
  static constexpr int64_t kBytes = 2 * kTile;
  static constexpr float kOffset = 0.0f;  // w = q * scale
  static __m512bh decode(const uint8_t* pair) {
    const __m128i* p = reinterpret_cast<const __m128i*>(pair);
    const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
    const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
    return _mm512_cvtne2ps_pbh(high, low);  // bfloat16 0..15 from `low`, 16..31 from `high`
  }
};

// The chunk's rows, as the tile products read them: the bfloat16 bits as they are.
struct ChunkRows {
  ChunkRows(const QuantGemmArgs& a) : x(a.x), stride(a.stride) {}
  const uint16_t* x;
  int64_t stride;
};

// Rows [m0, m0 + MT) of x against one tile, all groups: y[MT][16] float32 results.
//   xs: [rows][G] group sums of the rows; tile: [K / 2][Pairs::kBytes] bytes;
//   sz: [G][2][16] bfloat16 (scale, zero) of its channels
template <typename Pairs, int MT>
void tile_rows(const ChunkRows& x, const float* xs, const uint8_t* tile, const uint16_t* sz,
               int64_t m0, int64_t pairs, int64_t group_pairs, float* y) {
  const uint16_t* row[MT];
  for (int m = 0; m < MT; ++m) row[m] = x.x + (m0 + m) * x.stride;
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
    const simd::Vec scale = simd::load(sz + g * 2 * kTile);
    const simd::Vec min = simd::load(sz + g * 2 * kTile + kTile) - Pairs::kOffset * scale;
    for (int m = 0; m < MT; ++m) {
      out[m] = _mm512_fmadd_ps(acc[m], (__m512)scale, out[m]);
      out[m] = _mm512_fmadd_ps(_mm512_set1_ps(xs[(m0 + m) * groups + g]), (__m512)min, out[m]);
    }
  }
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(y + m * kTile, out[m]);
}

#else

constexpr int kVecs = kTile / simd::kWidth;  // Vecs of a tile's 16 channels
// Rows per decoded tile: the largest power of two (16 at most) whose accumulators fit beside the
// decoded pair and two broadcast inputs.
constexpr int64_t rows_that_fit(int64_t budget) {
  int64_t rows = 16;
  while (rows > 1 && rows * kVecs > budget) rows /= 2;
  return rows;
}
constexpr int64_t kChunk = rows_that_fit(TANDEM_VEC_REGISTERS - 2 * kVecs - 2);

// A tile's pair p of int4 codes as float32: the channels' weights of input 2p, of 2p + 1.
struct Int4Pairs {
  static constexpr int64_t kBytes = kTile;
  static constexpr float kOffset = 8.0f;
  static void decode(const uint8_t* pair, simd::Vec (&even)[kVecs], simd::Vec (&odd)[kVecs]) {
    for (int v = 0; v < kVecs; ++v) {
      const simd::IVec codes = simd::widen_bytes(pair + v * simd::kWidth);
      even[v] = __builtin_convertvector(codes & 0x0F, simd::Vec);
      odd[v] = __builtin_convertvector(codes >> 4, simd::Vec);
    }
  }
};

// A tile's pair p of int8 codes as float32: lane i's two bytes are its inputs 2p and 2p + 1.
struct Int8Pairs {
  static constexpr int64_t kBytes = 2 * kTile;
  static constexpr float kOffset = 0.0f;
  static void decode(const uint8_t* pair, simd::Vec (&even)[kVecs], simd::Vec (&odd)[kVecs]) {
    for (int v = 0; v < kVecs; ++v) {
      // lane i: byte 2i in the low half, byte 2i + 1 in the high half
      int16_t words[simd::kWidth];
      std::memcpy(words, pair + v * 2 * simd::kWidth, sizeof words);
      const simd::IVec both = simd::widen_words(words);
      even[v] = __builtin_convertvector((both << 24) >> 24, simd::Vec);  // the low byte, signed
      odd[v] = __builtin_convertvector(both >> 8, simd::Vec);
    }
  }
};

// The chunk's rows, as the tile products read them: widened to float32 once per call (exact).
struct ChunkRows {
  ChunkRows(const QuantGemmArgs& a) : x(a.rows * a.in), in(a.in) {
    for (int64_t m = 0; m < a.rows; ++m)
      for (int64_t k = 0; k < a.in; ++k) x[m * a.in + k] = simd::widen(a.x[m * a.stride + k]);
  }
  std::vector<float> x;
  int64_t in;
};

template <typename Pairs, int MT>
void tile_rows(const ChunkRows& x, const float* xs, const uint8_t* tile, const uint16_t* sz,
               int64_t m0, int64_t pairs, int64_t group_pairs, float* y) {
  const float* row[MT];
  for (int m = 0; m < MT; ++m) row[m] = x.x.data() + (m0 + m) * x.in;
  simd::Vec out[MT][kVecs];
  for (int m = 0; m < MT; ++m)
    for (int v = 0; v < kVecs; ++v) out[m][v] = simd::Vec{};
  const int64_t groups = pairs / group_pairs;
  for (int64_t g = 0; g < groups; ++g) {
    simd::Vec acc[MT][kVecs];
    for (int m = 0; m < MT; ++m)
      for (int v = 0; v < kVecs; ++v) acc[m][v] = simd::Vec{};
    for (int64_t p = g * group_pairs; p < (g + 1) * group_pairs; ++p) {
      simd::Vec even[kVecs], odd[kVecs];
      Pairs::decode(tile + p * Pairs::kBytes, even, odd);
      for (int m = 0; m < MT; ++m) {  // the odd product first, as `vdpbf16ps` adds them
        const float x_odd = row[m][2 * p + 1], x_even = row[m][2 * p];
        for (int v = 0; v < kVecs; ++v) {
          acc[m][v] += odd[v] * x_odd;
          acc[m][v] += even[v] * x_even;
        }
      }
    }
    for (int v = 0; v < kVecs; ++v) {
      const simd::Vec scale = simd::load(sz + g * 2 * kTile + v * simd::kWidth);
      const simd::Vec min =
          simd::load(sz + g * 2 * kTile + kTile + v * simd::kWidth) - Pairs::kOffset * scale;
      for (int m = 0; m < MT; ++m) {
        out[m][v] += acc[m][v] * scale;
        out[m][v] += xs[(m0 + m) * groups + g] * min;
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int v = 0; v < kVecs; ++v) simd::store(y + m * kTile + v * simd::kWidth, out[m][v]);
}

#endif

using TileRows = void (*)(const ChunkRows&, const float*, const uint8_t*, const uint16_t*,
                          int64_t, int64_t, int64_t, float*);

// The rows go through as chunks of kChunk, then of its halves down to 1 for the rest.
constexpr int64_t chunk_size(int i) { return kChunk >> i > 0 ? kChunk >> i : 1; }

template <typename Pairs>
void multiply(const QuantGemmArgs& a) {
  static constexpr TileRows kKernels[] = {
      tile_rows<Pairs, chunk_size(0)>, tile_rows<Pairs, chunk_size(1)>,
      tile_rows<Pairs, chunk_size(2)>, tile_rows<Pairs, chunk_size(3)>, tile_rows<Pairs, 1>};
  static_assert(chunk_size(4) == 1, "the last chunk takes single rows");
  const int64_t pairs = a.in / 2, groups = a.in / a.group_size, out_features = a.num_tiles * kTile;
  std::vector<float> xs(a.rows * groups);
  for (int64_t m = 0; m < a.rows; ++m)
    group_sums(a.x + m * a.stride, a.in, a.group_size, xs.data() + m * groups);
  const ChunkRows x(a);
  at::parallel_for(0, a.num_tiles, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float result[kChunk * kTile];
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile = a.tiles + t * pairs * Pairs::kBytes;
      const uint16_t* tile_sz = a.scales_zeros + t * groups * 2 * kTile;
      int64_t m0 = 0;
      for (int i = 0; m0 < a.rows; ++i) {
        const int64_t mt = chunk_size(i);
        for (; m0 + mt <= a.rows; m0 += mt) {
          kKernels[i](x, xs.data(), tile, tile_sz, m0, pairs, a.group_size / 2, result);
          for (int64_t m = 0; m < mt; ++m) {
            const int64_t first = (m0 + m) * out_features + t * kTile;
            if (a.y_float32)
              std::memcpy(static_cast<float*>(a.y) + first, result + m * kTile,
                          kTile * sizeof(float));
            else
              for (int64_t i = 0; i < kTile; i += simd::kWidth)
                simd::store_bf16(static_cast<uint16_t*>(a.y) + first + i, result + m * kTile + i);
          }
        }
      }
    }
  });
}

void quant_gemm(const QuantGemmArgs& a) {
  if (a.int4)
    multiply<Int4Pairs>(a);
  else
    multiply<Int8Pairs>(a);
}

}  // namespace quant_gemm
