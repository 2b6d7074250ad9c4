// The elementwise work of a decoder layer, one pass each, on CPU (tandem/engine/layer_ops.py).
//
// In a small-batch decode step these ops touch a few KB each, so their cost is the number of
// tensor ops, not bytes: torch runs an RMSNorm as ~6 ops (cast, pow, mean, add, rsqrt, mul),
// RoPE as ~10, SiLU-and-multiply as 3, a residual add as 1, each a dispatch and a new tensor.
// Here each is one call that reads its inputs once, computes in float32 and rounds once to the
// output dtype. Rows are split over threads when there are enough of them to pay for it.

#include "native.h"
#include "simd.h"

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstring>

namespace {

constexpr int64_t kGrain = 16;  // rows per thread task: decode steps stay on one thread

bool is_float(torch::ScalarType t) {
  return t == torch::kFloat32 || t == torch::kBFloat16 || t == torch::kFloat16;
}

// Calls f with a null pointer of the C++ type of `t` (float32, bfloat16 or float16).
template <typename F>
void dispatch(torch::ScalarType t, F&& f) {
  switch (t) {
    case torch::kFloat32: return f(static_cast<float*>(nullptr));
    case torch::kBFloat16: return f(static_cast<c10::BFloat16*>(nullptr));
    case torch::kFloat16: return f(static_cast<c10::Half*>(nullptr));
    default: TORCH_CHECK(false, "unsupported dtype ", t, ": float32, bfloat16 or float16");
  }
}

// A 2-D view [rows, cols] of t: contiguous within a row, rows at any stride.
void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1 && is_float(t.scalar_type()),
              name, ": a 2-D float32 / bfloat16 / float16 CPU tensor, unit stride within a row");
}

template <typename T>
const T* row_of(const torch::Tensor& t, int64_t r) {
  return reinterpret_cast<const T*>(t.data_ptr()) + r * t.stride(0);
}

template <typename T>
T* mutable_row_of(const torch::Tensor& t, int64_t r) {
  return reinterpret_cast<T*>(t.data_ptr()) + r * t.stride(0);
}

// sum of squares of x[0, n), as float32 lanes
float sum_squares(const float* x, int64_t n) {
  simd::Vec lanes = {};
  int64_t e = 0;
  for (; e + simd::kWidth <= n; e += simd::kWidth) {
    const simd::Vec v = simd::load(x + e);
    lanes += v * v;
  }
  float tail = 0.0f;
  for (; e < n; ++e) tail += x[e] * x[e];
  return simd::sum(lanes) + tail;
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, std::optional<torch::Tensor> delta, torch::Tensor weight,
                       double eps, torch::ScalarType dtype) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), cols = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == cols && weight.is_contiguous() &&
                  weight.scalar_type() == torch::kFloat32,
              "weight: float32 [", cols, "]");
  if (delta) {
    check_rows(*delta, "delta");
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && delta->sizes() == x.sizes() &&
                    x.stride(0) >= cols,
                "a residual update needs a float32 x of non-overlapping rows and a delta of its "
                "shape");
  }
  TORCH_CHECK(is_float(dtype), "dtype: float32, bfloat16 or float16");
  auto out = torch::empty({rows, cols}, x.options().dtype(dtype));
  const float* w = weight.data_ptr<float>();
  dispatch(x.scalar_type(), [&](auto* xt) {
    using X = std::remove_pointer_t<decltype(xt)>;
    dispatch(delta ? delta->scalar_type() : torch::kFloat32, [&](auto* dt) {
      using D = std::remove_pointer_t<decltype(dt)>;
      dispatch(dtype, [&](auto* ot) {
        using O = std::remove_pointer_t<decltype(ot)>;
        at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
          std::vector<float> buf(cols);
          for (int64_t r = begin; r < end; ++r) {
            float* v = buf.data();
            if constexpr (std::is_same_v<X, float>) {
              float* xr = mutable_row_of<float>(x, r);
              if (delta) {  // the residual stream takes the update in place, in float32
                const D* d = row_of<D>(*delta, r);
                for (int64_t e = 0; e < cols; ++e) xr[e] += static_cast<float>(d[e]);
              }
              v = xr;
            } else {
              const X* xr = row_of<X>(x, r);
              for (int64_t e = 0; e < cols; ++e) v[e] = static_cast<float>(xr[e]);
            }
            const float inv = 1.0f / std::sqrt(sum_squares(v, cols) / cols + static_cast<float>(eps));
            O* o = out.data_ptr<O>() + r * cols;
            for (int64_t e = 0; e < cols; ++e) o[e] = static_cast<O>(v[e] * inv * w[e]);
          }
        });
      });
    });
  });
  return out;
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), half = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up: [rows, 2 * intermediate]");
  auto out = torch::empty({rows, half}, gate_up.options());
  dispatch(gate_up.scalar_type(), [&](auto* tt) {
    using T = std::remove_pointer_t<decltype(tt)>;
    at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
      std::vector<float> g(half);
      for (int64_t r = begin; r < end; ++r) {
        const T* in = row_of<T>(gate_up, r);
        T* o = out.data_ptr<T>() + r * half;
        for (int64_t e = 0; e < half; ++e) g[e] = static_cast<float>(in[e]);
        int64_t e = 0;
        for (; e + simd::kWidth <= half; e += simd::kWidth) {  // silu(x) = x / (1 + e^-x)
          const simd::Vec x = simd::load(&g[e]);
          simd::store(&g[e], x / (1.0f + simd::exp(-x)));
        }
        for (; e < half; ++e) g[e] = g[e] / (1.0f + std::exp(-g[e]));
        for (e = 0; e < half; ++e) o[e] = static_cast<T>(g[e] * static_cast<float>(in[half + e]));
      }
    });
  });
  return out;
}

void rotary(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin,
            int64_t head_dim) {
  check_rows(q, "q");
  check_rows(k, "k");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t rows = q.size(0), half = head_dim / 2;
  TORCH_CHECK(head_dim % 2 == 0 && q.size(1) % head_dim == 0 && k.size(1) % head_dim == 0 &&
                  k.size(0) == rows && cos.size(0) == rows && sin.size(0) == rows &&
                  cos.size(1) == head_dim && sin.size(1) == head_dim,
              "q [n, heads * head_dim], k [n, kv_heads * head_dim], cos and sin [n, head_dim]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && cos.scalar_type() == sin.scalar_type(),
              "q and k of one dtype, cos and sin of one dtype");
  dispatch(q.scalar_type(), [&](auto* tt) {
    using T = std::remove_pointer_t<decltype(tt)>;
    dispatch(cos.scalar_type(), [&](auto* ct) {
      using C = std::remove_pointer_t<decltype(ct)>;
      at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
        std::vector<float> c(head_dim), s(head_dim);
        for (int64_t r = begin; r < end; ++r) {
          const C* cr = row_of<C>(cos, r);
          const C* sr = row_of<C>(sin, r);
          for (int64_t e = 0; e < head_dim; ++e) {
            c[e] = static_cast<float>(cr[e]);
            s[e] = static_cast<float>(sr[e]);
          }
          // x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[half:], x[:half])
          for (const torch::Tensor* t : {&q, &k}) {
            T* row = mutable_row_of<T>(*t, r);
            for (int64_t h = 0; h < t->size(1) / head_dim; ++h) {
              T* x = row + h * head_dim;
              for (int64_t e = 0; e < half; ++e) {
                const float a = static_cast<float>(x[e]), b = static_cast<float>(x[e + half]);
                x[e] = static_cast<T>(a * c[e] - b * s[e]);
                x[e + half] = static_cast<T>(b * c[e + half] + a * s[e + half]);
              }
            }
          }
        }
      });
    });
  });
}

void scatter_rows(torch::Tensor dst, torch::Tensor index, torch::Tensor src) {
  TORCH_CHECK(dst.device().is_cpu() && src.device().is_cpu() && dst.is_contiguous() &&
                  dst.dim() >= 1 && src.dim() == dst.dim() &&
                  src.element_size() == dst.element_size(),
              "dst: a contiguous CPU tensor; src: rows of the same element size and rank");
  TORCH_CHECK(index.device().is_cpu() && index.scalar_type() == torch::kInt64 &&
                  index.dim() == 1 && index.is_contiguous() && index.size(0) == src.size(0),
              "index: int64 [", src.size(0), "]");
  for (int64_t d = 1; d < dst.dim(); ++d)
    TORCH_CHECK(src.size(d) == dst.size(d), "src rows must have dst's row shape");
  TORCH_CHECK(src.size(0) == 0 || src.select(0, 0).is_contiguous(), "src: contiguous rows");
  const int64_t n = src.size(0), slots = dst.size(0);
  const int64_t row_bytes = dst.numel() / std::max<int64_t>(slots, 1) * dst.element_size();
  const int64_t src_stride = src.stride(0) * src.element_size();
  const int64_t* idx = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(idx[i] >= 0 && idx[i] < slots, "index ", idx[i], " out of range for ", slots,
                " rows");
  char* d = static_cast<char*>(dst.data_ptr());
  const char* s = static_cast<const char*>(src.data_ptr());
  for (int64_t i = 0; i < n; ++i) std::memcpy(d + idx[i] * row_bytes, s + i * src_stride, row_bytes);
}
