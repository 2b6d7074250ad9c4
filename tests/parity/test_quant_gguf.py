"""GGUF blocks straight into quantized layers: tiny llama.cpp-style files (Q/K rows permuted, as the
converter writes them) loaded with quantization give back llama.cpp's weights where the blocks map
exactly (up to the scales' and zeros' rounding to bfloat16), through the loader's row order and the
q/k/v and gate/up fusion; requantized weights differ by far more."""

import dataclasses
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch
from test_gguf_loader import TINY_MODELS, write_gguf

from tandem.config import EngineConfig
from tandem.engine.engine_core import EngineCore
from tandem.engine.quant import Int4Linear, Int8Linear, gguf_direct_weights
from tandem.engine.quant.model import joined_rows, quantize_weight, replace_rows

pytestmark = pytest.mark.usefixtures("one_thread")

Q = gguf.GGMLQuantizationType
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def engines(path: Path, method: str, group_size: int = 32) -> tuple[EngineCore, EngineCore]:
    """(float32 engine, quantized engine) over the same file."""
    common = {"num_blocks": 8, "block_size": 16}
    quantized = EngineConfig.create(
        str(path), quantization=method, quant_group_size=group_size, **common
    )
    return EngineCore(EngineConfig.create(str(path), **common)), EngineCore(quantized)


def weight_error(float_engine: EngineCore, quantized: EngineCore, name: str, rows: slice) -> float:
    """Largest relative difference (Frobenius norm) between a float layer's weight rows and a
    quantized one's, over all layers."""
    errors = []
    for f, q in zip(float_engine.model.layers, quantized.model.layers, strict=True):
        want = f.get_submodule(name).weight.detach()[rows]
        errors.append(float((q.get_submodule(name).dequantize()[rows] - want).norm() / want.norm()))
    return max(errors)


# bfloat16 scales and zeros: at most 2^-8 of each, a fraction of a quantization step; a
# requantized int4 weight is off by a few percent.
EXACT = 2e-3
REQUANTIZED = 1e-2
ALL = slice(None)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=["Q4_0", "Q4_1"])
def test_q4_file_loads_into_int4_exactly(
    tmp_path: Path, qtype: Q, prompt_logits: Callable[[EngineCore, list[int]], torch.Tensor]
) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(path, TINY_MODELS["llama"], "llama", lambda name, i: qtype)
    direct = gguf_direct_weights(path, "int4", 32)
    assert len(direct) == 2 * 7  # every projection of both layers
    float_engine, quantized = engines(path, "int4")
    for name in PROJECTIONS:
        assert isinstance(quantized.model.layers[0].get_submodule(name), Int4Linear)
        assert weight_error(float_engine, quantized, name, ALL) < EXACT, name
    ids = list(range(3, 30))
    got, want = prompt_logits(quantized, ids), prompt_logits(float_engine, ids)
    assert float((got - want).norm() / want.norm()) < 1e-2  # bfloat16 activations in the kernel


@pytest.mark.parametrize(("qtype", "method"), [(Q.Q4_1, "int4"), (Q.Q8_0, "int8")])
def test_blocks_covering_a_projection_make_it_without_quantizing(
    tmp_path: Path, qtype: Q, method: str
) -> None:
    """Blocks for every row of a projection (here in two parts) give the weight that
    quantizing the float weight and then copying the blocks' rows over it gives, bit for bit."""
    path = tmp_path / "tiny.gguf"
    write_gguf(path, TINY_MODELS["llama"], "llama", lambda name, i: qtype)
    whole = gguf_direct_weights(path, method, 32)["model.layers.0.mlp.down_proj.weight"]
    rows = len(whole.qweight)
    fields = dataclasses.fields(whole)
    halves = [
        type(whole)(*(getattr(whole, f.name)[part] for f in fields))
        for part in (slice(rows // 2), slice(rows // 2, None))
    ]
    parts = [(0, halves[0]), (rows // 2, halves[1])]
    replaced = quantize_weight(whole.dequantize(), method, 32)
    for offset, part in parts:
        replace_rows(replaced, offset, part)
    joined = joined_rows(parts[::-1], rows)
    assert joined is not None
    assert all(torch.equal(getattr(joined, f.name), getattr(replaced, f.name)) for f in fields)
    assert joined_rows(parts[:1], rows) is None  # rows left to quantize


def test_mixed_file_maps_what_it_can(tmp_path: Path) -> None:
    """Q4_1 q/k with Q8_0 v: q and k rows of the fused layer are llama.cpp's, v is requantized."""
    path = tmp_path / "tiny.gguf"
    write_gguf(
        path,
        TINY_MODELS["llama"],
        "llama",
        lambda name, i: Q.Q8_0 if "v_proj" in name else Q.Q4_1,
    )
    assert not any("v_proj" in name for name in gguf_direct_weights(path, "int4", 32))
    float_engine, quantized = engines(path, "int4")
    cfg = float_engine.model.cfg
    qk_rows = cfg.q_size + cfg.kv_size
    qkv = "self_attn.qkv_proj"
    assert weight_error(float_engine, quantized, qkv, slice(qk_rows)) < EXACT
    assert weight_error(float_engine, quantized, qkv, slice(qk_rows, None)) > REQUANTIZED


def test_q8_0_file_into_int8(tmp_path: Path) -> None:
    """Q8_0 rows are requantized per channel: within half a step of llama.cpp's values, plus the
    scale's rounding to bfloat16 (up to 2^-8 of a step times a code of up to 127): one step."""
    path = tmp_path / "tiny.gguf"
    write_gguf(path, TINY_MODELS["llama"], "llama", lambda name, i: Q.Q8_0)
    assert len(gguf_direct_weights(path, "int8", 32)) == 2 * 7
    float_engine, quantized = engines(path, "int8")
    for f, q in zip(float_engine.model.layers, quantized.model.layers, strict=True):
        for name in PROJECTIONS:
            layer = q.get_submodule(name)
            assert isinstance(layer, Int8Linear)
            error = (layer.dequantize() - f.get_submodule(name).weight.detach()).abs()
            assert (error <= layer.scales.float()[:, None]).all(), name


def test_group_128_requantizes_q4_blocks(tmp_path: Path) -> None:
    """Groups wider than a block take nothing from the blocks; each layer's group is 128 halved
    until it divides the input size (64 for hidden 64, 32 for intermediate 96)."""
    path = tmp_path / "tiny.gguf"
    write_gguf(path, TINY_MODELS["llama"], "llama", lambda name, i: Q.Q4_1)
    assert gguf_direct_weights(path, "int4", 128) == {}
    float_engine, quantized = engines(path, "int4", 128)
    layer = quantized.model.layers[0]
    assert layer.self_attn.qkv_proj.group_size == 64
    assert layer.mlp.down_proj.group_size == 32
    assert weight_error(float_engine, quantized, "self_attn.qkv_proj", ALL) > REQUANTIZED
