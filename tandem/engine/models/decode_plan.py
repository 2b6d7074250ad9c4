"""The decoder layers of a CPU decode step as a flat list of calls, decided once per model.

A small-batch decode step on CPU runs ~15 tensor calls per layer, each a few microseconds of
kernel; around them the module path (`llama.py`) spent as much again in Python: module calls,
attribute lookups, and the checks of which route each op takes (dtype, device, rows, strides),
asked again every step of every layer. At batch 1 on int4 SmolLM2 (2 threads) that was ~4 ms of a
~15 ms step. A `DecodePlan` asks those questions once, when it is built: it binds every layer's
norm weights, its linear layers' row kernels (`row_kernel`) and the native ops, and a step whose
shape it covers (decodes and speculative verifications attended by the CPU kernel, rows within
every kernel's limit, no per-layer hook, no autograd) runs as straight calls.

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


@dataclass(frozen=True)
class LayerPlan:
    input_norm: torch.Tensor  # [hidden] float32
    qkv: RowKernel
    o: RowKernel
    post_norm: torch.Tensor
    gate_up: RowKernel
    down: RowKernel


class DecodePlan:
    """The layers of one model for the decode steps it covers (`covers`), run by `run`."""

    def __init__(
        self, model: LlamaForCausalLM, ext: ModuleType, layers: list[LayerPlan], max_rows: int
    ) -> None:
        cfg = model.cfg
        self.ext = ext
        self.layers = layers
        self.max_rows = max_rows
        self.dtype = model.embed_tokens.weight.dtype
        self.eps = cfg.rms_norm_eps
        self.head_dim = cfg.head_dim
        self.num_kv_heads = cfg.num_kv_heads
        self.split = (cfg.q_size, cfg.q_size + cfg.kv_size)
        self.scale = model.backend.scale
        # per-layer views of the KV caches, kept while the caller passes the same list
        self._caches: list[torch.Tensor] | None = None
        self._views: list[tuple[torch.Tensor, ...]] = []

    def covers(self, meta: AttentionMetadata, rows: int) -> bool:
        """Whether a step of `rows` tokens with this metadata can run here."""
        b = meta.batched
        return (
            b is not None
            and b.kernel
            and not meta.long_seqs
            and rows <= self.max_rows
            and not torch.is_grad_enabled()
        )

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
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        for layer, (kv_cache, keys, values, key_slots, value_slots) in zip(
            layers, self._cache_views(kv_caches), strict=True
        ):
            h = ext.rms_norm(x, None, layer.input_norm, eps, dtype)
            qkv = layer.qkv(h)
            q, k, v = qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:]
            ext.rotary(q, k, cos, sin, d)
            cache_dtype = kv_cache.dtype
            ext.scatter_rows(key_slots, slots, encode(k.view(n, hkv, d), cache_dtype))
            ext.scatter_rows(value_slots, slots, encode(v.view(n, hkv, d), cache_dtype))
            o = ext.paged_attention(
                q, keys, values, b.block_tables, b.context_lens, b.query_starts, d, self.scale
            )
            h = ext.rms_norm(x, layer.o(o), layer.post_norm, eps, dtype)  # x += attention
            x.add_(layer.down(ext.silu_mul(layer.gate_up(h))))
        return x

    def _cache_views(self, kv_caches: list[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
        """(cache, keys, values, key slots, value slots) per layer: [2, blocks, block, hkv,
        slot], its two halves, and those as [num_slots, hkv, slot] rows."""
        if kv_caches is not self._caches or len(self._views) != len(kv_caches):
            self._caches = kv_caches
            self._views = []
            for cache in kv_caches:
                flat = cache.view(2, -1, *cache.shape[3:])
                self._views.append((cache, cache[0], cache[1], flat[0], flat[1]))
        return self._views


def build(model: LlamaForCausalLM) -> DecodePlan | None:
    """The model's plan, or None where it does not fit one (the module path runs)."""
    cfg = model.cfg
    dtype = model.embed_tokens.weight.dtype
    if model.embed_tokens.weight.device.type != "cpu" or cfg.qk_norm:
        return None
    if dtype not in layer_ops.NATIVE_DTYPES:
        return None
    ext = native.extension()
    if ext is None:
        return None
    layers: list[LayerPlan] = []
    max_rows = 1 << 62
    for module in model.layers:
        layer = cast("DecoderLayer", module)
        attn, mlp = layer.self_attn, layer.mlp
        kernels = []
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            found = linear.row_kernel(dtype)
            if found is None:
                return None
            kernels.append(found[0])
            max_rows = min(max_rows, found[1])
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
    return DecodePlan(model, ext, layers, max_rows)
