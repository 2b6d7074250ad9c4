// float32 weights times a few rows, y = x W^T, for the 5-16 row products of speculative
// verification and small-batch decoding on CPU (tandem/engine/models/linear.py calls it).
//
// At a handful of rows a decoder's linear layers are bound by reading their weights, once per
// call, and every row more should cost only its multiplies. torch's float32 GEMM does not get
// there: on SmolLM2 (30 layers and the LM head, 2 threads, cold weights) a step's products take
// 19 ms at 1 row and 50 ms at 6-8 rows. Here each weight row (an output channel, contiguous
// along the inputs, as nn.Linear stores it) is read once per call and multiplied with every input
// row while it sits in registers: a block of NT output channels x MT rows keeps NT * MT
// accumulators of kWidth lanes, walks the inputs kWidth at a time, and folds each accumulator
// once at the end. The same step: 32 ms at 6 rows, 35 at 8. Below 5 rows torch's matrix-vector
// route is as fast or faster (linear.py keeps it there).
//
// An output's arithmetic does not depend on the other rows of the call or on where its block
// falls, so a row gets the same result whatever the number of rows.

#include "native.h"
#include "simd.h"

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>

namespace {

constexpr int64_t kMaxRows = 8;     // rows a block multiplies at once; more go in chunks
constexpr int64_t kPrefetch = 256;  // floats ahead of the current input on each weight row

// y[m, n0 + j] for m < MT, j < NT: weight rows n0.. against input rows 0..MT-1.
template <int MT, int NT>
void block(const float* x, int64_t in, const float* weight, float* y, int64_t out, int64_t n0) {
  simd::Vec acc[NT][MT];
  for (int j = 0; j < NT; ++j)
    for (int m = 0; m < MT; ++m) acc[j][m] = simd::Vec{};
  const float* w[NT];
  for (int j = 0; j < NT; ++j) w[j] = weight + (n0 + j) * in;
  int64_t k = 0;
  for (; k + simd::kWidth <= in; k += simd::kWidth) {
    simd::Vec xv[MT];
    for (int m = 0; m < MT; ++m) {
      xv[m] = simd::load(x + m * in + k);
      asm("" : "+v"(xv[m]));  // keep the inputs in registers: not reloaded for every weight row
    }
    for (int j = 0; j < NT; ++j) {
      __builtin_prefetch(w[j] + k + kPrefetch);
      const simd::Vec wv = simd::load(w[j] + k);
      for (int m = 0; m < MT; ++m) acc[j][m] += wv * xv[m];
    }
  }
  for (int j = 0; j < NT; ++j)
    for (int m = 0; m < MT; ++m) {
      float s = simd::sum(acc[j][m]);
      for (int64_t e = k; e < in; ++e) s += w[j][e] * x[m * in + e];
      y[m * out + n0 + j] = s;
    }
}

// All output channels for MT rows, blocks of NT channels spread over the threads.
template <int MT>
void rows(const float* x, int64_t in, const float* weight, float* y, int64_t out) {
  constexpr int NT = MT <= 4 ? 4 : 2;  // NT * MT accumulators, within the 32 vector registers
  at::parallel_for(0, out / NT, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) block<MT, NT>(x, in, weight, y, out, b * NT);
  });
  for (int64_t n = out / NT * NT; n < out; ++n) block<MT, 1>(x, in, weight, y, out, n);
}

template <int MT>
void rows_upto(int64_t m, const float* x, int64_t in, const float* weight, float* y, int64_t out) {
  if constexpr (MT > 1) {
    if (m < MT) return rows_upto<MT - 1>(m, x, in, weight, y, out);
  }
  rows<MT>(x, in, weight, y, out);
}

}  // namespace

torch::Tensor row_gemm(torch::Tensor x, torch::Tensor weight) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == torch::kFloat32,
              "x: a 2-D float32 CPU tensor");
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.scalar_type() == torch::kFloat32,
              "weight: a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(x.size(1) == weight.size(1), "x has ", x.size(1), " inputs, weight ", weight.size(1));
  const torch::Tensor input = x.contiguous();
  const int64_t rows_in = input.size(0), in = input.size(1), out = weight.size(0);
  torch::Tensor y = torch::empty({rows_in, out}, input.options());
  const float* xp = input.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t m0 = 0; m0 < rows_in; m0 += kMaxRows) {
    const int64_t m = std::min(kMaxRows, rows_in - m0);
    rows_upto<kMaxRows>(m, xp + m0 * in, in, wp, yp + m0 * out, out);
  }
  return y;
}
