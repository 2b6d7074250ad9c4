"""The decoder layers of a CPU decode step as a flat list of calls, decided once per model.

A small-batch decode step on CPU runs ~15 tensor calls per layer, each a few microseconds of
kernel; around them the module path (`llama.py`) spent as much again in Python: module calls,
attribute lookups, and the checks of which route each op takes (dtype, device, rows, strides),
asked again every step of every layer. At batch 1 on int4 SmolLM2 (2 threads) that was ~4 ms of a
~15 ms step. A `DecodePlan` asks those questions once: it binds every layer's norm weights and
the native ops when it is built, and its linear layers' calls once per row count
(`row_kernel(dtype, rows)`: the route of that many rows, chosen then, not at every call), and a
step whose shape it covers (decodes and speculative verifications attended by the CPU kernel,
rows every linear layer has a direct call for, no per-layer hook, no autograd) runs as straight
calls: 8 a layer, the residual add of a layer's MLP output done by the next layer's norm, and
RoPE and the write of the new keys and values into a cache of the model dtype one call
(`rotary_store`: ~4 us a layer fewer than RoPE, two slices and two scatters apart).

It runs the module path's own kernels on the same tensors in the same order, so its hidden
states equal the module path's bit for bit (`tests/unit/test_decode_plan.py`); every other step,
and every model it does not cover (CUDA, no native extension, q/k norms, a linear layer without a
direct kernel for the model's dtype), takes the module path.

Where every linear layer's call for a row count is a native kernel of the plan's level on the
model dtype (`row_gemm`, or `quant_gemm` into bfloat16: a `RowGemmCall` or `TileCall`) and the
caches hold the model dtype, the same calls run as one call of the extension
(`csrc/decode_layers.cpp`: the kernels in the same order on the same values, bit for bit),
without the loop's ~250 Python calls and slices and the output tensor each allocated; other
routes, tensor parallelism's all-reduces, quantized caches and a layer-skip draft's first
layers keep the Python loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

import torch

from tandem.engine import layer_ops, native
from tandem.engine.attention import AttentionMetadata
from tandem.engine.kv_quant import encode
from tandem.engine.models.linear import RowGemmCall

if TYPE_CHECKING:
    from tandem.engine.models.linear import RowKernel
    from tandem.engine.models.llama import DecoderLayer, LlamaForCausalLM


# a layer's KV cache as the plan writes and reads it (`DecodePlan._cache_views`)
CacheViews = tuple[torch.dtype | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class LayerPlan:
    """One layer's calls for steps of one row count."""

    input_norm: torch.Tensor  # [hidden] float32
    qkv: RowKernel
    o: RowKernel
    post_norm: torch.Tensor
    gate_up: RowKernel
    down: RowKernel


class DecodePlan:
    """The layers of one model for the decode steps it covers (`covers`), run by `run`."""

    def __init__(self, model: LlamaForCausalLM, ext: ModuleType) -> None:
        cfg = model.cfg
        self.ext = ext
        self.modules = cast("list[DecoderLayer]", list(model.layers))
        self._by_rows: dict[int, list[LayerPlan] | None] = {}
        self.dtype = model.embed_tokens.weight.dtype
        self.eps = cfg.rms_norm_eps
        self.head_dim = cfg.head_dim
        self.num_kv_heads = cfg.num_kv_heads
        self.split = (cfg.q_size, cfg.q_size + cfg.kv_size)
        self.scale = model.backend.scale
        # per-layer views of the KV caches, kept while the caller passes the same list
        self._caches: list[torch.Tensor] | None = None
        self._views: list[CacheViews] = []
        # the layers as one native call, per row count (None: the Python loop), and the caches
        # each was last given
        self._native: dict[int, Any] = {}
        self._native_caches: list[torch.Tensor] | None = None
        self._native_raw = False  # whether those hold the model dtype

    def covers(self, meta: AttentionMetadata, rows: int) -> bool:
        """Whether a step of `rows` tokens with this metadata can run here."""
        b = meta.batched
        return (
            b is not None
            and b.kernel
            and not meta.long_seqs
            and not torch.is_grad_enabled()
            and self.layers_for(rows) is not None
        )

    def layers_for(self, rows: int) -> list[LayerPlan] | None:
        """The layers' calls for steps of `rows` rows (bound at the first such step), or None
        where a linear layer has no direct call for that many."""
        if rows not in self._by_rows:
            self._by_rows[rows] = _bind(self.modules, self.dtype, rows)
        return self._by_rows[rows]

    def run(
        self,
        x: torch.Tensor,  # [rows, hidden] float32 residual stream, updated in place
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # [rows, 1, head_dim] each
        kv_caches: list[torch.Tensor],  # one per layer run
        meta: AttentionMetadata,
        num_layers: int | None = None,  # the first layers only (a layer-skip self-draft)
    ) -> torch.Tensor:  # x after the layers
        ext, eps, dtype, d = self.ext, self.eps, self.dtype, self.head_dim
        q_end, k_end = self.split
        n = x.shape[0]
        hkv = self.num_kv_heads
        cos, sin = (t.view(n, d) for t in cos_sin)
        b = meta.batched
        assert b is not None
        slots = meta.slot_mapping
        layers = self.layers_for(n)
        assert layers is not None
        whole = num_layers in (None, len(layers)) and x.is_contiguous()
        native = self._native_for(n, kv_caches) if whole else None
        if native is not None:
            native.run(x, cos, sin, slots, b.block_tables, b.context_lens, b.query_starts)
            return x
        if num_layers is not None:
            layers = layers[:num_layers]
        mlp_out = None  # the previous layer's MLP output, added to x by this layer's norm
        for layer, (cache_dtype, keys, values, key_slots, value_slots) in zip(
            layers, self._cache_views(kv_caches), strict=True
        ):
            h = ext.rms_norm(x, mlp_out, layer.input_norm, eps, dtype)  # x += MLP output
            qkv = layer.qkv(h)
            q = qkv[:, :q_end]
            if cache_dtype is None:  # slots of the model dtype: the rows as they are
                ext.rotary_store(qkv, q_end, cos, sin, d, key_slots, value_slots, slots)
            else:
                k, v = qkv[:, q_end:k_end], qkv[:, k_end:]
                ext.rotary(q, k, cos, sin, d)
                ext.scatter_rows(key_slots, slots, encode(k.view(n, hkv, d), cache_dtype))
                ext.scatter_rows(value_slots, slots, encode(v.view(n, hkv, d), cache_dtype))
            o = ext.paged_attention(
                q, keys, values, b.block_tables, b.context_lens, b.query_starts, d, self.scale
            )
            h = ext.rms_norm(x, layer.o(o), layer.post_norm, eps, dtype)  # x += attention
            mlp_out = layer.down(ext.silu_mul(layer.gate_up(h)))
        if mlp_out is not None:
            x.add_(mlp_out)
        return x

    def _native_for(self, rows: int, kv_caches: list[torch.Tensor]) -> Any | None:
        """The extension's `DecodeLayers` over every layer for steps of `rows` rows, given
        these caches (every layer's, of the model dtype), or None where the Python loop runs
        (`_bind_native`)."""
        if len(kv_caches) != len(self.modules):
            return None
        if rows not in self._native:
            layers = self.layers_for(rows)
            self._native[rows] = None if layers is None else _bind_native(self, layers)
            self._native_caches = None  # the new one has none yet
        native = self._native[rows]
        if native is None:
            return None
        if self._native_caches is not kv_caches:  # every row count's take the new caches
            views = self._cache_views(kv_caches)
            # quantized slots: `encode` runs in Python
            self._native_raw = all(cache_dtype is None for cache_dtype, *_ in views)
            for bound in self._native.values():
                if bound is not None and self._native_raw:
                    bound.set_caches([v[1] for v in views], [v[2] for v in views])
            self._native_caches = kv_caches
        return native if self._native_raw else None

    def _cache_views(self, kv_caches: list[torch.Tensor]) -> list[CacheViews]:
        """(slot dtype, keys, values, key slots, value slots) per layer: the cache [2, blocks,
        block, hkv, slot]'s two halves, and those as rows of slots: [num_slots, hkv * slot]
        where they hold the model dtype (slot dtype None: keys and values go in as they are),
        else [num_slots, hkv, slot] (`encode` writes them)."""
        if kv_caches is not self._caches or len(self._views) != len(kv_caches):
            self._caches = kv_caches
            self._views = []
            for cache in kv_caches:
                raw = cache.dtype == self.dtype
                flat = cache.view(2, -1, *cache.shape[3:])
                if raw:
                    flat = flat.flatten(2)
                cache_dtype = None if raw else cache.dtype
                self._views.append((cache_dtype, cache[0], cache[1], flat[0], flat[1]))
        return self._views


def _bind(modules: list[DecoderLayer], dtype: torch.dtype, rows: int) -> list[LayerPlan] | None:
    """Every layer's calls for steps of `rows` rows of `dtype`, or None where one of its linear
    layers has no direct call for them."""
    layers: list[LayerPlan] = []
    for layer in modules:
        attn, mlp = layer.self_attn, layer.mlp
        kernels = []
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            found = linear.row_kernel(dtype, rows)
            if found is None:
                return None
            kernels.append(found)
        qkv, o, gate_up, down = kernels  # o and down all-reduce under tensor parallelism
        layers.append(
            LayerPlan(
                layer.input_layernorm.weight,
                qkv,
                o,
                layer.post_attention_layernorm.weight,
                gate_up,
                down,
            )
        )
    return layers


def _bind_native(plan: DecodePlan, layers: list[LayerPlan]) -> Any | None:
    """The layers as one call of the extension (`csrc/decode_layers.cpp`: the same kernels in
    the same order, so the same hidden states bit for bit), where every product is a native
    kernel of the plan's level on the model dtype (`row_gemm`, or `quant_gemm` into bfloat16);
    else None (another route, a tensor-parallel all-reduce: the Python loop runs)."""
    from tandem.engine.quant.tiles import TileCall  # the quant package imports the models

    ext = plan.ext
    norms: list[torch.Tensor] = []
    products: list[tuple[torch.Tensor, torch.Tensor | None, int]] = []
    for layer in layers:
        norms += [layer.input_norm, layer.post_norm]
        for call in (layer.qkv, layer.o, layer.gate_up, layer.down):
            if isinstance(call, RowGemmCall) and call.kernel is ext.row_gemm:
                bias = call.bias
                if call.weight.dtype != plan.dtype or not (bias is None or bias.is_contiguous()):
                    return None
                products.append((call.weight, call.bias, 0))
            elif isinstance(call, TileCall) and not call.float32_out:
                if plan.dtype != torch.bfloat16:
                    return None
                products.append((call.tiles, call.scales_zeros, call.group_size))
            else:
                return None
    num_heads = plan.split[0] // plan.head_dim
    return ext.decode_layers(
        norms,
        products,
        plan.eps,
        plan.head_dim,
        num_heads,
        plan.num_kv_heads,
        plan.scale,
        plan.dtype,
    )


def build(model: LlamaForCausalLM) -> DecodePlan | None:
    """The model's plan, or None where it does not fit one (the module path runs): a plan
    covers at least the one-row steps."""
    cfg = model.cfg
    dtype = model.embed_tokens.weight.dtype
    if model.embed_tokens.weight.device.type != "cpu" or cfg.qk_norm:
        return None
    if dtype not in layer_ops.NATIVE_DTYPES:
        return None
    ext = native.extension()
    if ext is None:
        return None
    plan = DecodePlan(model, ext)
    return plan if plan.layers_for(1) is not None else None
