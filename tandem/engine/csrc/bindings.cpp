// Python bindings of the `tandem_native` extension (tandem/engine/native.py).

#include "native.h"

#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "short-query attention over a paged KV cache (output in the queries' dtype)");
  m.def("copy_rows", &copy_rows,
        "dst[dst_rows] = src[src_rows] over whole rows of bytes (None: the rows in order), "
        "consecutive rows as one copy; stream: non-temporal stores",
        pybind11::arg("dst"), pybind11::arg("dst_rows"), pybind11::arg("src"),
        pybind11::arg("src_rows"), pybind11::arg("row_bytes"), pybind11::arg("stream") = false);
  m.def("rms_norm", &rms_norm, "RMSNorm of x's rows (x += delta first, in place, when given)",
        pybind11::arg("x"), pybind11::arg("delta"), pybind11::arg("weight"), pybind11::arg("eps"),
        pybind11::arg("dtype"));
  m.def("silu_mul", &silu_mul, "silu(gate) * up of [gate | up] rows");
  m.def("rotary", &rotary, "RoPE of q's and k's heads in place (rotate-half convention)");
  m.def("quant_gemm_supported", &quant_gemm_supported,
        "whether quant_gemm was built (a CPU with AVX-512 BF16)");
  m.def("quant_gemm", &quant_gemm, "int4 / int8 weight tiles times bfloat16 rows");
  m.def("row_gemm_supported", &row_gemm_supported,
        "whether row_gemm was built for the CPU it was measured on (AVX-512)");
  m.def("row_gemm", &row_gemm,
        "x @ weight.T + bias for a few float32 / bfloat16 rows, weights read once per 8 rows",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias") = pybind11::none(),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("scatter_rows", &scatter_rows, "dst[index[i]] = src[i] over whole rows");
}
