"""The CPU routes of linear products (`engine/routes.py`): every route, forced, computes the
product within the error its arithmetic allows; the table of measured routes is written, read
back, kept per machine identity, and a corrupt one is measured again, never a crash; exactness
keeps bfloat16 decode rows on row-invariant routes.

Tolerances. Against the float64 product of the same inputs and (dequantized) weights, a sum of K
products each carrying a relative error of at most u (its inputs' rounding), added in float32,
is off by at most (u + gamma_K) * sum_k |x_k w_k| with gamma_K = K 2^-24 / (1 - K 2^-24); the
result's own rounding to its dtype adds u_out |y|. The routes round nothing before the products
(bfloat16 and int codes times bfloat16 are exact in float32; float32 inputs are the inputs), but
`dequant` in bfloat16 rounds each dequantized weight to bfloat16 first (u = 2^-8), and torch's
float32 GEMM may use FMA or not (inside gamma_K). Those bounds are worst cases: the checks hold
on any CPU, whichever order a kernel sums in.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from tandem.engine import routes
from tandem.engine.models.linear import DenseProduct
from tandem.engine.quant.model import quantize_linear

BF16_U = 2.0**-8
FP32_U = 2.0**-24


def _bound(
    x: torch.Tensor,
    w: torch.Tensor,
    weight_u: float,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The error bound of the module docstring, per output ([rows, out]); with a bias, the
    product may be rounded to the output dtype once before the bias is added (F.linear)."""
    k = x.shape[1]
    gamma = k * FP32_U / (1 - k * FP32_U)
    magnitude = x.double().abs() @ w.double().abs().T
    product = x.double() @ w.double().T
    out_u = BF16_U if out_dtype == torch.bfloat16 else FP32_U
    if bias is None:
        return (weight_u + gamma) * magnitude + out_u * product.abs() + 1e-30
    result = product + bias.double()
    return (weight_u + gamma) * magnitude + out_u * (product.abs() + result.abs()) + 1e-30


def _dense(dtype: torch.dtype, bias: bool) -> DenseProduct:
    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(48, 200, generator=g) * 0.1).to(dtype)
    return DenseProduct(weight, (torch.randn(48, generator=g) * 0.1).to(dtype) if bias else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_every_dense_route_equals_the_float64_product(dtype: torch.dtype, bias: bool) -> None:
    product = _dense(dtype, bias)
    names = sorted(product.available_routes())
    assert "row_gemm" in names, "the native library builds on every CPU the tests run on"
    g = torch.Generator().manual_seed(2)
    for rows in range(1, 41):
        x = torch.randn(rows, 200, generator=g).to(dtype)
        want = x.double() @ product.weight.double().T
        if product.bias is not None:
            want = want + product.bias.double()
        bound = _bound(x, product.weight, 0.0, dtype, product.bias)
        for name in names:
            got = product.route_call(name)(x)
            assert got.dtype == dtype and got.shape == (rows, 48)
            err = (got.double() - want).abs()
            assert (err <= bound).all(), (name, rows, float((err / bound).max()))


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_quantized_route_equals_the_float64_product(method: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    linear = torch.nn.Linear(192, 48, bias=False, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 192, generator=g) * 0.05)
    layer = quantize_linear(linear, method, 64, [])
    weights = layer.dequantize(torch.float64)  # what every route multiplies by
    names = sorted(layer.available_routes())
    assert {"quant_gemm", "dequant", "dequant_fp32"} <= set(names)
    for rows in range(1, 41):
        x = torch.randn(rows, 192, generator=g).to(dtype)
        # the kernels take bfloat16 rows: a float32 model's rows are rounded on the way in
        kernel_rows = x.to(torch.bfloat16).double()
        for name in names:
            got = layer.route_call(name)(x)
            assert got.dtype == dtype and got.shape == (rows, 48)
            kernel = name in ("quant_gemm", "torch_packed")
            inputs = kernel_rows if kernel else x.double()
            weight_u = BF16_U if name == "dequant" and dtype == torch.bfloat16 else FP32_U
            # quant_gemm and torch_packed round their output to bfloat16 whatever the model dtype
            out_dtype = torch.bfloat16 if kernel else dtype
            bound = _bound(inputs, weights, weight_u, out_dtype)
            err = (got.double() - inputs @ weights.T).abs()
            assert (err <= bound).all(), (name, rows, float((err / bound).max()))


def test_buckets_and_descriptions() -> None:
    assert [routes.bucket_of(n) for n in (1, 2, 3, 4, 5, 16, 17, 128, 129, 5000)] == [
        0,
        1,
        2,
        2,
        3,
        4,
        5,
        6,
        7,
        7,
    ]
    chosen = routes.RouteSet(("row_gemm",) * 5 + ("f_linear",) * 2 + ("f_linear_fp32",))
    assert chosen.route(16) == "row_gemm" and chosen.route(17) == "f_linear"
    assert chosen.route(10_000) == "f_linear_fp32"
    assert chosen.describe() == "1-16 row_gemm, 17-128 f_linear, 129+ f_linear_fp32"


def test_exactness_restricts_the_candidates() -> None:
    every = frozenset(routes.CANDIDATES["bfloat16"])
    assert routes.candidates("bfloat16", 16, True, every) == ["row_gemm"]
    assert set(routes.candidates("bfloat16", 16, False, every)) == every
    assert "row_gemm" not in routes.candidates("bfloat16", 33, True, every)
    quant = frozenset(routes.CANDIDATES["int4"])
    assert routes.candidates("int4", 8, True, quant) == ["quant_gemm"]
    # without the native kernels nothing is row-invariant: exactness cannot restrict
    assert routes.candidates("bfloat16", 4, True, frozenset({"f_linear"})) == ["f_linear"]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    return tmp_path


def _measures(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The shape keys `routes.measure` is called for, recorded (it still measures)."""
    calls: list[str] = []
    real = routes.measure

    def recorded(layer: routes.Routed, exact: bool) -> dict:
        calls.append(layer.shape_key)
        return real(layer, exact)

    monkeypatch.setattr(routes, "measure", recorded)
    return calls


def test_the_table_is_measured_once_then_read(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _measures(monkeypatch)
    first, second = _dense(torch.bfloat16, False), _dense(torch.bfloat16, False)
    routes.bind([first], "auto", exact=True)
    assert calls == ["bfloat16 48x200"]
    path = routes.table_path(routes.machine_identity())
    data = json.loads(path.read_text())
    entry = data["shapes"]["bfloat16 48x200 exact"]
    assert entry["routes"][: routes.bucket_of(routes.INVARIANT_ROWS) + 1] == ["row_gemm"] * 5
    assert set(entry["us"]) == {str(rows) for rows in routes.bucket_rows()}
    routes.bind([second], "auto", exact=True)  # another process of the machine: read, not measured
    assert calls == ["bfloat16 48x200"]
    assert second.chosen == first.chosen
    routes.bind([second], "probe", exact=True)  # measured again on request
    assert len(calls) == 2


def test_a_table_is_per_machine_identity(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU model, ISA level, native build, torch version and thread count each name another
    table."""
    base = routes.machine_identity(2)
    assert routes.table_path(base) == routes.table_path(routes.machine_identity(2))
    for field in (
        "model",
        "native_level",
        "native_build",
        "torch",
        "torch_cpu",
        "threads",
        "isa_flags",
    ):
        other = {**base, field: f"{base[field]} (another)"}
        assert routes.table_path(other) != routes.table_path(base), field
    # a file of another identity at this path (copied by hand) is not used
    path = routes.table_path(base)
    path.parent.mkdir(parents=True)
    routes.write_table(path, {**base, "threads": "7"}, {"x": {"routes": ["f_linear"] * 8}})
    assert routes.read_table(path, base) == {}


@pytest.mark.parametrize(
    "content",
    ["{not json", json.dumps([1, 2]), json.dumps({"identity": None}), "BAD"],
)
def test_a_corrupt_table_is_measured_again(
    home: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, content: str
) -> None:
    identity = routes.machine_identity()
    path = routes.table_path(identity)
    path.parent.mkdir(parents=True)
    path.write_text(content)
    calls = _measures(monkeypatch)
    product = _dense(torch.float32, False)
    with caplog.at_level(logging.WARNING, logger=routes.__name__):
        routes.bind([product], "auto", exact=False)
    assert calls == ["float32 48x200"] and product.chosen is not None
    assert "measuring again" in caplog.text
    assert "float32 48x200" in json.loads(path.read_text())["shapes"]  # rewritten, whole


def test_malformed_entries_are_measured_again(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    identity = routes.machine_identity()
    path = routes.table_path(identity)
    path.parent.mkdir(parents=True)
    routes.write_table(path, identity, {"float32 48x200": {"routes": ["no_such_route"] * 8}})
    calls = _measures(monkeypatch)
    routes.bind([_dense(torch.float32, False)], "auto", exact=False)
    assert calls == ["float32 48x200"]


@pytest.mark.parametrize("policy", ["default", "f_linear", "row_gemm"])
def test_default_and_forced_routes_measure_nothing(
    home: Path, monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    calls = _measures(monkeypatch)
    product = _dense(torch.bfloat16, False)
    routes.bind([product], policy, exact=False)
    assert calls == [] and not (home / "routes").exists()
    assert product.chosen is not None
    for rows in routes.bucket_rows():
        want = routes.default_route("bfloat16", rows) if policy == "default" else policy
        if policy == "row_gemm" and rows > routes.ROW_GEMM_MAX_ROWS:
            want = routes.default_route("bfloat16", rows)  # not a candidate there
        assert product.chosen.route(rows) == want


def test_forced_routes_keep_exactness(home: Path) -> None:
    product = _dense(torch.bfloat16, False)
    routes.bind([product], "f_linear", exact=True)
    assert product.chosen is not None
    assert product.chosen.route(16) == "row_gemm" and product.chosen.route(17) == "f_linear"
