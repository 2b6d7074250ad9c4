// Short-query attention over a paged KV cache: the checks and the output tensor around the
// level's kernel (kernels/attention.h says what it computes).

#include "native.h"

at::Tensor paged_attention(const isa::Kernels& kernels, at::Tensor q,
                              at::Tensor key_cache, at::Tensor value_cache,
                              at::Tensor block_tables, at::Tensor context_lens,
                              at::Tensor query_starts, int64_t head_dim, double scale) {
  const auto qtype = q.scalar_type();
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 2 && q.stride(1) == 1 &&
                  (qtype == at::kFloat || qtype == at::kBFloat16 ||
                   qtype == at::kHalf),
              "q: float32, bfloat16 or float16 rows on CPU, [num_tokens, num_heads * head_dim] "
              "with unit stride within a row");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes() && key_cache.device().is_cpu() &&
                  value_cache.device().is_cpu() &&
                  key_cache.scalar_type() == value_cache.scalar_type(),
              "key/value cache: contiguous CPU [num_blocks, block_size, num_kv_heads, slot_dim]");
  const auto cache_dtype = key_cache.scalar_type();
  TORCH_CHECK(cache_dtype == at::kFloat || cache_dtype == at::kBFloat16 ||
                  cache_dtype == at::kHalf || cache_dtype == at::kChar ||
                  cache_dtype == at::kFloat8_e4m3fn,
              "unsupported KV cache dtype ", cache_dtype);
  for (const auto* t : {&block_tables, &context_lens, &query_starts}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "int64 metadata");
  }
  TORCH_CHECK(query_starts.size(0) == block_tables.size(0) + 1 &&
                  context_lens.size(0) == block_tables.size(0),
              "one context length and query start per request");
  TORCH_CHECK(key_cache.size(1) <= isa::kMaxAttentionBlockSize, "block_size at most ",
              isa::kMaxAttentionBlockSize);
  const int64_t num_kv_heads = key_cache.size(2);
  TORCH_CHECK((q.size(1) / head_dim) % num_kv_heads == 0, "query heads per KV head");
  auto out = at::empty(q.sizes(), q.options());
  kernels.paged_attention({rows_of(q), rows_of(out), key_cache.data_ptr(), value_cache.data_ptr(),
                           cache_dtype, block_tables.data_ptr<int64_t>(),
                           context_lens.data_ptr<int64_t>(), query_starts.data_ptr<int64_t>(),
                           block_tables.size(0), block_tables.size(1), key_cache.size(1),
                           q.size(1) / head_dim, num_kv_heads, head_dim, key_cache.size(3),
                           static_cast<float>(scale)});
  return out;
}
