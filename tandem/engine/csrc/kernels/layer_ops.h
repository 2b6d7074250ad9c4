// The elementwise work of a decoder layer, one pass each (the wrappers: layer_ops.cpp).
//
// In a small-batch decode step these ops touch a few KB each, so their cost is the number of
// tensor ops, not bytes: torch runs an RMSNorm as ~6 ops (cast, pow, mean, add, rsqrt, mul),
// RoPE as ~10, SiLU-and-multiply as 3, a residual add as 1, each a dispatch and a new tensor.
// Here each is one call that reads its inputs once, computes in float32 and rounds once to the
// output dtype. Rows are split over threads when there are enough of them to pay for it.
//
// Included once per instruction-set level, inside its namespace (isa_kernels.h): no includes.

namespace layer_ops {

constexpr int64_t kGrain = 16;  // rows per thread task: decode steps stay on one thread

// Calls f with a null pointer of the C++ type of `t` (float32, bfloat16 or float16; the
// wrappers refuse the rest).
template <typename F>
void dispatch(c10::ScalarType t, F&& f) {
  switch (t) {
    case c10::ScalarType::BFloat16: return f(static_cast<c10::BFloat16*>(nullptr));
    case c10::ScalarType::Half: return f(static_cast<c10::Half*>(nullptr));
    default: return f(static_cast<float*>(nullptr));
  }
}

template <typename T>
T* row_of(const Rows& t, int64_t r) {
  return static_cast<T*>(t.data) + r * t.stride;
}

// sum of squares of x[0, n), as float32 lanes
inline float sum_squares(const float* x, int64_t n) {
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

void rms_norm(const Rows& x, const Rows& delta, const float* w, float eps, const Rows& out) {
  const int64_t cols = x.cols;
  dispatch(x.dtype, [&](auto* xt) {
    using X = std::remove_pointer_t<decltype(xt)>;
    dispatch(delta.dtype, [&](auto* dt) {
      using D = std::remove_pointer_t<decltype(dt)>;
      dispatch(out.dtype, [&](auto* ot) {
        using O = std::remove_pointer_t<decltype(ot)>;
        at::parallel_for(0, x.rows, kGrain, [&](int64_t begin, int64_t end) {
          std::vector<float> buf(cols);
          for (int64_t r = begin; r < end; ++r) {
            float* v = buf.data();
            if constexpr (std::is_same_v<X, float>) {
              float* xr = row_of<float>(x, r);
              if (delta.data) {  // the residual stream takes the update in place, in float32
                const D* d = row_of<D>(delta, r);
                for (int64_t e = 0; e < cols; ++e) xr[e] += static_cast<float>(d[e]);
              }
              v = xr;
            } else {
              const X* xr = row_of<X>(x, r);
              for (int64_t e = 0; e < cols; ++e) v[e] = static_cast<float>(xr[e]);
            }
            const float inv = 1.0f / std::sqrt(sum_squares(v, cols) / cols + eps);
            O* o = row_of<O>(out, r);
            for (int64_t e = 0; e < cols; ++e) o[e] = static_cast<O>(v[e] * inv * w[e]);
          }
        });
      });
    });
  });
}

void silu_mul(const Rows& gate_up, const Rows& out) {
  const int64_t half = gate_up.cols / 2;
  dispatch(gate_up.dtype, [&](auto* tt) {
    using T = std::remove_pointer_t<decltype(tt)>;
    at::parallel_for(0, gate_up.rows, kGrain, [&](int64_t begin, int64_t end) {
      std::vector<float> g(half);
      for (int64_t r = begin; r < end; ++r) {
        const T* in = row_of<T>(gate_up, r);
        T* o = row_of<T>(out, r);
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
}

void rotary(const Rows& q, const Rows& k, const Rows& cos, const Rows& sin, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  dispatch(q.dtype, [&](auto* tt) {
    using T = std::remove_pointer_t<decltype(tt)>;
    dispatch(cos.dtype, [&](auto* ct) {
      using C = std::remove_pointer_t<decltype(ct)>;
      at::parallel_for(0, q.rows, kGrain, [&](int64_t begin, int64_t end) {
        std::vector<float> c(head_dim), s(head_dim);
        for (int64_t r = begin; r < end; ++r) {
          const C* cr = row_of<C>(cos, r);
          const C* sr = row_of<C>(sin, r);
          for (int64_t e = 0; e < head_dim; ++e) {
            c[e] = static_cast<float>(cr[e]);
            s[e] = static_cast<float>(sr[e]);
          }
          // x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[half:], x[:half])
          for (const Rows* t : {&q, &k}) {
            T* row = row_of<T>(*t, r);
            for (int64_t h = 0; h < t->cols / head_dim; ++h) {
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

}  // namespace layer_ops
