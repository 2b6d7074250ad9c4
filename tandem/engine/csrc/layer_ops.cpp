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

namespace {

void check_rotary(const isa::Rows& q, const isa::Rows& k, const at::Tensor& cos,
                  const at::Tensor& sin, int64_t head_dim) {
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t rows = q.rows;
  TORCH_CHECK(head_dim % 2 == 0 && q.cols % head_dim == 0 && k.cols % head_dim == 0 &&
                  k.rows == rows && cos.size(0) == rows && sin.size(0) == rows &&
                  cos.size(1) == head_dim && sin.size(1) == head_dim,
              "q [n, heads * head_dim], k [n, kv_heads * head_dim], cos and sin [n, head_dim]");
  TORCH_CHECK(q.dtype == k.dtype && cos.scalar_type() == sin.scalar_type(),
              "q and k of one dtype, cos and sin of one dtype");
}

// index: n row numbers of a tensor of `slots` rows.
void check_index(const at::Tensor& index, int64_t n, int64_t slots) {
  TORCH_CHECK(index.device().is_cpu() && index.scalar_type() == at::kLong &&
                  index.dim() == 1 && index.is_contiguous() && index.size(0) == n,
              "index: int64 [", n, "]");
  const int64_t* idx = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(idx[i] >= 0 && idx[i] < slots, "index ", idx[i], " out of range for ", slots,
                " rows");
}

// dst[index[i]] = src row i, `row_bytes` each (src: rows `src_stride` bytes apart; the index
// checked already).
void scatter(const at::Tensor& dst, const at::Tensor& index, const char* src, int64_t n,
             int64_t src_stride, int64_t row_bytes) {
  const int64_t* idx = index.data_ptr<int64_t>();
  char* d = static_cast<char*>(dst.data_ptr());
  for (int64_t i = 0; i < n; ++i) std::memcpy(d + idx[i] * row_bytes, src + i * src_stride, row_bytes);
}

}  // namespace

void rotary(const isa::Kernels& kernels, at::Tensor q, at::Tensor k, at::Tensor cos,
            at::Tensor sin, int64_t head_dim) {
  check_rows(q, "q");
  check_rows(k, "k");
  check_rotary(rows_of(q), rows_of(k), cos, sin, head_dim);
  kernels.rotary(rows_of(q), rows_of(k), rows_of(cos), rows_of(sin), head_dim);
}

void scatter_rows(at::Tensor dst, at::Tensor index, at::Tensor src) {
  TORCH_CHECK(dst.device().is_cpu() && src.device().is_cpu() && dst.is_contiguous() &&
                  dst.dim() >= 1 && src.dim() == dst.dim() &&
                  src.element_size() == dst.element_size(),
              "dst: a contiguous CPU tensor; src: rows of the same element size and rank");
  for (int64_t d = 1; d < dst.dim(); ++d)
    TORCH_CHECK(src.size(d) == dst.size(d), "src rows must have dst's row shape");
  TORCH_CHECK(src.size(0) == 0 || src.select(0, 0).is_contiguous(), "src: contiguous rows");
  const int64_t row_bytes = dst.numel() / std::max<int64_t>(dst.size(0), 1) * dst.element_size();
  check_index(index, src.size(0), dst.size(0));
  scatter(dst, index, static_cast<const char*>(src.data_ptr()), src.size(0),
          src.stride(0) * src.element_size(), row_bytes);
}

void rotate_and_store(const isa::Kernels& kernels, const isa::Rows& qkv, int64_t q_size,
                      int64_t kv_size, const isa::Rows& cos, const isa::Rows& sin,
                      int64_t head_dim, void* keys, void* values, const int64_t* slot) {
  const int64_t bytes = c10::elementSize(qkv.dtype), row_bytes = kv_size * bytes;
  char* base = static_cast<char*>(qkv.data);
  const isa::Rows q{base, qkv.rows, q_size, qkv.stride, qkv.dtype},
      k{base + q_size * bytes, qkv.rows, kv_size, qkv.stride, qkv.dtype};
  kernels.rotary(q, k, cos, sin, head_dim);
  for (int64_t i = 0; i < qkv.rows; ++i) {
    const char* row = base + i * qkv.stride * bytes;
    std::memcpy(static_cast<char*>(keys) + slot[i] * row_bytes, row + q_size * bytes, row_bytes);
    std::memcpy(static_cast<char*>(values) + slot[i] * row_bytes,
                row + (q_size + kv_size) * bytes, row_bytes);
  }
}

void rotary_store(const isa::Kernels& kernels, at::Tensor qkv, int64_t q_size, at::Tensor cos,
                  at::Tensor sin, int64_t head_dim, at::Tensor key_slots,
                  at::Tensor value_slots, at::Tensor index) {
  check_rows(qkv, "qkv");
  const int64_t kv_size = (qkv.size(1) - q_size) / 2;
  TORCH_CHECK(q_size > 0 && kv_size > 0 && q_size + 2 * kv_size == qkv.size(1),
              "qkv: [n, q_size + 2 * kv_size]");
  for (const at::Tensor* slots : {&key_slots, &value_slots})
    TORCH_CHECK(slots->device().is_cpu() && slots->dim() == 2 && slots->is_contiguous() &&
                    slots->size(1) == kv_size && slots->scalar_type() == qkv.scalar_type(),
                "key/value slots: contiguous [num_slots, ", kv_size, "] of qkv's dtype");
  check_index(index, qkv.size(0), std::min(key_slots.size(0), value_slots.size(0)));
  const isa::Rows all = rows_of(qkv);
  const isa::Rows q{all.data, all.rows, q_size, all.stride, all.dtype},
      k{static_cast<char*>(all.data) + q_size * qkv.element_size(), all.rows, kv_size,
        all.stride, all.dtype};
  check_rotary(q, k, cos, sin, head_dim);
  rotate_and_store(kernels, all, q_size, kv_size, rows_of(cos), rows_of(sin), head_dim,
                   key_slots.data_ptr(), value_slots.data_ptr(), index.data_ptr<int64_t>());
}
