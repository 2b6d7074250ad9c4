// Weights times a few rows, y = x W^T, for the 1-32 row products of decoding and speculative
// verification on CPU, float32 or bfloat16 (tandem/engine/models/linear.py routes to it).
//
// At a handful of rows a decoder's linear layers are bound by reading their weights, once per
// call, and every row more should cost only its multiplies; torch's CPU GEMMs are far from that
// from 3 rows on (float32) and at every row count (bfloat16). Here each weight row (an output
// channel, contiguous along the inputs, as nn.Linear stores it) is read once per call, front to
// back, and multiplied with every input row while it sits in a register: one accumulator per
// input row (the inputs read from L1) walks the inputs a register at a time and is folded once
// at the end. bfloat16 weights and rows are multiplied in pairs and summed in float32 by
// `vdpbf16ps` where the CPU has AVX-512 BF16; elsewhere the rows are widened to float32 once per
// call and the weights as they are read. Each result is rounded once.
//
// One channel at a time, so that each thread reads its share of the weights as one forward
// stream, which the prefetchers follow. Until 7 December a block of 2-4 channels was read side
// by side (its accumulators filling the registers), and those interleaved streams, each a weight
// row of a few KB, were read at half the rate: Zen 4, 2 threads, 3072 x 576, one row, bfloat16
// 17-18 -> 25-35 GB/s, float32 20-24 -> 26-31 GB/s; 1-16 rows never slower, AVX-512 and AVX2.
//
// An output's arithmetic does not depend on the other rows of the call or on which thread computes
// it, so a row gets the same result whatever the number of rows: a token verified among drafts
// gets the logits a decode step gives it. torch's bfloat16 GEMM does not hold to that (on
// SmolLM2's down projection the first of several rows differs from the row alone), which made
// greedy speculative decoding in bfloat16 emit other tokens than plain decoding.
//
// Included once per instruction-set level, inside its namespace (isa_kernels.h): no includes.

namespace row_gemm {

constexpr int64_t kMaxRows = 8;  // rows a weight row meets in one pass; more go in chunks
constexpr int64_t kPrefetch = 256;  // elements ahead of the current input on the weight row
constexpr int64_t kGrainChannels = 64;  // the fewest output channels a thread takes

inline float widen(float v) { return v; }
using simd::widen;

// Where the results go: y [rows, out], float32 or bfloat16, each result plus its channel's bias
// (float32, if any) and rounded once; written by the kernel, so a call makes no float32 copy for
// torch to convert (a dispatched op per call, ~120 a SmolLM2 decode step).
struct Out {
  void* y;
  const float* bias;
  int64_t out;
  bool bf16;

  void put(int64_t m, int64_t n, float s) const {
    if (bias) s += bias[n];
    if (bf16)
      static_cast<c10::BFloat16*>(y)[m * out + n] = c10::BFloat16(s);  // to nearest even
    else
      static_cast<float*>(y)[m * out + n] = s;
  }
};

// y[m, n] for m < MT from the accumulated lanes: each folded, plus the products of the inputs
// from k on that did not fill a register.
template <int MT, typename X, typename W>
void finish(const simd::Vec (&lanes)[MT], const W* w, const X* x, int64_t k, int64_t in,
            const Out& y, int64_t n) {
  for (int m = 0; m < MT; ++m) {
    float s = simd::sum(lanes[m]);
    for (int64_t e = k; e < in; ++e) s += widen(w[e]) * widen(x[m * in + e]);
    y.put(m, n, s);
  }
}

// y[m, n] for m < MT: weight row n against float32 input rows 0..MT-1; W is float or the bits of
// bfloat16 (uint16_t).
template <int MT, typename W>
void channel(const float* x, int64_t in, const W* weight, const Out& y, int64_t n) {
  simd::Vec acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = simd::Vec{};
  const W* w = weight + n * in;
  int64_t k = 0;
  for (; k + simd::kWidth <= in; k += simd::kWidth) {
    __builtin_prefetch(w + k + kPrefetch);
    const simd::Vec wv = simd::load(w + k);
    for (int m = 0; m < MT; ++m) acc[m] += wv * simd::load(x + m * in + k);
  }
  finish<MT>(acc, w, x, k, in, y, n);
}

#if TANDEM_BF16_DOTS
// `channel` for bfloat16 rows with `vdpbf16ps`: lane i of an accumulator gathers the products of
// inputs 2i and 2i + 1 of every 32.
template <int MT>
void channel(const uint16_t* x, int64_t in, const uint16_t* weight, const Out& y, int64_t n) {
  constexpr int64_t kStep = 2 * simd::kWidth;
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  const uint16_t* w = weight + n * in;
  int64_t k = 0;
  for (; k + kStep <= in; k += kStep) {
    __builtin_prefetch(w + k + kPrefetch);
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k);
    for (int m = 0; m < MT; ++m)
      acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_loadu_si512(x + m * in + k));
  }
  simd::Vec lanes[MT];
  std::memcpy(lanes, acc, sizeof lanes);
  finish<MT>(lanes, w, x, k, in, y, n);
}
#endif

// All output channels for MT rows, spread over the threads in runs of channels. X: float32
// rows, or bfloat16 bits where the level has bfloat16 dot products.
template <int MT, typename X, typename W>
void rows(const X* x, int64_t in, const W* weight, const Out& y) {
  at::parallel_for(0, y.out, kGrainChannels, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) channel<MT>(x, in, weight, y, n);
  });
}

template <int MT, typename X, typename W>
void rows_upto(int64_t m, const X* x, int64_t in, const W* weight, const Out& y) {
  if constexpr (MT > 1) {
    if (m < MT) return rows_upto<MT - 1>(m, x, in, weight, y);
  }
  rows<MT>(x, in, weight, y);
}

template <typename X, typename W>
void in_chunks(const X* x, int64_t rows_in, int64_t in, const W* w, Out y) {
  const int64_t bytes = y.bf16 ? sizeof(uint16_t) : sizeof(float);
  void* const first = y.y;
  for (int64_t m0 = 0; m0 < rows_in; m0 += kMaxRows) {
    const int64_t m = std::min(kMaxRows, rows_in - m0);
    y.y = static_cast<char*>(first) + m0 * y.out * bytes;
    rows_upto<kMaxRows>(m, x + m0 * in, in, w, y);
  }
}

void row_gemm(const void* x, const void* weight, const float* bias, void* y, int64_t rows_in,
              int64_t in, int64_t out, bool bf16) {
  const Out to{y, bias, out, bf16};
  if (!bf16)
    return in_chunks(static_cast<const float*>(x), rows_in, in, static_cast<const float*>(weight),
                     to);
  const auto* xbits = static_cast<const uint16_t*>(x);
  const auto* wbits = static_cast<const uint16_t*>(weight);
#if TANDEM_BF16_DOTS
  in_chunks(xbits, rows_in, in, wbits, to);
#else
  std::vector<float> wide(rows_in * in);  // the rows as float32, once: exact
  for (int64_t e = 0; e < rows_in * in; ++e) wide[e] = widen(xbits[e]);
  in_chunks(wide.data(), rows_in, in, wbits, to);
#endif
}

}  // namespace row_gemm
