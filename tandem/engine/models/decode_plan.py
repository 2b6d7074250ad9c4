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
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, cast

import torch

from tandem.engine import layer_ops, native
from tandem.engine.attention import AttentionMetadata
from tandem.engine.kv_quant import encode

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
