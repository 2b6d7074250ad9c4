// Row copies between CPU buffers for the KV transfer planes (kv_transfer/layout.py).
//
// A KV cache layer, a wire tensor or a received message is a run of rows (one token's K or V
// over all heads, or a whole block's): copy_rows moves dst[dst_rows[i]] = src[src_rows[i]] for
// every i, rows that are consecutive on both sides as one copy (a block's tokens, a run of
// blocks), with the GIL released so the caller's threads share the rows. NumPy's indexed
// assignment does the same row by row through a temporary; this is one pass, and with `stream`
// it writes by non-temporal stores, which skip reading the destination into the cache first
// (a copy larger than the cache then runs near a sequential memcpy's speed).

#include "copy_rows.h"

#include <Python.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace py = pybind11;

namespace {

// A C-contiguous view of a Python buffer, released when it goes out of scope (GIL held).
class Buffer {
 public:
  Buffer(const py::buffer& obj, bool writable, const char* name) {
    const int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj.ptr(), &view_, flags) != 0) {
      PyErr_Clear();
      throw std::invalid_argument(std::string(name) + ": a C-contiguous" +
                                  (writable ? " writable" : "") + " buffer");
    }
  }
  ~Buffer() { PyBuffer_Release(&view_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  char* data() const { return static_cast<char*>(view_.buf); }
  int64_t size() const { return view_.len; }

 private:
  Py_buffer view_{};
};

void copy_bytes(char* dst, const char* src, int64_t n, bool stream) {
#if defined(__SSE2__)
  const auto d_addr = reinterpret_cast<uintptr_t>(dst);
  if (stream && n >= 256 && ((d_addr ^ reinterpret_cast<uintptr_t>(src)) & 15) == 0) {
    const int64_t head = static_cast<int64_t>((16 - (d_addr & 15)) & 15);
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    const int64_t bulk = n & ~int64_t{63};
    for (int64_t i = 0; i < bulk; i += 64) {
      const auto* s = reinterpret_cast<const __m128i*>(src + i);
      auto* d = reinterpret_cast<__m128i*>(dst + i);
      const __m128i a = _mm_load_si128(s), b = _mm_load_si128(s + 1);
      const __m128i c = _mm_load_si128(s + 2), e = _mm_load_si128(s + 3);
      _mm_stream_si128(d, a);
      _mm_stream_si128(d + 1, b);
      _mm_stream_si128(d + 2, c);
      _mm_stream_si128(d + 3, e);
    }
    std::memcpy(dst + bulk, src + bulk, n - bulk);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

// Every row index in bounds of a buffer of `size` bytes (`rows`: null for 0 .. n-1).
void check_rows(const int64_t* rows, int64_t n, int64_t row_bytes, int64_t size,
                const char* name) {
  const int64_t count = size / row_bytes;
  if (rows == nullptr) {
    if (n > count) throw std::out_of_range(std::string(name) + ": fewer rows than copied");
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    if (rows[i] < 0 || rows[i] >= count) {
      throw std::out_of_range(std::string(name) + ": row " + std::to_string(rows[i]) +
                              " outside 0.." + std::to_string(count - 1));
    }
  }
}

}  // namespace

void copy_rows(py::buffer dst, std::optional<RowIndex> dst_rows, py::buffer src,
               std::optional<RowIndex> src_rows, int64_t row_bytes, bool stream) {
  if (row_bytes < 1) throw std::invalid_argument("row_bytes: at least 1");
  if (!dst_rows && !src_rows) throw std::invalid_argument("dst_rows, src_rows: one at least");
  const Buffer d(dst, true, "dst"), s(src, false, "src");
  const int64_t* di = dst_rows ? dst_rows->data() : nullptr;
  const int64_t* si = src_rows ? src_rows->data() : nullptr;
  const int64_t n = dst_rows ? dst_rows->size() : src_rows->size();
  if (dst_rows && src_rows && src_rows->size() != n) {
    throw std::invalid_argument("dst_rows, src_rows: of one length");
  }
  check_rows(di, n, row_bytes, d.size(), "dst_rows");
  check_rows(si, n, row_bytes, s.size(), "src_rows");
  py::gil_scoped_release release;
  for (int64_t i = 0; i < n;) {
    const int64_t to = di ? di[i] : i, from = si ? si[i] : i;
    int64_t j = i + 1;
    while (j < n && (di ? di[j] : j) == to + (j - i) && (si ? si[j] : j) == from + (j - i)) ++j;
    copy_bytes(d.data() + to * row_bytes, s.data() + from * row_bytes, (j - i) * row_bytes,
               stream);
    i = j;
  }
#if defined(__SSE2__)
  if (stream) _mm_sfence();  // the streamed rows are visible before the caller reads on
#endif
}
