"""The fused elementwise ops of a decoder layer (`csrc/layer_ops.cpp`) equal the torch ops they
replace: RMSNorm with and without the residual add, SiLU-and-multiply, RoPE on strided views of
the fused qkv output, and the KV slot scatter, apart and as the one call of a decode step; bad
shapes are refused, and autograd keeps the torch path."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from tandem.engine import layer_ops
from tandem.engine.models import rope

pytestmark = pytest.mark.usefixtures("at_each_level")

# float32 agrees to the summation order; a 16-bit output to its rounding of the same float32 value
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}
DTYPES = list(TOLERANCE)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype
    torch.testing.assert_close(
        got.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_rms_norm(
    kernels: ModuleType, in_dtype: torch.dtype, out_dtype: torch.dtype, rows: int
) -> None:
    torch.manual_seed(0)
    x = (torch.randn(rows, 96) * 30).to(in_dtype)
    weight = torch.rand(96) + 0.5
    got = layer_ops.rms_norm(x, weight, 1e-5, out_dtype)
    want = F.rms_norm(x.float(), (96,), weight, 1e-5).to(out_dtype)
    _close(got, want, out_dtype if out_dtype != torch.float32 else in_dtype)


@pytest.mark.parametrize("delta_dtype", DTYPES)
def test_add_rms_norm_updates_the_residual_in_place(
    kernels: ModuleType, delta_dtype: torch.dtype
) -> None:
    torch.manual_seed(1)
    x = torch.randn(5, 64) * 100
    delta = torch.randn(5, 64).to(delta_dtype)
    weight = torch.rand(64)
    want_x = x + delta.float()
    want = F.rms_norm(want_x, (64,), weight, 1e-6).to(torch.bfloat16)
    new_x, normed = layer_ops.add_rms_norm(x, delta, weight, 1e-6, torch.bfloat16)
    assert new_x is x  # the residual stream took the sum in place
    torch.testing.assert_close(x, want_x, atol=0, rtol=0)  # the same float32 adds
    _close(normed, want, torch.bfloat16)


def test_autograd_keeps_the_torch_path() -> None:
    """Training (spec train) backpropagates through the layer: no in-place add, gradients flow."""
    x = torch.randn(4, 32, requires_grad=True)
    delta = torch.randn(4, 32, requires_grad=True)
    weight = torch.rand(32, requires_grad=True)
    new_x, normed = layer_ops.add_rms_norm(x, delta, weight, 1e-5, torch.float32)
    gate_up = torch.randn(4, 16, requires_grad=True)
    (normed.sum() + new_x.sum() + layer_ops.silu_mul(gate_up).sum()).backward()
    assert new_x is not x
    for t in (x, delta, weight, gate_up):
        assert t.grad is not None and torch.isfinite(t.grad).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 33])
def test_silu_mul(kernels: ModuleType, dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(2)
    gate_up = (torch.randn(rows, 2 * 72) * 4).to(dtype)  # 72: a tail past the 16-lane registers
    gate, up = gate_up.float().chunk(2, dim=-1)
    want = (F.silu(gate) * up).to(dtype)
    _close(layer_ops.silu_mul(gate_up), want, dtype)


def test_silu_mul_at_large_magnitudes(kernels: ModuleType) -> None:
    """Gates far past exp's float range on both sides, in the vector body and the tail."""
    gate = torch.linspace(-300, 300, 72).repeat(3, 1)
    gate_up = torch.cat([gate, torch.ones_like(gate)], dim=-1)
    got = layer_ops.silu_mul(gate_up)
    torch.testing.assert_close(got, F.silu(gate), atol=1e-5, rtol=1e-5)


def test_rotary_of_no_tokens(kernels: ModuleType) -> None:
    emb = rope.RotaryEmbedding(16, 8, 10000.0, None, torch.float32, torch.device("cpu"))
    q, k = torch.empty(0, 2, 16), torch.empty(0, 1, 16)
    got_q, got_k = rope.apply_rotary(q, k, emb(torch.empty(0, dtype=torch.int64)))
    assert got_q.shape == (0, 2, 16) and got_k.shape == (0, 1, 16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_qkv_views(kernels: ModuleType, dtype: torch.dtype) -> None:
    """q and k are strided views of one qkv row (as the attention layer splits it); v and the
    gaps between them stay untouched."""
    torch.manual_seed(3)
    n, heads, kv_heads, d = 7, 6, 2, 32
    emb = rope.RotaryEmbedding(d, 512, 10000.0, None, dtype, torch.device("cpu"))
    cos_sin = emb(torch.tensor([0, 1, 5, 100, 101, 300, 511]))
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d).to(dtype)
    before = qkv.clone()
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(n, heads, d), k.view(n, kv_heads, d)
    ref_q, ref_k = q.double(), k.double()
    cos, sin = (t.double() for t in cos_sin)
    half = lambda x: torch.cat((-x[..., d // 2 :], x[..., : d // 2]), dim=-1)  # noqa: E731
    want_q, want_k = ref_q * cos + half(ref_q) * sin, ref_k * cos + half(ref_k) * sin
    got_q, got_k = rope.apply_rotary(q, k, cos_sin)
    assert got_q.data_ptr() == q.data_ptr()  # rotated in place
    _close(got_q, want_q.to(dtype), dtype)
    _close(got_k, want_k.to(dtype), dtype)
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], before[:, (heads + kv_heads) * d :])


def test_rotary_matches_the_torch_ops(kernels: ModuleType) -> None:
    """The fused rotation and the torch fallback agree (float32) on a contiguous tensor."""
    torch.manual_seed(4)
    emb = rope.RotaryEmbedding(64, 256, 10000.0, None, torch.float32, torch.device("cpu"))
    cos_sin = emb(torch.arange(9) * 20)
    q, k = torch.randn(9, 3, 64), torch.randn(9, 1, 64)
    want_q = q * cos_sin[0] + rope._rotate_half(q) * cos_sin[1]
    want_k = k * cos_sin[0] + rope._rotate_half(k) * cos_sin[1]
    got_q, got_k = rope.apply_rotary(q.clone(), k.clone(), cos_sin)
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_scatter_rows(kernels: ModuleType, dtype: torch.dtype) -> None:
    torch.manual_seed(5)
    cache = torch.zeros(20, 2, 8).to(dtype)
    wide = torch.randn(4, 3, 2, 8).to(dtype)
    src = wide[:, 1]  # rows at a stride, each contiguous
    index = torch.tensor([7, 0, 19, 3])
    want = cache.clone().index_copy_(0, index, src)
    assert layer_ops.scatter_rows(cache, index, src)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))


def test_scatter_rows_refuses_an_index_out_of_range_and_writes_nothing(kernels: ModuleType) -> None:
    cache = torch.zeros(4, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        layer_ops.scatter_rows(cache, torch.tensor([1, 4]), torch.ones(2, 8))
    assert not cache.any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_store_is_rotary_then_the_two_scatters(
    kernels: ModuleType, dtype: torch.dtype
) -> None:
    """The decode plan's one call (`rotary_store`) leaves qkv and the slots bit for bit as
    `rotary` and a `scatter_rows` of k and of v do, on rows at a stride."""
    torch.manual_seed(6)
    n, heads, kv_heads, d, slots = 5, 6, 2, 32, 30
    emb = rope.RotaryEmbedding(d, 512, 10000.0, None, dtype, torch.device("cpu"))
    cos, sin = (t.view(n, d) for t in emb(torch.tensor([0, 3, 64, 200, 511])))
    width = (heads + 2 * kv_heads) * d
    qkv = torch.randn(n, width + 16).to(dtype)[:, :width]  # rows at a stride
    index = torch.tensor([29, 0, 7, 8, 15])
    want_qkv, got_qkv = qkv.clone(), qkv.clone()
    want = [torch.zeros(slots, kv_heads * d, dtype=dtype) for _ in range(2)]
    got = [torch.zeros(slots, kv_heads * d, dtype=dtype) for _ in range(2)]
    q, k, v = want_qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    kernels.rotary(q, k, cos, sin, d)
    kernels.scatter_rows(want[0], index, k)
    kernels.scatter_rows(want[1], index, v)
    kernels.rotary_store(got_qkv, heads * d, cos, sin, d, got[0], got[1], index)
    for a, b in zip([got_qkv, *got], [want_qkv, *want], strict=True):
        assert torch.equal(
            a.view(torch.int16 if dtype != torch.float32 else torch.int32),
            b.view(torch.int16 if dtype != torch.float32 else torch.int32),
        )


def test_rotary_store_refuses_an_index_out_of_range_and_writes_nothing(
    kernels: ModuleType,
) -> None:
    qkv = torch.ones(2, 4 * 8)
    keys, values = torch.zeros(4, 8), torch.zeros(4, 8)
    cos, sin = torch.ones(2, 8), torch.zeros(2, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.rotary_store(qkv, 16, cos, sin, 8, keys, values, torch.tensor([1, 4]))
    assert torch.equal(qkv, torch.ones(2, 4 * 8)) and not keys.any() and not values.any()


def test_bad_shapes_are_refused(kernels: ModuleType) -> None:
    with pytest.raises(RuntimeError, match="weight"):
        kernels.rms_norm(torch.randn(2, 8), None, torch.ones(7), 1e-5, torch.float32)
    with pytest.raises(RuntimeError, match="gate_up"):
        kernels.silu_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="cos"):
        kernels.rotary(
            torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 4), torch.randn(2, 4), 8
        )
