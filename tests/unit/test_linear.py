"""The few-row routes of `linear` (`weight @ x.T`, the native `row_gemm`) compute what `F.linear`
computes, and a row's result from `row_gemm` does not depend on the other rows."""

import pytest
import torch
import torch.nn.functional as F

from tandem.engine import native
from tandem.engine.models.linear import MAX_FEW_ROWS, Linear, linear


@pytest.mark.parametrize("rows", [*range(1, 19), MAX_FEW_ROWS, MAX_FEW_ROWS + 1])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear(rows: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 72, generator=g)  # 72 inputs: whole registers and a tail
    w = torch.randn(99, 72, generator=g)  # 99 outputs: whole blocks and a remainder
    b = torch.randn(99, generator=g) if with_bias else None
    y = linear(x, w, b)
    assert y.shape == (rows, 99) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_row_gemm_rows_do_not_depend_on_each_other() -> None:
    ext = native.extension()
    if ext is None:
        pytest.skip("native CPU extension unavailable")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 576, generator=g)
    w = torch.randn(200, 576, generator=g)
    whole = ext.row_gemm(x, w)
    for start, stop in [(0, 3), (5, 13), (13, 14), (7, 32)]:
        assert torch.equal(ext.row_gemm(x[start:stop], w), whole[start:stop])
    # strided rows are read as rows
    assert torch.equal(
        ext.row_gemm(x[:, :100], w[:, :100].contiguous())[4:9],
        ext.row_gemm(x[4:9, :100].contiguous(), w[:, :100].contiguous()),
    )


def test_row_gemm_refuses_what_it_cannot_multiply() -> None:
    ext = native.extension()
    if ext is None:
        pytest.skip("native CPU extension unavailable")
    with pytest.raises(RuntimeError, match="inputs"):
        ext.row_gemm(torch.randn(4, 8), torch.randn(5, 9))
    with pytest.raises(RuntimeError, match="weight"):
        ext.row_gemm(torch.randn(4, 8), torch.randn(8, 5).t())


def test_gradients_and_other_dtypes_take_f_linear() -> None:
    layer = Linear(8, 4, dtype=torch.bfloat16)
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    w = torch.randn(4, 8, requires_grad=True)
    linear(torch.randn(5, 8), w).sum().backward()
    assert w.grad is not None and w.grad.shape == (4, 8)
