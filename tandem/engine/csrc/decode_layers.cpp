// A CPU decode step's decoder layers in one native call (tandem/engine/models/decode_plan.py):
// the kernels the plan's Python loop calls, in its order, on the same values, so the hidden
// states are the same bit for bit; without the loop's ~250 Python calls and slices a step and
// the output tensor each of them allocated.

#include "native.h"

#include <pybind11/gil.h>

namespace {

const isa::Rows kNone{nullptr, 0, 0, 0, at::kFloat};

}  // namespace

DecodeLayers::DecodeLayers(const isa::Kernels& kernels, std::vector<at::Tensor> norms,
                           std::vector<ProductSpec> products, double eps, int64_t head_dim,
                           int64_t num_heads, int64_t num_kv_heads, double scale,
                           at::ScalarType dtype)
    : kernels_(kernels),
      norms_(std::move(norms)),
      eps_(static_cast<float>(eps)),
      head_dim_(head_dim),
      num_heads_(num_heads),
      num_kv_heads_(num_kv_heads),
      scale_(static_cast<float>(scale)),
      dtype_(dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype: float32 or bfloat16");
  TORCH_CHECK(num_kv_heads >= 1 && num_heads % num_kv_heads == 0 && head_dim >= 2 &&
                  head_dim % 2 == 0,
              "heads: a whole number of query heads per KV head, an even head_dim");
  TORCH_CHECK(!norms_.empty() && norms_.size() * 2 == products.size(),
              "two norm weights and four products a layer");
  for (const at::Tensor& w : norms_)
    TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.scalar_type() == at::kFloat &&
                    w.device().is_cpu(),
                "norm weights: float32 [hidden] on CPU");
  for (const auto& [weight, extra, group_size] : products) {
    Product p{weight, at::Tensor(), group_size, 0, 0};
    TORCH_CHECK(weight.device().is_cpu() && (!extra || extra->device().is_cpu()),
                "products: CPU tensors");
    if (group_size == 0) {  // row_gemm: weight [out, in] of the model dtype, bias [out]
      TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.device().is_cpu() &&
                      weight.scalar_type() == dtype,
                  "weight: a contiguous 2-D CPU tensor of the model dtype");
      p.in = weight.size(1);
      p.out = weight.size(0);
      if (extra) {
        TORCH_CHECK(extra->dim() == 1 && extra->size(0) == p.out && extra->is_contiguous() &&
                        extra->scalar_type() == dtype,
                    "bias: [out_features] of the model dtype");
        p.extra = *extra;  // held, not copied: a weight update reaches it
      }
    } else {  // quant_gemm: tiles [out / 16, in / 2, 16 | 32], scales_zeros (quant/tiles.py)
      TORCH_CHECK(dtype == at::kBFloat16, "quantized tiles take bfloat16 rows");
      const bool int4 = weight.scalar_type() == at::kByte;
      TORCH_CHECK(extra && weight.dim() == 3 && weight.is_contiguous() &&
                      (int4 || weight.scalar_type() == at::kChar) &&
                      weight.size(2) == (int4 ? 1 : 2) * isa::kQuantTile &&
                      extra->is_contiguous() && extra->scalar_type() == at::kBFloat16 &&
                      extra->dim() == 4 && extra->size(0) == weight.size(0) &&
                      extra->size(2) == 2 && extra->size(3) == isa::kQuantTile,
                  "tiles and scales_zeros as quant/tiles.py lays them out");
      p.in = 2 * weight.size(1);
      p.out = weight.size(0) * isa::kQuantTile;
      TORCH_CHECK(group_size % 2 == 0 && p.in % group_size == 0 &&
                      extra->size(1) == p.in / group_size,
                  "group_size: even, dividing in_features, one scale a group");
      p.extra = *extra;
    }
    products_.push_back(std::move(p));
  }
  // every layer of one shape: a step's buffers are sized once, by layer 0
  const int64_t hidden = norms_[0].size(0), intermediate = products_[3].in;
  for (size_t l = 0; l < norms_.size() / 2; ++l) {
    const Product &qkv = products_[4 * l], &o = products_[4 * l + 1],
                  &gate_up = products_[4 * l + 2], &down = products_[4 * l + 3];
    TORCH_CHECK(norms_[2 * l].size(0) == hidden && norms_[2 * l + 1].size(0) == hidden &&
                    qkv.in == hidden && o.out == hidden && gate_up.in == hidden &&
                    down.out == hidden && down.in == intermediate &&
                    gate_up.out == 2 * intermediate && o.in == num_heads * head_dim &&
                    qkv.out == (num_heads + 2 * num_kv_heads) * head_dim,
                "layer ", l, ": the products' shapes do not chain, or differ from layer 0's");
  }
}

void DecodeLayers::set_caches(std::vector<at::Tensor> keys, std::vector<at::Tensor> values) {
  TORCH_CHECK(keys.size() == values.size() && keys.size() == norms_.size() / 2,
              "a key and a value cache a layer");
  for (size_t l = 0; l < keys.size(); ++l)
    TORCH_CHECK(keys[l].dim() == 4 && keys[l].is_contiguous() && values[l].is_contiguous() &&
                    keys[l].sizes() == values[l].sizes() && keys[l].scalar_type() == dtype_ &&
                    values[l].scalar_type() == dtype_ && keys[l].size(2) == num_kv_heads_ &&
                    keys[l].size(3) == head_dim_ &&
                    keys[l].size(1) <= isa::kMaxAttentionBlockSize &&
                    keys[l].device().is_cpu() && values[l].device().is_cpu() &&
                    keys[l].sizes() == keys[0].sizes(),
                "key/value cache: contiguous CPU [num_blocks, block_size, num_kv_heads, "
                "head_dim] of the model dtype, one shape for every layer");
  keys_ = std::move(keys);
  values_ = std::move(values);
}

void DecodeLayers::multiply(const Product& p, const at::Tensor& x, const at::Tensor& y) {
  if (p.group_size == 0) {
    const float* bias = nullptr;  // row_gemm adds it in float32
    if (p.extra.defined() && dtype_ == at::kFloat) {
      bias = p.extra.data_ptr<float>();
    } else if (p.extra.defined()) {
      bias_.resize(p.out);
      const auto* b = p.extra.data_ptr<at::BFloat16>();
      for (int64_t n = 0; n < p.out; ++n) bias_[n] = static_cast<float>(b[n]);
      bias = bias_.data();
    }
    kernels_.row_gemm(x.data_ptr(), p.weight.data_ptr(), bias, y.data_ptr(), x.size(0), p.in,
                      p.out, dtype_ == at::kBFloat16);
    return;
  }
  kernels_.quant_gemm({reinterpret_cast<const uint16_t*>(x.data_ptr()), x.size(0), p.in,
                       x.stride(0), reinterpret_cast<const uint8_t*>(p.weight.data_ptr()),
                       reinterpret_cast<const uint16_t*>(p.extra.data_ptr()), p.weight.size(0),
                       p.group_size, p.weight.scalar_type() == at::kByte, y.data_ptr(), false});
}

void DecodeLayers::run(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor slots,
                       at::Tensor block_tables, at::Tensor context_lens,
                       at::Tensor query_starts) {
  const int64_t layers = static_cast<int64_t>(norms_.size() / 2);
  TORCH_CHECK(static_cast<int64_t>(keys_.size()) == layers, "set_caches first");
  const int64_t n = x.size(0), hidden = norms_[0].size(0);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat &&
                  x.size(1) == hidden && n > 0,
              "x: the float32 residual stream [rows, hidden]");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 2 && t->stride(1) == 1 &&
                    t->size(0) == n && t->size(1) == head_dim_ &&
                    t->scalar_type() == cos.scalar_type() &&
                    (t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16 ||
                     t->scalar_type() == at::kHalf),
                "cos and sin: float32 / bfloat16 / float16 [rows, head_dim], of one dtype");
  for (const at::Tensor* t : {&slots, &block_tables, &context_lens, &query_starts})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->device().is_cpu(),
                "int64 metadata");
  const int64_t batch = block_tables.size(0);
  TORCH_CHECK(block_tables.dim() == 2 && context_lens.size(0) == batch &&
                  query_starts.size(0) == batch + 1 && query_starts.data_ptr<int64_t>()[batch] == n,
              "one context length and query start per request, the rows between them");
  const int64_t num_slots = keys_[0].size(0) * keys_[0].size(1);
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == n, "slots: one per row");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(slot[i] >= 0 && slot[i] < num_slots, "slot ", slot[i], " out of range");
  const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  const auto buffer = [&](int64_t cols) { return at::empty({n, cols}, x.options().dtype(dtype_)); };
  const at::Tensor h = buffer(hidden), qkv = buffer(products_[0].out), attended = buffer(q_size),
                   projected = buffer(hidden), gate_up = buffer(products_[2].out),
                   act = buffer(products_[2].out / 2), mlp_out = buffer(hidden);
  const isa::Rows q{qkv.data_ptr(), n, q_size, qkv.stride(0), dtype_};  // [q | k | v]'s q
  {
    pybind11::gil_scoped_release release;
    for (int64_t l = 0; l < layers; ++l) {
      const Product* p = &products_[4 * l];
      // x += the previous layer's MLP output, then the norm
      kernels_.rms_norm(rows_of(x), l ? rows_of(mlp_out) : kNone,
                        norms_[2 * l].data_ptr<float>(), eps_, rows_of(h));
      multiply(p[0], h, qkv);
      const at::Tensor &keys = keys_[l], &values = values_[l];
      rotate_and_store(kernels_, rows_of(qkv), q_size, kv_size, rows_of(cos), rows_of(sin),
                       head_dim_, keys.data_ptr(), values.data_ptr(), slot);
      kernels_.paged_attention({q, rows_of(attended), keys.data_ptr(), values.data_ptr(),
                                dtype_, block_tables.data_ptr<int64_t>(),
                                context_lens.data_ptr<int64_t>(),
                                query_starts.data_ptr<int64_t>(), batch, block_tables.size(1),
                                keys.size(1), num_heads_, num_kv_heads_, head_dim_, head_dim_,
                                scale_});
      multiply(p[1], attended, projected);
      kernels_.rms_norm(rows_of(x), rows_of(projected), norms_[2 * l + 1].data_ptr<float>(),
                        eps_, rows_of(h));  // x += attention
      multiply(p[2], h, gate_up);
      kernels_.silu_mul(rows_of(gate_up), rows_of(act));
      multiply(p[3], act, mlp_out);
    }
  }
  x.add_(mlp_out);
}
