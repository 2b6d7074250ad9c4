// Weights times a few rows, y = x W^T, for the 1-32 row products of decoding and speculative
// verification on CPU, float32 or bfloat16 (tandem/engine/models/linear.py calls it).
//
// At a handful of rows a decoder's linear layers are bound by reading their weights, once per
// call, and every row more should cost only its multiplies; torch's CPU GEMMs are far from that
// from 3 rows on (float32) and at every row count (bfloat16). Here each weight row (an output
// channel, contiguous along the inputs, as nn.Linear stores it) is read once per call and
// multiplied with every input row while it sits in registers: a block of NT output channels x MT
// rows keeps NT * MT accumulators, walks the inputs a register at a time, and folds each
// accumulator once at the end. bfloat16 weights and rows are multiplied in pairs and summed in
// float32 by `vdpbf16ps` where the CPU has AVX-512 BF16, else widened to float32 as they are
// read; each result is rounded once to bfloat16. linear.py says which row counts come here and
// what was measured.
//
// An output's arithmetic does not depend on the other rows of the call or on where its block
// falls, so a row gets the same result whatever the number of rows: a token verified among drafts
// gets the logits a decode step gives it. torch's bfloat16 GEMM does not hold to that (on
// SmolLM2's down projection the first of several rows differs from the row alone), which made
// greedy speculative decoding in bfloat16 emit other tokens than plain decoding.

#include "native.h"
#include "simd.h"

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TANDEM_BF16_DOTS 1
#endif

namespace {

constexpr int64_t kMaxRows = 8;     // rows a block multiplies at once; more go in chunks
constexpr int64_t kPrefetch = 256;  // elements ahead of the current input on each weight row

inline float widen(float v) { return v; }
using simd::widen;

// y[m, n0 + j] for m < MT, j < NT from the accumulated lanes: each folded, plus the products of
// the inputs from k on that did not fill a register.
template <int MT, int NT, typename T>
void finish(const simd::Vec (&lanes)[NT][MT], const T* const* w, const T* x, int64_t k,
            int64_t in, float* y, int64_t out, int64_t n0) {
  for (int j = 0; j < NT; ++j)
    for (int m = 0; m < MT; ++m) {
      float s = simd::sum(lanes[j][m]);
      for (int64_t e = k; e < in; ++e) s += widen(w[j][e]) * widen(x[m * in + e]);
      y[m * out + n0 + j] = s;
    }
}

#ifdef TANDEM_BF16_DOTS
// `block` (below) for bfloat16 with `vdpbf16ps`: lane i of an accumulator gathers the products
// of inputs 2i and 2i + 1 of every 32.
template <int MT, int NT>
void block_dots(const uint16_t* x, int64_t in, const uint16_t* weight, float* y, int64_t out,
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

// y[m, n0 + j] for m < MT, j < NT: weight rows n0.. against input rows 0..MT-1; T is float or
// the bits of bfloat16 (uint16_t).
template <int MT, int NT, typename T>
void block(const T* x, int64_t in, const T* weight, float* y, int64_t out, int64_t n0) {
#ifdef TANDEM_BF16_DOTS
  if constexpr (std::is_same_v<T, uint16_t>) return block_dots<MT, NT>(x, in, weight, y, out, n0);
#endif
  simd::Vec acc[NT][MT];
  for (int j = 0; j < NT; ++j)
    for (int m = 0; m < MT; ++m) acc[j][m] = simd::Vec{};
  const T* w[NT];
  for (int j = 0; j < NT; ++j) w[j] = weight + (n0 + j) * in;
  int64_t k = 0;
  for (; k + simd::kWidth <= in; k += simd::kWidth) {
    simd::Vec xv[MT];
    for (int m = 0; m < MT; ++m) {
      xv[m] = simd::load(x + m * in + k);
#ifdef __AVX512F__  // a Vec is one register: keep the inputs there, not reloaded per weight row
      asm("" : "+v"(xv[m]));
#endif
    }
    for (int j = 0; j < NT; ++j) {
      __builtin_prefetch(w[j] + k + kPrefetch);
      const simd::Vec wv = simd::load(w[j] + k);
      for (int m = 0; m < MT; ++m) acc[j][m] += wv * xv[m];
    }
  }
  finish<MT, NT>(acc, w, x, k, in, y, out, n0);
}

// All output channels for MT rows, blocks of NT channels spread over the threads.
template <int MT, typename T>
void rows(const T* x, int64_t in, const T* weight, float* y, int64_t out) {
  constexpr int NT = MT <= 4 ? 4 : 2;  // NT * MT accumulators, within the 32 vector registers
  at::parallel_for(0, out / NT, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) block<MT, NT>(x, in, weight, y, out, b * NT);
  });
  for (int64_t n = out / NT * NT; n < out; ++n) block<MT, 1>(x, in, weight, y, out, n);
}

template <int MT, typename T>
void rows_upto(int64_t m, const T* x, int64_t in, const T* weight, float* y, int64_t out) {
  if constexpr (MT > 1) {
    if (m < MT) return rows_upto<MT - 1>(m, x, in, weight, y, out);
  }
  rows<MT>(x, in, weight, y, out);
}

template <typename T>
void row_gemm_of(const torch::Tensor& x, const torch::Tensor& weight, torch::Tensor& y) {
  const int64_t rows_in = x.size(0), in = x.size(1), out = weight.size(0);
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const T* wp = reinterpret_cast<const T*>(weight.data_ptr());
  float* yp = y.data_ptr<float>();
  for (int64_t m0 = 0; m0 < rows_in; m0 += kMaxRows) {
    const int64_t m = std::min(kMaxRows, rows_in - m0);
    rows_upto<kMaxRows>(m, xp + m0 * in, in, wp, yp + m0 * out, out);
  }
}

}  // namespace

bool row_gemm_supported() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

torch::Tensor row_gemm(torch::Tensor x, torch::Tensor weight, std::optional<torch::Tensor> bias) {
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16,
              "weight: float32 or bfloat16, got ", dtype);
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.is_contiguous(),
              "weight: a contiguous 2-D CPU tensor");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == dtype,
              "x: a 2-D CPU tensor of the weight's dtype");
  TORCH_CHECK(x.size(1) == weight.size(1), "x has ", x.size(1), " inputs, weight ", weight.size(1));
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == weight.size(0) &&
                        bias->scalar_type() == dtype && bias->device().is_cpu()),
              "bias: one value per output, of the weight's dtype");
  const torch::Tensor input = x.contiguous();
  torch::Tensor y =
      torch::empty({input.size(0), weight.size(0)}, input.options().dtype(torch::kFloat32));
  if (dtype == torch::kFloat32) {
    row_gemm_of<float>(input, weight, y);
  } else {
    row_gemm_of<uint16_t>(input, weight, y);
  }
  if (bias) y.add_(bias->to(torch::kFloat32));  // in float32, before the one rounding
  return dtype == torch::kFloat32 ? y : y.to(dtype);
}
