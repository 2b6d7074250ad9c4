// Python bindings of the `tandem_native` extension (tandem/engine/native.py).

#include "native.h"

#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "short-query attention over a paged KV cache (float32 queries and output)");
  m.def("copy_rows", &copy_rows,
        "dst[dst_rows] = src[src_rows] over whole rows of bytes (None: the rows in order), "
        "consecutive rows as one copy; stream: non-temporal stores",
        pybind11::arg("dst"), pybind11::arg("dst_rows"), pybind11::arg("src"),
        pybind11::arg("src_rows"), pybind11::arg("row_bytes"), pybind11::arg("stream") = false);
}
