// The functions of the `tandem_native` extension (tandem/engine/native.py); bindings.cpp binds
// them, the compute ones once per instruction-set level (`kernels`: the level's table, isa.h).

#pragma once

#include "isa.h"

// Lean headers: ATen's tensor ones take ~5 s to compile, with pybind11/numpy.h ~12 s, and a
// translation unit with torch/extension.h ~35 s (Zen 4). bindings.cpp alone includes torch's
// pybind11 casters, copy_rows.h pybind11's NumPy header.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

// A 2-D tensor's rows as the kernels take them.
inline isa::Rows rows_of(const at::Tensor& t) {
  return {t.data_ptr(), t.size(0), t.size(1), t.stride(0), t.scalar_type()};
}

// Short-query attention over a paged KV cache (kernels/attention.h).
at::Tensor paged_attention(const isa::Kernels& kernels, at::Tensor q,
                              at::Tensor key_cache, at::Tensor value_cache,
                              at::Tensor block_tables, at::Tensor context_lens,
                              at::Tensor query_starts, int64_t head_dim, double scale);

// The elementwise work of a decoder layer (layer_ops.cpp, kernels/layer_ops.h): 2-D float32 /
// bfloat16 / float16 tensors, rows at any stride.
// RMSNorm of x's rows into a new tensor of `dtype`; with `delta`, x (float32) += delta first.
at::Tensor rms_norm(const isa::Kernels& kernels, at::Tensor x,
                       std::optional<at::Tensor> delta, at::Tensor weight, double eps,
                       at::ScalarType dtype);
// silu(gate) * up for gate_up = [gate | up] along the columns.
at::Tensor silu_mul(const isa::Kernels& kernels, at::Tensor gate_up);
// RoPE (rotate-half convention) of q's and k's heads in place, cos / sin [rows, head_dim].
void rotary(const isa::Kernels& kernels, at::Tensor q, at::Tensor k, at::Tensor cos,
            at::Tensor sin, int64_t head_dim);
// dst[index[i]] = src[i] over whole rows (KV slots), same element size.
void scatter_rows(at::Tensor dst, at::Tensor index, at::Tensor src);
// A decode step's new keys and values: RoPE of the q and k columns of the fused projection's
// rows qkv = [q | k | v] in place, then k's and v's rows into their cache slots,
// key_slots[index[i]] = k[i], value_slots[index[i]] = v[i] (slots of qkv's dtype).
void rotary_store(const isa::Kernels& kernels, at::Tensor qkv, int64_t q_size, at::Tensor cos,
                  at::Tensor sin, int64_t head_dim, at::Tensor key_slots,
                  at::Tensor value_slots, at::Tensor index);
// rotary_store on checked inputs: qkv's rows [q | k | v] (q_size, kv_size wide), slot rows of
// kv_size elements of qkv's dtype at `keys` / `values`, slot[i] in range (decode_layers.cpp).
void rotate_and_store(const isa::Kernels& kernels, const isa::Rows& qkv, int64_t q_size,
                      int64_t kv_size, const isa::Rows& cos, const isa::Rows& sin,
                      int64_t head_dim, void* keys, void* values, const int64_t* slot);

// int4 / int8 weight tiles (quant/tiles.py) times bfloat16 rows [rows, in] -> bfloat16 (or,
// `float32_out`, float32) [rows, out] (quant_gemm.cpp, kernels/quant_gemm.h).
at::Tensor quant_gemm(const isa::Kernels& kernels, at::Tensor x, at::Tensor tiles,
                      at::Tensor scales_zeros, int64_t group_size, bool float32_out);

// x [rows, in] times weights [out, in] (nn.Linear's layout), plus bias, -> [rows, out], float32 or
// bfloat16 throughout, a row's result independent of the other rows (row_gemm.cpp,
// kernels/row_gemm.h).
at::Tensor row_gemm(const isa::Kernels& kernels, at::Tensor x, at::Tensor weight,
                       std::optional<at::Tensor> bias);

// A decode step's decoder layers in one call (decode_layers.cpp, models/decode_plan.py): per
// layer RMSNorm, the fused qkv product, RoPE, the new keys and values into their slots,
// attention, the o product, the residual add and RMSNorm, gate/up, SiLU-and-multiply, down,
// on x [rows, hidden], the float32 residual stream, in place. A product is (weight, bias, 0)
// for `row_gemm` or (tiles, scales_zeros, group_size) for `quant_gemm`; caches of the model
// dtype, [num_blocks, block_size, num_kv_heads, head_dim]. Every layer of one shape; one thread
// uses an object at a time (the engine's).
using ProductSpec = std::tuple<at::Tensor, std::optional<at::Tensor>, int64_t>;

class DecodeLayers {
 public:
  DecodeLayers(const isa::Kernels& kernels, std::vector<at::Tensor> norms,
               std::vector<ProductSpec> products, double eps, int64_t head_dim,
               int64_t num_heads, int64_t num_kv_heads, double scale, at::ScalarType dtype);
  void set_caches(std::vector<at::Tensor> keys, std::vector<at::Tensor> values);
  void run(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor slots,
           at::Tensor block_tables, at::Tensor context_lens, at::Tensor query_starts);

 private:
  struct Product {
    at::Tensor weight;  // row_gemm's weight, or quant_gemm's tiles
    at::Tensor extra;   // row_gemm's bias (may be undefined), or the scales_zeros
    int64_t group_size;  // 0: row_gemm
    int64_t in, out;
  };
  void multiply(const Product& p, const at::Tensor& x, const at::Tensor& y);

  const isa::Kernels& kernels_;
  std::vector<at::Tensor> norms_;  // input and post-attention norm weights, per layer
  std::vector<Product> products_;  // qkv, o, gate_up, down, per layer
  std::vector<at::Tensor> keys_, values_;
  std::vector<float> bias_;  // a bfloat16 bias in float32, for the call that adds it
  float eps_;
  int64_t head_dim_, num_heads_, num_kv_heads_;
  float scale_;
  at::ScalarType dtype_;
};
