// The functions of the `tandem_native` extension (tandem/engine/native.py); bindings.cpp binds them.

#pragma once

#include <pybind11/numpy.h>
#include <torch/extension.h>

#include <cstdint>
#include <optional>

// Short-query attention over a paged KV cache (paged_attention.cpp).
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                              torch::Tensor block_tables, torch::Tensor context_lens,
                              torch::Tensor query_starts, int64_t head_dim, double scale);

// Row indices: contiguous int64 (another array is converted on the way in).
using RowIndex = pybind11::array_t<int64_t, pybind11::array::c_style | pybind11::array::forcecast>;

// dst rows [dst_rows] = src rows [src_rows], rows of `row_bytes` bytes (copy_rows.cpp).
void copy_rows(pybind11::buffer dst, std::optional<RowIndex> dst_rows,
               pybind11::buffer src, std::optional<RowIndex> src_rows,
               int64_t row_bytes, bool stream);
