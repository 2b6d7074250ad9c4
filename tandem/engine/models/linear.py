"""Linear layers whose CPU products take the routes measured on the machine (`routes.py`).

A decode step's products (1-32 rows: small-batch decode, speculative verification of a few
drafts) are bound by reading the weights, and `F.linear` is far from that bound on CPU. The native
`row_gemm` (csrc/kernels/row_gemm.h) reads each weight once per 8 rows, and a row's result from it
does not depend on the other rows: a token verified among drafts gets the logits a decode step
gives it. `DenseProduct` holds a product's routes, one per row bucket, as `routes.bind` measured
them; before `bind` (and for other dtypes, autograd, CUDA) `linear` runs, whose routes are the
defaults, measured on the AVX-512 BF16 machine (SmolLM2, 2 threads, one process, interleaved):

- float32, 1-2 rows: `weight @ x.T`, a single row padded to two (torch's matrix-vector route is
  the slow one): 1.5-5x `F.linear`, near the machine's read bandwidth. `row_gemm` there made
  batch-1 decode slower (TPOT 26.2 against 22.7 ms), so float32 verification and decoding agree
  to rounding (~1e-6), not bit for bit.
- float32, 3-32 rows: `row_gemm`. Per call in the engine, against `weight @ x.T`: 228 us against
  287 at 3 rows, 304 against 481 at 8, 453 against 741 at 16, 783 against 989 at 32; decode at
  batch 8 / 16 / 32 went from 92 / 115 / 147 to 127 / 153 / 167 tok/s (same tokens).
- bfloat16, 1-16 rows: `row_gemm` (AVX-512 BF16 dot products where the CPU has them). Batch-1
  decode: TPOT 17.0 ms against 26.3 with `F.linear` (44.8 against 31.7 tok/s); a step's products
  alone (30 layers and the LM head, cold weights) 14 ms at 1 row against 21, 20 against 23 at 8,
  level at 16, 52 against 39 at 32, so from 17 rows on `F.linear` runs. torch's bfloat16 GEMM
  is not row-invariant (on SmolLM2's down projection the first of several rows differs from the
  row alone), which made greedy speculative decoding in bfloat16 emit other tokens than plain
  decoding.

For other dtypes, tensors that need gradients, mixed dtypes, on CUDA, and without the native
library (float32 then takes `weight @ x.T` up to 8 rows), `F.linear` runs. `row_gemm` adds the
bias in float32 before the one rounding to bfloat16.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine import native, routes

if TYPE_CHECKING:  # the TP group's module imports nothing of the models
    from tandem.engine.tp.group import TPGroup

# Rows that `row_gemm` multiplies, by dtype: in float32 1-2 rows keep `weight @ x.T`.
ROW_GEMM_ROWS = {torch.float32: range(3, 33), torch.bfloat16: range(1, 17)}
MATMUL_MAX_ROWS = 8  # float32 rows that take `weight @ x.T` where `row_gemm` does not run
ROUTE_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}  # routes.CANDIDATES' kinds

# A linear layer's product bound to its weights: [rows, in] -> [rows, out] (`row_kernel`).
RowKernel = Callable[[torch.Tensor], torch.Tensor]


@functools.cache
def _row_gemm() -> Callable[..., torch.Tensor] | None:
    """The native kernel of the level in use, where the library built."""
    ext = native.extension()
    return ext.row_gemm if ext is not None else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x of shape [rows, in_features]."""
    rows = x.shape[0] if x.dim() == 2 else 0
    if x.device.type != "cpu" or rows == 0 or weight.dim() != 2:
        return F.linear(x, weight, bias)
    kernel = _row_gemm() if rows in ROW_GEMM_ROWS.get(x.dtype, ()) else None
    if (
        kernel is not None
        and not _needs_grad(x, weight, bias)
        and _native_weights(x.dtype, weight, bias)
    ):
        return kernel(x, weight, bias)
    if x.dtype == torch.float32 and rows <= MATMUL_MAX_ROWS:
        return _matmul(x, weight, bias)
    return F.linear(x, weight, bias)


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """weight @ x.T, a single row padded to two (torch's matrix-vector route is the slow one)."""
    rows = x.shape[0]
    padded = x.expand(2, -1).contiguous() if rows == 1 else x  # [max(rows, 2), in]
    y = torch.mm(weight, padded.t()).t()[:rows].contiguous()
    return y if bias is None else y + bias


def _native_weights(dtype: torch.dtype, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `row_gemm` takes inputs of `dtype` with these: a contiguous weight, one dtype."""
    return weight.is_contiguous() and all(t.dtype == dtype for t in (weight, bias) if t is not None)


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


@dataclass(frozen=True)
class RowGemmCall:
    """`row_gemm` bound to one layer's weight and bias; the decode plan's native layer loop
    reads its tensors (`models/decode_plan.py`)."""

    kernel: Callable[..., torch.Tensor]
    weight: torch.Tensor
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.bias)


class DenseProduct:
    """x @ weight.T + bias for 2-D float32 / bfloat16 inputs on CPU through the routes `bind`
    gives it (`routes.py`), one per row bucket; elsewhere, and before `bind`, `linear`. Holds its
    tensors by reference (a Linear's parameters, a tied embedding)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        self.chosen: routes.RouteSet | None = None  # by routes.bind
        self._calls: tuple[RowKernel, ...] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        calls = self._calls
        if calls is None or x.dim() != 2 or x.dtype != self.weight.dtype or x.shape[0] == 0:
            return linear(x, self.weight, self.bias)
        if _needs_grad(x, self.weight, self.bias):
            return F.linear(x, self.weight, self.bias)
        return calls[routes.bucket_of(x.shape[0])](x)

    def call_for(self, rows: int) -> RowKernel | None:
        """The bound route of `rows` rows of the weight's dtype (2-D, no autograd); None before
        `bind`."""
        calls = self._calls
        return None if calls is None else calls[routes.bucket_of(rows)]

    # routes.Routed
    @property
    def route_kind(self) -> str | None:
        w = self.weight
        if (
            w.device.type != "cpu"
            or w.dtype not in ROUTE_DTYPES
            or not _native_weights(w.dtype, w, self.bias)
        ):
            return None
        return ROUTE_DTYPES[w.dtype]

    @property
    def shape_key(self) -> str:
        out, in_features = self.weight.shape
        return f"{self.route_kind} {out}x{in_features}{' bias' if self.bias is not None else ''}"

    @property
    def activation_dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    def available_routes(self) -> frozenset[str]:
        names = {"f_linear", "matmul" if self.weight.dtype == torch.float32 else "f_linear_fp32"}
        return frozenset(names | ({"row_gemm"} if _row_gemm() is not None else set()))

    def route_call(self, name: str) -> RowKernel:
        weight, bias = self.weight, self.bias
        if name == "row_gemm":
            kernel = _row_gemm()
            assert kernel is not None
            return RowGemmCall(kernel, weight, bias)
        if name == "matmul":
            return lambda x: _matmul(x, weight, bias)
        if name == "f_linear_fp32":
            return lambda x: F.linear(
                x.float(), weight.float(), None if bias is None else bias.float()
            ).to(x.dtype)
        return lambda x: F.linear(x, weight, bias)

    def set_routes(self, chosen: routes.RouteSet) -> None:
        self.chosen = chosen
        self._calls = tuple(self.route_call(name) for name in chosen.names)

    def read_bytes(self, rows: int) -> int:
        """Bytes of weights a product of `rows` rows reads (every route reads them whole)."""
        return sum(t.nbytes for t in (self.weight, self.bias) if t is not None)


class Linear(nn.Linear):
    """nn.Linear whose products go through a `DenseProduct` over its own parameters. A
    row-parallel layer (`tp`: its input channels split over the group's ranks) sums the ranks'
    products with one all-reduce, each rounded to the model dtype first (float32: the sums of
    one device up to their order)."""

    def __init__(self, *args: Any, tp: TPGroup | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.product = DenseProduct(self.weight, self.bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(x)
        return y if self.tp is None else self.tp.all_reduce(y)

    def row_kernel(self, dtype: torch.dtype, rows: int) -> RowKernel:
        """The call `forward` makes for 2-D inputs of `rows` rows of `dtype` (no autograd), bound
        to this layer's tensors and to the route of that many rows; every linear layer of the
        decoder has this method (`models/decode_plan.py` calls it once per row count, not per
        step)."""
        found = self._row_product(dtype, rows)
        tp = self.tp
        if tp is None:
            return found
        return lambda x: tp.all_reduce(found(x))

    def _row_product(self, dtype: torch.dtype, rows: int) -> RowKernel:
        bound = self.product.call_for(rows) if dtype == self.weight.dtype else None
        if bound is not None:
            return bound
        weight, bias = self.weight, self.bias
        kernel = _row_gemm()  # the plan's steps: inputs of `dtype`, no autograd
        if (
            kernel is not None
            and _native_weights(dtype, weight, bias)
            and rows in ROW_GEMM_ROWS.get(dtype, range(0))
        ):
            return RowGemmCall(kernel, weight, bias)
        return lambda x: linear(x, weight, bias)
