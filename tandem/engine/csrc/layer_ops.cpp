// The elementwise work of a decoder layer (tandem/engine/layer_ops.py): the checks and output
// tensors around the level's kernels (kernels/layer_ops.h says what they compute), and the KV
// slot scatter, a row of memcpy each.

#include "native.h"

#include <algorithm>
#include <cstring>

namespace {

bool is_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// A 2-D view [rows, cols] of t: contiguous within a row, rows at any stride.
void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1 && is_float(t.scalar_type()),
              name, ": a 2-D float32 / bfloat16 / float16 CPU tensor, unit stride within a row");
}

isa::Rows rows_of(const at::Tensor& t) {
  return {t.data_ptr(), t.size(0), t.size(1), t.stride(0), t.scalar_type()};
}

}  // namespace

at::Tensor rms_norm(const isa::Kernels& kernels, at::Tensor x,
                       std::optional<at::Tensor> delta, at::Tensor weight, double eps,
                       at::ScalarType dtype) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), cols = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == cols && weight.is_contiguous() &&
                  weight.scalar_type() == at::kFloat,
              "weight: float32 [", cols, "]");
  if (delta) {
    check_rows(*delta, "delta");
    TORCH_CHECK(x.scalar_type() == at::kFloat && delta->sizes() == x.sizes() &&
                    x.stride(0) >= cols,
                "a residual update needs a float32 x of non-overlapping rows and a delta of its "
                "shape");
  }
  TORCH_CHECK(is_float(dtype), "dtype: float32, bfloat16 or float16");
  auto out = at::empty({rows, cols}, x.options().dtype(dtype));
  const isa::Rows none{nullptr, 0, 0, 0, at::kFloat};
  kernels.rms_norm(rows_of(x), delta ? rows_of(*delta) : none, weight.data_ptr<float>(),
                   static_cast<float>(eps), rows_of(out));
  return out;
}

at::Tensor silu_mul(const isa::Kernels& kernels, at::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up: [rows, 2 * intermediate]");
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  kernels.silu_mul(rows_of(gate_up), rows_of(out));
  return out;
}

void rotary(const isa::Kernels& kernels, at::Tensor q, at::Tensor k, at::Tensor cos,
            at::Tensor sin, int64_t head_dim) {
  check_rows(q, "q");
  check_rows(k, "k");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t rows = q.size(0);
  TORCH_CHECK(head_dim % 2 == 0 && q.size(1) % head_dim == 0 && k.size(1) % head_dim == 0 &&
                  k.size(0) == rows && cos.size(0) == rows && sin.size(0) == rows &&
                  cos.size(1) == head_dim && sin.size(1) == head_dim,
              "q [n, heads * head_dim], k [n, kv_heads * head_dim], cos and sin [n, head_dim]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && cos.scalar_type() == sin.scalar_type(),
              "q and k of one dtype, cos and sin of one dtype");
  kernels.rotary(rows_of(q), rows_of(k), rows_of(cos), rows_of(sin), head_dim);
}

void scatter_rows(at::Tensor dst, at::Tensor index, at::Tensor src) {
  TORCH_CHECK(dst.device().is_cpu() && src.device().is_cpu() && dst.is_contiguous() &&
                  dst.dim() >= 1 && src.dim() == dst.dim() &&
                  src.element_size() == dst.element_size(),
              "dst: a contiguous CPU tensor; src: rows of the same element size and rank");
  TORCH_CHECK(index.device().is_cpu() && index.scalar_type() == at::kLong &&
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
