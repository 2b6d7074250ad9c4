// Weights times a few rows, y = x W^T, for the 1-32 row products of decoding and speculative
// verification on CPU, float32 or bfloat16 (tandem/engine/models/linear.py routes to it).
//
// At a handful of rows a decoder's linear layers are bound by reading their weights, once per
// call, and every row more should cost only its multiplies; torch's CPU GEMMs are far from that
// from 3 rows on (float32) and at every row count (bfloat16). Here each weight row (an output
// channel, contiguous along the inputs, as nn.Linear stores it) is read once per call and
// multiplied with every input row while it sits in registers: a block of NT output channels x MT
// rows keeps NT * MT accumulators, walks the inputs a register at a time, and folds each
// accumulator once at the end. The block's shape follows the level's registers
// (TANDEM_VEC_REGISTERS: 32 zmm on AVX-512, 16 ymm on AVX2): NT * MT accumulators, the MT inputs
// and one weight register fit, or the inputs are read from L1 at each use rather than spilled. bfloat16 weights and rows are multiplied in pairs and summed in
// float32 by `vdpbf16ps` where the CPU has AVX-512 BF16; elsewhere the rows are widened to
// float32 once per call and the weights as they are read. Each result is rounded once.
//
// An output's arithmetic does not depend on the other rows of the call or on where its block
// falls, so a row gets the same result whatever the number of rows: a token verified among drafts
// gets the logits a decode step gives it. torch's bfloat16 GEMM does not hold to that (on
// SmolLM2's down projection the first of several rows differs from the row alone), which made
// greedy speculative decoding in bfloat16 emit other tokens than plain decoding.
//
// Included once per instruction-set level, inside its namespace (isa_kernels.h): no includes.

namespace row_gemm {

constexpr int64_t kMaxRows = 8;     // rows a block multiplies at once; more go in chunks
constexpr int64_t kPrefetch = 256;  // elements ahead of the current input on each weight row

inline float widen(float v) { return v; }
using simd::widen;

// Output channels of a block of `mt` rows: as many as leave room for the inputs and a weight
// register, 1 to 4.
constexpr int channels_for(int mt) {
  const int nt = (TANDEM_VEC_REGISTERS - 1 - mt) / mt;
  return nt < 1 ? 1 : nt > 4 ? 4 : nt;
}

// y[m, n0 + j] for m < MT, j < NT from the accumulated lanes: each folded, plus the products of
// the inputs from k on that did not fill a register.
template <int MT, int NT, typename X, typename W>
void finish(const simd::Vec (&lanes)[NT][MT], const W* const* w, const X* x, int64_t k,
            int64_t in, float* y, int64_t out, int64_t n0) {
  for (int j = 0; j < NT; ++j)
    for (int m = 0; m < MT; ++m) {
      float s = simd::sum(lanes[j][m]);
      for (int64_t e = k; e < in; ++e) s += widen(w[j][e]) * widen(x[m * in + e]);
      y[m * out + n0 + j] = s;
    }
}

// y[m, n0 + j] for m < MT, j < NT: weight rows n0.. against float32 input rows 0..MT-1; W is
// float or the bits of bfloat16 (uint16_t).
template <int MT, int NT, typename W>
void block(const float* x, int64_t in, const W* weight, float* y, int64_t out, int64_t n0) {
  constexpr bool kInputsInRegisters = NT * MT + MT + 1 <= TANDEM_VEC_REGISTERS;
  simd::Vec acc[NT][MT];
  for (int j = 0; j < NT; ++j)
    for (int m = 0; m < MT; ++m) acc[j][m] = simd::Vec{};
  const W* w[NT];
  for (int j = 0; j < NT; ++j) w[j] = weight + (n0 + j) * in;
  int64_t k = 0;
  for (; k + simd::kWidth <= in; k += simd::kWidth) {
    simd::Vec xv[MT];
    if constexpr (kInputsInRegisters) {
      for (int m = 0; m < MT; ++m) {
        xv[m] = simd::load(x + m * in + k);
        simd::keep_in_register(xv[m]);  // not reloaded per weight row
      }
    }
    for (int j = 0; j < NT; ++j) {
      __builtin_prefetch(w[j] + k + kPrefetch);
      const simd::Vec wv = simd::load(w[j] + k);
      for (int m = 0; m < MT; ++m)
        acc[j][m] += wv * (kInputsInRegisters ? xv[m] : simd::load(x + m * in + k));
    }
  }
  finish<MT, NT>(acc, w, x, k, in, y, out, n0);
}

#if TANDEM_BF16_DOTS
// `block` for bfloat16 rows with `vdpbf16ps`: lane i of an accumulator gathers the products of
// inputs 2i and 2i + 1 of every 32.
template <int MT, int NT>
void block(const uint16_t* x, int64_t in, const uint16_t* weight, float* y, int64_t out,
                int64_t n0) {
  constexpr int64_t kStep = 2 * simd::kWidth;
  __m512 acc[NT][MT];
  for (int j = 0; j < NT; ++j)
    for (int m = 0; m < MT; ++m) acc[j][m] = _mm512_setzero_ps();
  const uint16_t* w[NT];
  for (int j = 0; j < NT; ++j) w[j] = weight + (n0 + j) * in;
  int64_t k = 0;
  for (; k + kStep <= in; k += kStep) {
    __m512i xv[MT];
    for (int m = 0; m < MT; ++m) {
      xv[m] = _mm512_loadu_si512(x + m * in + k);
      asm("" : "+v"(xv[m]));
    }
    for (int j = 0; j < NT; ++j) {
      __builtin_prefetch(w[j] + k + kPrefetch);
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w[j] + k);
      for (int m = 0; m < MT; ++m) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], wv, (__m512bh)xv[m]);
    }
  }
  simd::Vec lanes[NT][MT];
  std::memcpy(lanes, acc, sizeof lanes);
  finish<MT, NT>(lanes, w, x, k, in, y, out, n0);
}
#endif

// All output channels for MT rows, blocks of NT channels spread over the threads. X: float32
// rows, or bfloat16 bits where the level has bfloat16 dot products.
template <int MT, typename X, typename W>
void rows(const X* x, int64_t in, const W* weight, float* y, int64_t out) {
  constexpr int NT = channels_for(MT);
  at::parallel_for(0, out / NT, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) block<MT, NT>(x, in, weight, y, out, b * NT);
  });
  for (int64_t n = out / NT * NT; n < out; ++n) block<MT, 1>(x, in, weight, y, out, n);
}

template <int MT, typename X, typename W>
void rows_upto(int64_t m, const X* x, int64_t in, const W* weight, float* y, int64_t out) {
  if constexpr (MT > 1) {
    if (m < MT) return rows_upto<MT - 1>(m, x, in, weight, y, out);
  }
  rows<MT>(x, in, weight, y, out);
}

template <typename X, typename W>
void in_chunks(const X* x, int64_t rows_in, int64_t in, const W* w, float* y, int64_t out) {
  for (int64_t m0 = 0; m0 < rows_in; m0 += kMaxRows) {
    const int64_t m = std::min(kMaxRows, rows_in - m0);
    rows_upto<kMaxRows>(m, x + m0 * in, in, w, y + m0 * out, out);
  }
}

void row_gemm(const void* x, const void* weight, float* y, int64_t rows_in, int64_t in,
              int64_t out, bool bf16) {
  if (!bf16)
    return in_chunks(static_cast<const float*>(x), rows_in, in, static_cast<const float*>(weight),
                     y, out);
  const auto* xbits = static_cast<const uint16_t*>(x);
  const auto* wbits = static_cast<const uint16_t*>(weight);
#if TANDEM_BF16_DOTS
  in_chunks(xbits, rows_in, in, wbits, y, out);
#else
  std::vector<float> wide(rows_in * in);  // the rows as float32, once: exact
  for (int64_t e = 0; e < rows_in * in; ++e) wide[e] = widen(xbits[e]);
  in_chunks(wide.data(), rows_in, in, wbits, y, out);
#endif
}

}  // namespace row_gemm
