"""The few-row route of `linear` computes what `F.linear` computes."""

import pytest
import torch
import torch.nn.functional as F

from tandem.engine.models.linear import MAX_FEW_ROWS, Linear, linear


@pytest.mark.parametrize("rows", range(1, MAX_FEW_ROWS + 3))
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear(rows: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=g)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if with_bias else None
    y = linear(x, w, b)
    assert y.shape == (rows, 96) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_linear_module_and_other_dtypes_use_f_linear() -> None:
    layer = Linear(8, 4, dtype=torch.bfloat16)
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
