"""The few-row routes of `linear` (`weight @ x.T`, the native `row_gemm`) compute what `F.linear`
computes, and a row's result from `row_gemm` does not depend on the other rows."""

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tandem.engine import native
from tandem.engine.models.linear import ROW_GEMM_ROWS, Linear, linear

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [*range(1, 19), 32, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear(dtype: torch.dtype, rows: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    # 72 inputs: whole registers and a tail; 99 outputs: whole blocks and a remainder
    x = torch.randn(rows, 72, generator=g).to(dtype)
    w = torch.randn(99, 72, generator=g).to(dtype)
    b = torch.randn(99, generator=g).to(dtype) if with_bias else None
    y = linear(x, w, b)
    assert y.shape == (rows, 99) and y.dtype == dtype and y.is_contiguous()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(y.float(), F.linear(x, w, b).float(), rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_gemm_rows_do_not_depend_on_each_other(kernels: Any, dtype: torch.dtype) -> None:
    ext = kernels
    g = torch.Generator().manual_seed(0)
    # SmolLM2's down projection's 1536 inputs, plus a tail; an output count no block width divides
    x = torch.randn(32, 1537, generator=g).to(dtype)
    w = torch.randn(201, 1537, generator=g).to(dtype)
    whole = ext.row_gemm(x, w)
    for start, stop in [(0, 1), (0, 3), (5, 13), (13, 14), (7, 32)]:
        assert torch.equal(ext.row_gemm(x[start:stop], w), whole[start:stop])
    if kernels.level != native.level_in_use():
        return  # `linear` takes the level in use
    for rows in ROW_GEMM_ROWS[dtype]:  # through `linear`, every row count it hands over
        assert torch.equal(linear(x[:rows], w), whole[:rows])


def test_bias_is_added_before_the_one_rounding(kernels: Any) -> None:
    g = torch.Generator().manual_seed(2)
    x, w, b = (torch.randn(*shape, generator=g).bfloat16() for shape in [(5, 64), (40, 64), (40,)])
    exact = (x.double() @ w.double().t() + b.double()).bfloat16()
    for got in (linear(x, w, b), kernels.row_gemm(x, w, b)):
        assert (got.float() - exact.float()).abs().max() <= exact.float().abs().max() / 128
    with pytest.raises(RuntimeError):  # mixed dtypes go to F.linear, which refuses them
        linear(x, w, b.float())


def test_row_gemm_refuses_what_it_cannot_multiply(kernels: Any) -> None:
    ext = kernels
    with pytest.raises(RuntimeError, match="inputs"):
        ext.row_gemm(torch.randn(4, 8), torch.randn(5, 9))
    with pytest.raises(RuntimeError, match="contiguous"):
        ext.row_gemm(torch.randn(4, 8), torch.randn(8, 5).t())
    with pytest.raises(RuntimeError, match="dtype"):
        ext.row_gemm(torch.randn(4, 8), torch.randn(5, 8).bfloat16())


def test_gradients_other_dtypes_and_vectors_take_f_linear() -> None:
    layer = Linear(8, 4, dtype=torch.float16)
    x = torch.randn(2, 8, dtype=torch.float16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    w = torch.randn(4, 8, requires_grad=True)
    linear(torch.randn(5, 8), w).sum().backward()
    assert w.grad is not None and w.grad.shape == (4, 8)
    x, v = torch.randn(5, 8), torch.randn(8)
    assert torch.equal(linear(x, v), F.linear(x, v))
