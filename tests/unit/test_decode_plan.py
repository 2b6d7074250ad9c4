"""The decode plan (`models/decode_plan.py`) computes exactly what the module path computes: the
same hidden states and the same KV slots, bit for bit, for decodes and verifications, in every
model dtype and weight format it covers and every KV cache format, through its Python loop and
through the native one (`csrc/decode_layers.cpp`) where that runs; steps and models it does not
cover take the module path."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.engine.attention import AttentionMetadata, SeqSpec, TorchSDPABackend
from tandem.engine.kv_quant import slot_dim
from tandem.engine.models import decode_plan, load_model
from tandem.engine.models.llama import LlamaForCausalLM
from tandem.engine.quant.model import quantize_model

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK_SIZE = 4
CPU = torch.device("cpu")


def _model(path: Path, dtype: torch.dtype, quantization: str | None) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return load_model(path, TorchSDPABackend, BLOCK_SIZE, dtype, CPU, quantization)


def _step(
    model: LlamaForCausalLM, shapes: list[tuple[int, int]], cache_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], AttentionMetadata]:
    """Seeded token ids, positions, filled KV caches and metadata for requests of (computed
    tokens, query tokens)."""
    cfg = model.cfg
    num_blocks = sum(-(-(c + q) // BLOCK_SIZE) for c, q in shapes) + 2
    free = list(range(num_blocks))
    random.Random(0).shuffle(free)
    seqs = [
        SeqSpec(c, q, [free.pop() for _ in range(-(-(c + q) // BLOCK_SIZE))]) for c, q in shapes
    ]
    gen = torch.Generator().manual_seed(1)
    shape = (2, num_blocks, BLOCK_SIZE, cfg.num_kv_heads, slot_dim(cache_dtype, cfg.head_dim))
    if cache_dtype.is_floating_point and cache_dtype.itemsize > 1:
        caches = [torch.randn(shape, generator=gen).to(cache_dtype) for _ in model.layers]
    else:  # quantized slots: random values, then scales of ~0.01 written by a real encode
        from tandem.engine.kv_quant import encode

        raw = (2, num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
        caches = [encode(torch.randn(raw, generator=gen), cache_dtype) for _ in model.layers]
    positions = torch.tensor([p for c, q in shapes for p in range(c, c + q)])
    ids = torch.randint(0, cfg.vocab_size, (len(positions),), generator=gen)
    return ids, positions, caches, model.backend.build_metadata(seqs, CPU)


def _module_path(
    model: LlamaForCausalLM,
    ids: torch.Tensor,
    positions: torch.Tensor,
    caches: list[torch.Tensor],
    meta: AttentionMetadata,
) -> torch.Tensor:
    x = model.embed_tokens(ids).float()
    cos_sin = model.rope(positions)
    for layer, cache in zip(model.layers, caches, strict=True):
        x = layer(cos_sin, x, cache, meta)
    return model.norm(x)


CASES = [
    (torch.float32, None, torch.float32),
    (torch.bfloat16, None, torch.bfloat16),
    (torch.bfloat16, "int8", torch.bfloat16),
    (torch.bfloat16, "int4", torch.bfloat16),
    (torch.bfloat16, "int4", torch.int8),
    (torch.float32, None, torch.int8),
    (torch.float32, "int4", torch.float32),  # routes cast to the kernels' bfloat16 and back
]


SHAPES = pytest.mark.parametrize(
    "shapes",
    [[(9, 1)], [(3, 1), (17, 1), (6, 1)], [(11, 4), (5, 1), (22, 3)]],
    ids=["one decode", "three decodes", "verifications"],
)
LOOPS = pytest.mark.parametrize("loop", ["native", "python"])


@pytest.mark.parametrize(("dtype", "quantization", "cache_dtype"), CASES)
@SHAPES
@LOOPS
def test_plan_equals_the_module_path(
    tiny_llama_path: Path,
    dtype: torch.dtype,
    quantization: str | None,
    cache_dtype: torch.dtype,
    shapes: list[tuple[int, int]],
    loop: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _model(tiny_llama_path, dtype, quantization)
    # the native loop takes bfloat16 steps over caches of the model dtype (float32's few-row
    # products take other routes than `row_gemm`)
    native = dtype == cache_dtype == torch.bfloat16
    _assert_plan_equals_the_module_path(model, shapes, cache_dtype, loop, native, monkeypatch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@SHAPES
@LOOPS
def test_plan_of_a_model_with_biases(
    tmp_path: Path,
    tiny_llama_kwargs: dict[str, int],
    dtype: torch.dtype,
    shapes: list[tuple[int, int]],
    loop: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Qwen2's q, k and v projections have biases: `row_gemm` adds them in float32 before its
    rounding."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**tiny_llama_kwargs, initializer_range=0.2)).save_pretrained(
        tmp_path
    )
    model = _model(tmp_path, dtype, None)
    assert model.cfg.attention_bias
    native = dtype == torch.bfloat16
    _assert_plan_equals_the_module_path(model, shapes, dtype, loop, native, monkeypatch)


def _plan(
    model: LlamaForCausalLM, loop: str, monkeypatch: pytest.MonkeyPatch
) -> decode_plan.DecodePlan:
    """The model's plan, built now; its Python loop only where `loop` is "python"."""
    plan = decode_plan.build(model)
    assert plan is not None, "the plan covers this model"
    if loop == "python":
        monkeypatch.setattr(plan, "_native_for", lambda rows, caches: None)
    monkeypatch.setattr(model, "_decode_plan", plan)
    monkeypatch.setattr(model, "_decode_plan_built", True)
    return plan


def _natives_given(plan: decode_plan.DecodePlan, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What the plan's `_native_for` hands its steps from now on (None: the Python loop)."""
    given: list[Any] = []
    real = plan._native_for

    def spy(rows: int, caches: list[torch.Tensor]) -> Any:
        given.append(real(rows, caches))
        return given[-1]

    monkeypatch.setattr(plan, "_native_for", spy)
    return given


def _assert_plan_equals_the_module_path(
    model: LlamaForCausalLM,
    shapes: list[tuple[int, int]],
    cache_dtype: torch.dtype,
    loop: str,
    native: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plan = _plan(model, loop, monkeypatch)
    given = _natives_given(plan, monkeypatch)
    ids, positions, caches, meta = _step(model, shapes, cache_dtype)
    assert meta.batched is not None and meta.batched.kernel
    planned_caches = [c.clone() for c in caches]
    with torch.inference_mode():
        assert plan.covers(meta, len(ids))
        want = _module_path(model, ids, positions, caches, meta)
        got = model(ids, positions, planned_caches, meta)  # takes the plan
    if loop == "native" and native:
        assert given and given[-1] is not None, "the native loop ran"
    assert torch.equal(got, want)
    for planned, cache in zip(planned_caches, caches, strict=True):
        assert torch.equal(planned.view(torch.uint8), cache.view(torch.uint8))


def test_the_first_layers_of_a_layer_skip_draft(tiny_llama_path: Path) -> None:
    """A layer-skip draft's first layers (their caches only) take the Python loop."""
    model = _model(tiny_llama_path, torch.bfloat16, "int4")
    ids, positions, caches, meta = _step(model, [(7, 1), (13, 2)], torch.bfloat16)
    with torch.inference_mode():
        x = model.embed_tokens(ids).float()
        want = model.norm(model.layers[0](model.rope(positions), x, caches[0].clone(), meta))
        got = model(ids, positions, caches[:1], meta, num_layers=1)
    assert torch.equal(got, want)


def test_the_native_loop_refuses_a_slot_out_of_range_and_writes_nothing(
    tiny_llama_path: Path,
) -> None:
    model = _model(tiny_llama_path, torch.bfloat16, "int8")
    plan = decode_plan.build(model)
    assert plan is not None
    ids, positions, caches, meta = _step(model, [(9, 1)], torch.bfloat16)
    native = plan._native_for(1, caches)
    assert native is not None and meta.batched is not None
    x = model.embed_tokens(ids).float()
    cos, sin = (t.view(1, -1) for t in model.rope(positions))
    before = [c.clone() for c in caches], x.clone()
    b = meta.batched
    slots = torch.tensor([caches[0].shape[1] * caches[0].shape[2]])  # one past the last slot
    with torch.inference_mode(), pytest.raises(RuntimeError, match="out of range"):
        native.run(x, cos, sin, slots, b.block_tables, b.context_lens, b.query_starts)
    assert torch.equal(x, before[1])
    assert all(torch.equal(c, old) for c, old in zip(caches, before[0], strict=True))


def test_steps_and_models_it_does_not_cover(tiny_llama_path: Path) -> None:
    model = _model(tiny_llama_path, torch.float32, None)
    plan = decode_plan.build(model)
    assert plan is not None
    _, _, _, prefill = _step(model, [(0, 20)], torch.float32)  # a prefill chunk
    assert not plan.covers(prefill, 20)
    _, _, _, decode = _step(model, [(9, 1)], torch.float32)
    with torch.inference_mode():
        assert plan.covers(decode, 1)
    assert not plan.covers(decode, 1), "autograd runs the module path"
    # before routes are bound (routes.bind: CPU models at load), float32 activations do not go
    # straight to the quantized kernels: no plan
    unbound = _model(tiny_llama_path, torch.float32, None)
    quantize_model(unbound, "int4")
    assert decode_plan.build(unbound) is None


def test_quantizing_a_model_drops_its_plan(tiny_llama_path: Path) -> None:
    model = _model(tiny_llama_path, torch.bfloat16, None)
    ids, positions, caches, meta = _step(model, [(9, 1)], torch.bfloat16)
    with torch.inference_mode():
        model(ids, positions, [c.clone() for c in caches], meta)  # builds the dense plan
        quantize_model(model, "int8")
        got = model(ids, positions, [c.clone() for c in caches], meta)
        want = _module_path(model, ids, positions, caches, meta)
    assert torch.equal(got, want)
