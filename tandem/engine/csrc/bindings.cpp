// Python bindings of the `tandem_native` extension (tandem/engine/native.py): the functions
// that need no vector instructions at the top, and one submodule per instruction-set level with
// the compute kernels built for it (`ext.avx2.row_gemm`, ...).

#include "copy_rows.h"
#include "native.h"

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>  // the tensor and dtype casters (torch/extension.h: 2x slower)

#include <string>

namespace py = pybind11;

namespace {

// The compute functions bound to one level's kernels.
void bind_level(py::module_& parent, const isa::Kernels* k) {
  py::module_ m = parent.def_submodule(k->name, "the kernels compiled for this level");
  m.def(
      "paged_attention",
      [k](at::Tensor q, at::Tensor key_cache, at::Tensor value_cache,
          at::Tensor block_tables, at::Tensor context_lens, at::Tensor query_starts,
          int64_t head_dim, double scale) {
        return paged_attention(*k, q, key_cache, value_cache, block_tables, context_lens,
                               query_starts, head_dim, scale);
      },
      "short-query attention over a paged KV cache (output in the queries' dtype)");
  m.def(
      "rms_norm",
      [k](at::Tensor x, std::optional<at::Tensor> delta, at::Tensor weight, double eps,
          at::ScalarType dtype) { return rms_norm(*k, x, delta, weight, eps, dtype); },
      "RMSNorm of x's rows (x += delta first, in place, when given)", py::arg("x"),
      py::arg("delta"), py::arg("weight"), py::arg("eps"), py::arg("dtype"));
  m.def(
      "silu_mul", [k](at::Tensor gate_up) { return silu_mul(*k, gate_up); },
      "silu(gate) * up of [gate | up] rows");
  m.def(
      "rotary",
      [k](at::Tensor q, at::Tensor key, at::Tensor cos, at::Tensor sin,
          int64_t head_dim) { rotary(*k, q, key, cos, sin, head_dim); },
      "RoPE of q's and k's heads in place (rotate-half convention)");
  m.def(
      "rotary_store",
      [k](at::Tensor qkv, int64_t q_size, at::Tensor cos, at::Tensor sin,
          int64_t head_dim, at::Tensor key_slots, at::Tensor value_slots,
          at::Tensor index) {
        rotary_store(*k, qkv, q_size, cos, sin, head_dim, key_slots, value_slots, index);
      },
      "RoPE of [q | k | v] rows' q and k in place, then k and v into their KV slots");
  m.def(
      "quant_gemm",
      [k](at::Tensor x, at::Tensor tiles, at::Tensor scales_zeros, int64_t group_size,
          bool float32_out) {
        return quant_gemm(*k, x, tiles, scales_zeros, group_size, float32_out);
      },
      "int4 / int8 weight tiles times bfloat16 rows, into bfloat16 (or float32)", py::arg("x"),
      py::arg("tiles"), py::arg("scales_zeros"), py::arg("group_size"),
      py::arg("float32_out") = false);
  m.def(
      "row_gemm",
      [k](at::Tensor x, at::Tensor weight, std::optional<at::Tensor> bias) {
        return row_gemm(*k, x, weight, bias);
      },
      "x @ weight.T + bias for a few float32 / bfloat16 rows, each row on its own",
      py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def(
      "decode_layers",
      [k](std::vector<at::Tensor> norms, std::vector<ProductSpec> products, double eps,
          int64_t head_dim, int64_t num_heads, int64_t num_kv_heads, double scale,
          at::ScalarType dtype) {
        return DecodeLayers(*k, std::move(norms), std::move(products), eps, head_dim,
                            num_heads, num_kv_heads, scale, dtype);
      },
      "a decode step's decoder layers as one call (DecodeLayers)");
  // the level-independent ones too, so that a level's module is all a caller needs
  m.attr("copy_rows") = parent.attr("copy_rows");
  m.attr("scatter_rows") = parent.attr("scatter_rows");
  m.attr("level") = k->name;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<DecodeLayers>(m, "DecodeLayers")
      .def("set_caches", &DecodeLayers::set_caches, "the layers' key and value caches")
      .def("run", &DecodeLayers::run,
           "every layer on x [rows, hidden] float32, in place");
  m.def("copy_rows", &copy_rows,
        "dst[dst_rows] = src[src_rows] over whole rows of bytes (None: the rows in order), "
        "consecutive rows as one copy; stream: non-temporal stores",
        py::arg("dst"), py::arg("dst_rows"), py::arg("src"), py::arg("src_rows"),
        py::arg("row_bytes"), py::arg("stream") = false);
  m.def("scatter_rows", &scatter_rows, "dst[index[i]] = src[i] over whole rows");
  py::list levels;
  std::string cpu;
  for (const isa::Kernels* k : isa::built()) {
    bind_level(m, k);
    levels.append(k->name);
    if (k->level <= isa::cpu_level()) cpu = k->name;
  }
  m.attr("levels") = levels;  // built here, lowest first
  m.attr("cpu_level") = cpu;  // the highest of them this CPU runs
}
