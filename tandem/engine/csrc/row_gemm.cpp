// Weights times a few rows, y = x W^T + bias: the checks and the output around the level's
// kernel (kernels/row_gemm.h says what it computes and why).

#include "native.h"

#include <pybind11/gil.h>

at::Tensor row_gemm(const isa::Kernels& kernels, at::Tensor x, at::Tensor weight,
                       std::optional<at::Tensor> bias) {
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "weight: float32 or bfloat16, got ", dtype);
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.is_contiguous(),
              "weight: a contiguous 2-D CPU tensor");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == dtype,
              "x: a 2-D CPU tensor of the weight's dtype");
  TORCH_CHECK(x.size(1) == weight.size(1), "x has ", x.size(1), " inputs, weight ", weight.size(1));
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == weight.size(0) &&
                        bias->scalar_type() == dtype && bias->device().is_cpu()),
              "bias: one value per output, of the weight's dtype");
  const at::Tensor input = x.contiguous();
  const at::Tensor bias_float = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor y = at::empty({input.size(0), weight.size(0)}, input.options());
  {
    pybind11::gil_scoped_release release;
    kernels.row_gemm(input.data_ptr(), weight.data_ptr(),
                     bias ? bias_float.data_ptr<float>() : nullptr, y.data_ptr(), input.size(0),
                     input.size(1), weight.size(0), dtype == at::kBFloat16);
  }
  return y;
}
