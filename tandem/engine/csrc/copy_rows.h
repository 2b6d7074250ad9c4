// Row copies between Python buffers (copy_rows.cpp), apart from native.h: pybind11/numpy.h
// adds ~7 s to the compile of every translation unit that includes it.

#pragma once

#include <pybind11/numpy.h>

#include <cstdint>
#include <optional>

// Row indices: contiguous int64 (another array is converted on the way in).
using RowIndex = pybind11::array_t<int64_t, pybind11::array::c_style | pybind11::array::forcecast>;

// dst rows [dst_rows] = src rows [src_rows], rows of `row_bytes` bytes.
void copy_rows(pybind11::buffer dst, std::optional<RowIndex> dst_rows,
               pybind11::buffer src, std::optional<RowIndex> src_rows,
               int64_t row_bytes, bool stream);
