"""One Llama-family decoder: Llama 2/3, SmolLM2, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

Tokens of all requests in a step are flattened into one `[num_tokens]` batch; attention is the
only place that knows about requests (through `AttentionMetadata`). Projections are fused at load
time (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`) so a layer costs four matmuls.

Under tensor parallelism (`tp`, tandem/engine/tp/) `cfg` is the rank's own (its heads and
intermediate channels): o_proj and down_proj sum the ranks' partial products with one
all-reduce each (`Linear`, `quant/layer.py`), the embedding holds a slice of the vocabulary, and
the logits are gathered on rank 0.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine import layer_ops
from tandem.engine.attention import AttentionBackend, AttentionMetadata
from tandem.engine.models import decode_plan
from tandem.engine.models.linear import DenseProduct, Linear
from tandem.engine.models.rope import RotaryEmbedding, apply_rotary
from tandem.engine.tp.group import TPGroup
from tandem.engine.tp.layers import VocabParallelEmbedding, gather_rescored_logits
from tandem.model_config import ModelConfig

if TYPE_CHECKING:  # quant/model.py imports this module
    from tandem.engine.quant.lm_head import QuantizedLMHead
    from tandem.engine.routes import Routed


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 whatever the model dtype; returns `out_dtype`."""

    def __init__(self, size: int, eps: float, out_dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32, device=device))
        self.eps = eps
        self.out_dtype = out_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return layer_ops.rms_norm(x, self.weight, self.eps, self.out_dtype)
        y = F.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps)  # q / k norms per head
        return y.to(self.out_dtype)

    def add_forward(
        self, x: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x + delta (in place where fused) and its norm, for the float32 residual stream x."""
        return layer_ops.add_rms_norm(x, delta, self.weight, self.eps, self.out_dtype)


class Attention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv_proj = Linear(
            cfg.hidden_size,
            cfg.q_size + 2 * cfg.kv_size,
            bias=cfg.attention_bias,
            dtype=dtype,
            device=device,
        )
        self.o_proj = Linear(
            cfg.q_size, cfg.hidden_size, bias=False, dtype=dtype, device=device, tp=tp
        )
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
        self.backend = backend

    def forward(
        self,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,  # [num_tokens, hidden]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        cfg = self.cfg
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(n, cfg.num_heads, cfg.head_dim)
        k = k.view(n, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, cos_sin)
        o = self.backend.forward(q.reshape(n, -1), k.reshape(n, -1), v, kv_cache, meta)
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.gate_up_proj = Linear(
            cfg.hidden_size, 2 * cfg.intermediate_size, bias=False, dtype=dtype, device=device
        )
        self.down_proj = Linear(
            cfg.intermediate_size, cfg.hidden_size, bias=False, dtype=dtype, device=device, tp=tp
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(layer_ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(cfg, backend, dtype, device, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = MLP(cfg, dtype, device, tp)

    def forward(
        self,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,  # [num_tokens, hidden] float32 residual stream
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # x may take the attention output in place (the fused add): the caller hands it over
        attn = self.self_attn(cos_sin, self.input_layernorm(x), kv_cache, meta)
        x, h = self.post_attention_layernorm.add_forward(x, attn)
        return x + self.mlp(h)


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.backend = backend
        self.tp = tp
        self.rope = RotaryEmbedding(
            cfg.head_dim,
            cfg.max_position_embeddings,
            cfg.rope_theta,
            cfg.rope_scaling,
            dtype,
            device,
        )
        vocab_rows = cfg.vocab_size if tp is None else -(-cfg.vocab_size // tp.size)
        self.embed_tokens = (
            nn.Embedding(vocab_rows, cfg.hidden_size, dtype=dtype, device=device)
            if tp is None
            else VocabParallelEmbedding(vocab_rows, cfg.hidden_size, tp, dtype, device)
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, backend, dtype, device, tp) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = None
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(
                cfg.hidden_size, vocab_rows, bias=False, dtype=dtype, device=device
            )
        # The logits' product over the LM head's (or the tied embedding's) weight, and an int8
        # copy of it (set by quant/model.py) for the logits of steps of few rows; the float
        # weight stays for embedding lookups and larger steps.
        self.head_product = DenseProduct(self.lm_head_weight, None)
        self.quantized_lm_head: QuantizedLMHead | None = None
        # The layers of CPU decode steps as flat calls (decode_plan.py), built at the first step;
        # whatever swaps the layers' modules afterwards calls `drop_decode_plan`.
        self._decode_plan: decode_plan.DecodePlan | None = None
        self._decode_plan_built = False

    def drop_decode_plan(self) -> None:
        """Forget the decode plan (its bound kernels): the next step builds it anew."""
        self._decode_plan, self._decode_plan_built = None, False

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        after_layer: Callable[[int], None] | None = None,
        num_layers: int | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden] after the final norm, in the model dtype
        """`after_layer(i)` runs once layer i has written its KV (the prefill role streams it).
        `num_layers` runs only the first layers (a layer-skip self-draft); `kv_caches` has one
        tensor per layer run."""
        # The residual stream stays float32: SmolLM2's activations reach norms of ~1e4, where
        # bfloat16 sums lose the small components (bf16 greedy output degenerated without this).
        x = self.embed_tokens(input_ids).float()
        cos_sin = self.rope(positions)
        if not self._decode_plan_built:
            self._decode_plan, self._decode_plan_built = decode_plan.build(self), True
        plan = self._decode_plan
        if plan is not None and after_layer is None and plan.covers(meta, x.shape[0]):
            return self.norm(plan.run(x, cos_sin, kv_caches, meta, num_layers))
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            x = layer(cos_sin, x, kv_cache, meta)
            if after_layer is not None:
                after_layer(i)
        return self.norm(x)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[vocab, hidden]: the LM head's, or the tied embedding's."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab] float32
        """The logits of `hidden`'s rows; under tensor parallelism every rank calls it and only
        rank 0's are the logits (the others get their vocabulary slice's)."""
        weight = self.lm_head_weight
        head = self.quantized_lm_head
        if head is not None and hidden.shape[0] <= head.max_rows:
            if self.tp is not None:
                candidates = head.candidates(hidden, weight)
                return gather_rescored_logits(self.tp, *candidates, self.cfg.vocab_size)
            logits = head(hidden, weight)
        else:
            logits = self.head_product(hidden).float()
        if self.tp is None:
            return logits
        return self.tp.gather_columns(logits)[:, : self.cfg.vocab_size]

    def decode_weight_bytes(self, rows: int = 1) -> int:
        """Bytes of weights a decode step of `rows` rows reads: the decoder layers' linear
        layers through their routes, the norms, and the LM head the logits take (its int8 copy
        up to its rows, plus the rescored rows of the float weight)."""
        total = sum(product.read_bytes(rows) for product in self.layer_products())
        total += sum(norm.weight.nbytes for norm in self.modules() if isinstance(norm, RMSNorm))
        head = self.quantized_lm_head
        if head is not None and rows <= head.max_rows:
            return total + head.int8.read_bytes(rows) + head.rescored_bytes(rows)
        return total + self.head_product.read_bytes(rows)

    def layer_products(self) -> list[Routed]:
        """The decoder layers' linear layers, as products whose CPU kernels `routes.bind`
        chooses."""
        found: list[Routed] = []
        for module in self.layers.modules():
            if isinstance(module, Linear):
                found.append(module.product)
            elif hasattr(module, "set_routes"):  # a quantized layer (quant/layer.py)
                found.append(cast("Routed", module))
        return found

    def routed_products(self) -> list[Routed]:
        """Every product whose CPU kernels `routes.bind` chooses: the layers', the LM head and
        its int8 copy."""
        head = [] if self.quantized_lm_head is None else [self.quantized_lm_head.int8]
        return [*self.layer_products(), self.head_product, *head]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; every parameter must be set."""
        params = dict(self.named_parameters())
        missing = set(params)
        cfg = self.cfg
        for name, tensor in weights:
            target, offset = fused_target(name, cfg)
            if target is None or target not in params:
                if name == "lm_head.weight" and self.lm_head is None:
                    continue  # tied: some checkpoints store the copy anyway
                raise ValueError(f"unexpected weight {name!r} for {cfg.architecture}")
            param = params[target]
            rows = tensor.shape[0]
            dst = param[offset : offset + rows] if offset is not None else param
            if dst.shape != tensor.shape:
                raise ValueError(
                    f"{name}: shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
            missing.discard(target)
        if missing:
            raise ValueError(f"checkpoint lacks weights for: {sorted(missing)[:8]}")


_LAYER = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)_proj\.(weight|bias)")


def fused_target(name: str, cfg: ModelConfig) -> tuple[str | None, int | None]:
    """Parameter name (ours) and row offset for an HF tensor name; (None, None) if unknown."""
    m = _LAYER.fullmatch(name)
    if m is not None:
        layer, block, proj, kind = m.groups()
        prefix = f"layers.{layer}.{block}"
        offsets = {
            "q": (f"{prefix}.qkv_proj.{kind}", 0),
            "k": (f"{prefix}.qkv_proj.{kind}", cfg.q_size),
            "v": (f"{prefix}.qkv_proj.{kind}", cfg.q_size + cfg.kv_size),
            "gate": (f"{prefix}.gate_up_proj.{kind}", 0),
            "up": (f"{prefix}.gate_up_proj.{kind}", cfg.intermediate_size),
        }
        if proj in offsets:
            return offsets[proj]
        return f"{prefix}.{proj}_proj.{kind}", None
    if name.startswith("model."):
        return name.removeprefix("model."), None
    if name == "lm_head.weight" and not cfg.tie_word_embeddings:
        return name, None
    return None, None
