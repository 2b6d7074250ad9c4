"""Weight-only int8 / int4: round-trip error bounds, the quantized layers against their dequantized
matmul (kernel and fallback paths), GGUF block mapping, and a tiny model quantized end to end."""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from tandem.config import EngineConfig
from tandem.engine import LLM, SamplingParams
from tandem.engine.engine_core import EngineCore
from tandem.engine.quant import int4, int8
from tandem.engine.quant.gguf_blocks import q4_to_int4, q8_0_to_int8
from tandem.engine.quant.int4 import (
    Int4Linear,
    layer_group_size,
    pack_codes,
    quantize_int4,
    unpack_codes,
)
from tandem.engine.quant.int8 import Int8Linear, quantize_int8
from tandem.engine.quant.lm_head import KERNEL_MAX_ROWS, RESCORED, TILED_MAX_ROWS
from tandem.engine.quant.model import quantize_linear, replace_rows

pytestmark = pytest.mark.usefixtures("one_thread")

Q = gguf.GGMLQuantizationType
CPU = torch.device("cpu")


def weight(out: int = 48, inp: int = 128, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out, inp, generator=gen) * torch.rand(out, 1, generator=gen)  # rows vary


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


# --- formats ------------------------------------------------------------------------------


def test_int8_round_trip_within_half_a_step() -> None:
    w = weight()
    q = quantize_int8(w)
    assert q.qweight.dtype == torch.int8 and q.scales.shape == (48,)
    assert torch.equal(q.qweight.abs().amax(dim=1), torch.full((48,), 127, dtype=torch.int8))
    error = (q.dequantize() - w).abs()
    assert (error <= q.scales[:, None] / 2 + 1e-7).all()


def test_int4_round_trip_within_half_a_step() -> None:
    w = weight()
    for group in (32, 64, 128):
        q = quantize_int4(w, group)
        assert q.group_size == group and q.qweight.shape == (48, 64)
        codes = unpack_codes(q.qweight).view(48, -1, group)
        assert (codes.amin(-1) == 0).all() and (codes.amax(-1) == 15).all()  # min and max hit
        step = q.scales.repeat_interleave(group, dim=1)
        assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()


def test_zero_rows_quantize_to_zero() -> None:
    w = torch.zeros(16, 64)
    assert torch.equal(quantize_int8(w).dequantize(), w)
    assert torch.equal(quantize_int4(w, 32).dequantize(), w)


def test_nibble_packing() -> None:
    codes = torch.arange(32, dtype=torch.uint8).remainder(16).view(2, 16)
    packed = pack_codes(codes)
    assert packed[0, 0] == 0x01 and packed[0, 7] == 0xEF  # code 2j in the high nibble
    assert torch.equal(unpack_codes(packed), codes)


def test_layer_group_size() -> None:
    assert layer_group_size(576, 32) == 32
    assert layer_group_size(576, 128) == 64  # SmolLM2's hidden size
    assert layer_group_size(1536, 128) == 128
    with pytest.raises(ValueError, match="multiple of 32"):
        layer_group_size(80, 32)


# --- layers -------------------------------------------------------------------------------


def make_layer(method: str, dtype: torch.dtype, bias: bool = True) -> Int8Linear | Int4Linear:
    linear = torch.nn.Linear(128, 48, bias=bias, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(weight())
    return quantize_linear(linear, method, 32, [])


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_kernels_are_used_on_this_cpu(method: str) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        assert make_layer(method, dtype).use_kernel


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_matches_dequantized_matmul(method: str, dtype: torch.dtype) -> None:
    """The kernel path: bfloat16 activations, float32 sums, the output rounded to bfloat16 (and
    once more with the bias in a bfloat16 model)."""
    layer = make_layer(method, dtype)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert layer.bias is not None
    want = F.linear(x.to(torch.bfloat16).float(), layer.dequantize(), layer.bias.float())
    got = layer(x)
    assert got.dtype == dtype and got.shape == (5, 48)
    assert relative_error(got, want) < 2**-8


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"]
)
def test_fallback_matches_dequantized_matmul(
    method: str, dtype: torch.dtype, tolerance: float
) -> None:
    """Dequantize-then-matmul in the model dtype; long inputs take it even with a kernel."""
    layer = make_layer(method, dtype)
    x = torch.randn(200, 128, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert layer.bias is not None
    want = F.linear(x.float(), layer.dequantize(), layer.bias.float())
    long_input = layer(x)
    assert long_input.dtype == dtype
    assert relative_error(long_input, want) < tolerance
    layer.use_kernel = False
    assert torch.equal(layer(x[:5]), long_input[:5])


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_and_fallback_agree(method: str, dtype: torch.dtype) -> None:
    layer = make_layer(method, dtype)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(2)).to(dtype)  # any lead
    packed = layer(x)
    layer.use_kernel = False
    fallback = layer(x)
    assert packed.shape == fallback.shape == (2, 3, 48)
    assert relative_error(packed, fallback) < 1e-2  # bfloat16 rounding on either side


def test_kernel_limits_are_set() -> None:
    """Long prefills take the fallback; decode batches stay on the kernels."""
    assert int8.KERNEL_MAX_TOKENS >= 16 and int4.KERNEL_MAX_TOKENS >= 16


def test_bias_kept() -> None:
    for method in ("int8", "int4"):
        assert make_layer(method, torch.float32, bias=False).bias is None
        layer = make_layer(method, torch.float32)
        assert layer.bias is not None and layer.bias.shape == (48,)


def test_int4_without_kernel_shape_falls_back() -> None:
    """The CPU kernel needs out_features % 16 == 0; other shapes dequantize."""
    linear = torch.nn.Linear(64, 40, dtype=torch.bfloat16)
    layer = quantize_linear(linear, "int4", 32, [])
    assert isinstance(layer, Int4Linear) and not layer.use_kernel and layer.packed is None
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert layer.bias is not None
    assert (
        relative_error(
            layer(x), F.linear(x.float(), layer.dequantize().float(), layer.bias.float())
        )
        < 1e-2
    )


# --- GGUF blocks --------------------------------------------------------------------------


def gguf_blocks(w: torch.Tensor, qtype: Q) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.quantize(w.numpy(), qtype))  # [rows, bytes]


def gguf_values(blocks: torch.Tensor, qtype: Q) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(blocks.numpy(), qtype)))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_q4_blocks_map_exactly(qtype: Q) -> None:
    blocks = gguf_blocks(weight(), qtype)
    mapped = q4_to_int4(qtype, blocks)
    assert mapped.group_size == 32
    values = gguf_values(blocks, qtype)
    torch.testing.assert_close(mapped.dequantize(), values, atol=1e-6, rtol=1e-6)


def test_q4_1_mapping_equals_dequantize_then_requantize() -> None:
    blocks = gguf_blocks(weight(), Q.Q4_1)
    mapped = q4_to_int4(Q.Q4_1, blocks)
    requantized = quantize_int4(gguf_values(blocks, Q.Q4_1), 32)
    assert torch.equal(mapped.qweight, requantized.qweight)  # Q4_1 spans min to max too
    torch.testing.assert_close(mapped.scales, requantized.scales, atol=0, rtol=1e-5)
    torch.testing.assert_close(mapped.dequantize(), requantized.dequantize(), atol=1e-6, rtol=0)


def test_q8_0_mapping_equals_dequantize_then_requantize() -> None:
    blocks = gguf_blocks(weight(), Q.Q8_0)
    mapped = q8_0_to_int8(blocks)
    requantized = quantize_int8(gguf_values(blocks, Q.Q8_0))
    assert torch.equal(mapped.qweight, requantized.qweight)
    assert torch.equal(mapped.scales, requantized.scales)
    # Per-row requantization costs at most half a step of the row's scale.
    error = (mapped.dequantize() - gguf_values(blocks, Q.Q8_0)).abs()
    assert (error <= mapped.scales[:, None] / 2 + 1e-7).all()


def test_q8_0_codes_kept_when_a_row_shares_one_scale() -> None:
    codes = torch.randint(-127, 128, (4, 64), generator=torch.Generator().manual_seed(3))
    codes[:, ::32] = 127  # every block reaches the maximum
    blocks = gguf_blocks(codes.float() * 0.01, Q.Q8_0)
    assert torch.equal(q8_0_to_int8(blocks).qweight, codes.to(torch.int8))


def test_direct_rows_replace_quantized_rows() -> None:
    """A fused layer takes a mapped projection's rows as they are; the rest stays quantized."""
    fused = weight(96, 64)
    linear = torch.nn.Linear(64, 96, bias=False)
    with torch.no_grad():
        linear.weight.copy_(fused)
    part = q4_to_int4(Q.Q4_1, gguf_blocks(fused[32:64], Q.Q4_1))
    layer = quantize_linear(linear, "int4", 32, [(32, part)])
    assert isinstance(layer, Int4Linear)
    own = quantize_int4(fused, 32).qweight
    assert torch.equal(layer.qweight[32:64], part.qweight)
    assert torch.equal(layer.qweight[:32], own[:32]) and torch.equal(layer.qweight[64:], own[64:])
    scales = layer.scales_and_zeros[..., 0].T.float()  # [out, groups], rounded to bfloat16
    torch.testing.assert_close(scales[32:64], part.scales, rtol=2**-8, atol=0)
    with pytest.raises(ValueError, match="cannot put"):
        replace_rows(quantize_int4(fused, 64), 0, part)  # other group size


# --- a tiny model end to end --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_float(tiny_llama_path: Path) -> LLM:
    return LLM(str(tiny_llama_path), num_blocks=16, block_size=16)


PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


# The tiny model's weights are drawn at 10x the usual scale and its logits amplify weight noise:
# int4 with groups of 32 moves them by ~40%, int8 by ~3%.
@pytest.mark.parametrize(("method", "bound"), [("int8", 0.06), ("int4", 0.6)])
def test_tiny_model_quantized_end_to_end(
    tiny_llama_path: Path,
    tiny_float: LLM,
    prompt_logits: Callable[[Any, list[int]], torch.Tensor],
    method: str,
    bound: float,
) -> None:
    """The quantized model computes what a float model holding its dequantized weights computes:
    exactly through dequantize-then-matmul, within bfloat16 rounding through the kernels (whose
    activations are bfloat16); and it stays near the original float model (loose)."""
    llm = LLM(str(tiny_llama_path), num_blocks=16, block_size=16, quantization=method)
    dequantized = LLM(str(tiny_llama_path), num_blocks=16, block_size=16)
    kind = Int8Linear if method == "int8" else Int4Linear
    layers = []
    for ours, theirs in zip(llm.engine.model.layers, dequantized.engine.model.layers, strict=True):
        for name in PROJECTIONS:
            layer = ours.get_submodule(name)
            assert isinstance(layer, kind) and layer.use_kernel
            layers.append(layer)
            with torch.no_grad():
                theirs.get_submodule(name).weight.copy_(layer.dequantize())
    assert isinstance(llm.engine.model.embed_tokens, torch.nn.Embedding)  # not quantized
    ids = list(range(3, 3 + int8.KERNEL_MAX_TOKENS))  # few enough tokens for both kernels
    reference = prompt_logits(dequantized.engine, ids)
    # ~1% here: the tiny model amplifies the bfloat16 rounding of the kernels' activations.
    assert relative_error(prompt_logits(llm.engine, ids), reference) < 0.03
    # dequantize-then-matmul, pinned (routes.py): the float model's own arithmetic
    pinned = LLM(
        str(tiny_llama_path),
        num_blocks=16,
        block_size=16,
        quantization=method,
        kernel_routes="dequant",
    )
    got = prompt_logits(pinned.engine, ids)
    assert relative_error(got, reference) < 1e-5
    assert relative_error(got, prompt_logits(tiny_float.engine, ids)) < bound
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert len(llm.generate([ids[:8]], params)[0].token_ids) == 8  # decode steps run too


def test_qwen2_bias_survives_quantization(
    tmp_path: Path, tiny_llama_kwargs: dict[str, int]
) -> None:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen2Config(**tiny_llama_kwargs)).save_pretrained(tmp_path)
    ref = EngineConfig.create(str(tmp_path), num_blocks=8)
    assert ref.model.quantization is None
    float_model = EngineCore(ref).model
    quantized = EngineCore(EngineConfig.create(str(tmp_path), num_blocks=8, quantization="int8"))
    qkv = quantized.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Int8Linear) and qkv.bias is not None
    torch.testing.assert_close(qkv.bias, float_model.layers[0].self_attn.qkv_proj.bias)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_lm_head_gets_an_int8_copy(
    tmp_path: Path, tiny_llama_kwargs: dict[str, int], tied: bool, method: str
) -> None:
    """Logits of steps of up to `max_rows` rows (KERNEL_MAX_ROWS, or TILED_MAX_ROWS for the
    native kernel) come from an int8 copy of the output
    projection, float32, with the highest RESCORED of each row recomputed from the float weight;
    larger steps and the embedding lookups keep the float weight."""
    torch.manual_seed(0)
    config = LlamaConfig(tie_word_embeddings=tied, **tiny_llama_kwargs)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    float_model = EngineCore(EngineConfig.create(str(tmp_path), num_blocks=8)).model
    model = EngineCore(EngineConfig.create(str(tmp_path), num_blocks=8, quantization=method)).model
    assert float_model.quantized_lm_head is None and (model.lm_head is None) == tied
    head = model.quantized_lm_head
    assert head is not None and head.int8.use_kernel and head.int8.bias is None
    assert torch.equal(model.embed_tokens.weight, float_model.embed_tokens.weight)
    output = float_model.embed_tokens if float_model.lm_head is None else float_model.lm_head
    weight = output.weight.detach()  # [vocab, hidden]
    reference = quantize_int8(weight).dequantize()
    assert relative_error(head.int8.dequantize(), reference) < 2**-8  # scales in bfloat16

    assert head.max_rows == (KERNEL_MAX_ROWS if head.int8.tiles is None else TILED_MAX_ROWS)
    hidden = torch.randn(head.max_rows + 1, 64, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        few = model.compute_logits(hidden[:-1])  # [max_rows, vocab]
        int8_logits = head.int8(hidden[:-1]).float()
        everything = model.compute_logits(hidden)
        float_logits = float_model.compute_logits(hidden)
    assert few.dtype == torch.float32 and few.shape == (head.max_rows, 256)
    exact = hidden[:-1] @ weight.T
    rescored = int8_logits.topk(RESCORED, dim=-1).indices  # [max_rows, RESCORED]
    torch.testing.assert_close(few.gather(-1, rescored), exact.gather(-1, rescored))
    assert torch.equal(few.argmax(-1), exact.argmax(-1))
    tail = torch.ones_like(few, dtype=torch.bool).scatter_(-1, rescored, False)
    assert torch.equal(few[tail], int8_logits[tail])
    want = F.linear(hidden[:-1].to(torch.bfloat16).float(), reference)
    assert relative_error(int8_logits, want) < 2**-7  # bfloat16 activations, output and scales
    assert torch.equal(everything, float_logits)


def test_lm_head_rows_do_not_depend_on_the_step(tiny_llama_path: Path) -> None:
    """A row's logits are the same alone or among others (speculative verification)."""
    model = EngineCore(EngineConfig.create(str(tiny_llama_path), quantization="int8")).model
    hidden = torch.randn(KERNEL_MAX_ROWS, 64, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        together = model.compute_logits(hidden)
        alone = torch.cat([model.compute_logits(row[None]) for row in hidden])
    assert torch.equal(together, alone)


# --- configuration ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "field"),
    [({"quantization": "int3"}, "quantization"), ({"quant_group_size": 48}, "quant_group_size")],
)
def test_bad_config_is_refused(options: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig.create(**options)


def test_config_routes_quantization() -> None:
    config = EngineConfig.create(quantization="int4", quant_group_size=128)
    assert config.model.quantization == "int4" and config.model.quant_group_size == 128
