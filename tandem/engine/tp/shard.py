"""Which part of each weight a tensor-parallel rank keeps, and which configurations can split.

Rank r of t keeps (h attention heads, k KV heads, i intermediate channels, V vocabulary):
- q_proj's rows (and bias) of heads [r h/t, (r+1) h/t), and those columns of o_proj;
- k_proj's and v_proj's rows of KV heads [r k/t, (r+1) k/t) when t <= k; when t > k, KV head
  r // (t/k): the one its query heads read, replicated on t/k ranks;
- gate_proj's and up_proj's rows [r i/t, (r+1) i/t), and those columns of down_proj;
- embed_tokens' and lm_head's rows [r ceil(V/t), (r+1) ceil(V/t)), the last padded with zeros;
- the norms whole.
With weight quantization every decoder linear weight is quantized whole, then split the same way
(`Shard.quantized`), so each rank's codes and scales are those of the single-device model: int8's
one scale per output row stays whole under a column split, and int4's groups must not straddle
one (`check_tensor_parallel` refuses such a group size before any rank starts).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace

import torch

from tandem.engine.models.llama import LlamaForCausalLM
from tandem.engine.quant.int4 import Int4Weight, layer_group_size
from tandem.engine.quant.int8 import Int8Weight
from tandem.engine.quant.model import QuantWeight, quantize_model, quantize_weight
from tandem.model_config import ModelConfig

_LAYER = re.compile(r"model\.layers\.\d+\.(?:self_attn|mlp)\.(\w+)_proj\.(weight|bias)")
_VOCAB = frozenset({"model.embed_tokens.weight", "lm_head.weight"})


def check_tensor_parallel(
    cfg: ModelConfig, size: int, quantization: str | None = None, group_size: int = 32
) -> None:
    """Raise ValueError naming what keeps the model of `cfg` from splitting over `size` ranks."""
    tp = f"tensor_parallel_size={size}"
    if cfg.num_heads % size:
        raise ValueError(f"{tp} does not divide the model's num_attention_heads={cfg.num_heads}")
    kv = cfg.num_kv_heads
    if kv % size if size <= kv else size % kv:
        raise ValueError(
            f"{tp} and the model's num_key_value_heads={kv}: one must be a multiple of the other"
        )
    if cfg.intermediate_size % size:
        raise ValueError(
            f"{tp} does not divide the model's intermediate_size={cfg.intermediate_size}"
        )
    if quantization != "int4":
        return
    for proj, in_features in (("o_proj", cfg.q_size), ("down_proj", cfg.intermediate_size)):
        group = layer_group_size(in_features, group_size)
        local = in_features // size
        if local % group or layer_group_size(local, group_size) != group:
            raise ValueError(
                f"quant_group_size={group_size}: {proj}'s int4 groups of {group} input channels "
                f"straddle its {tp} split into {local} channels; choose a group size that "
                f"divides {local}"
            )


@dataclass(frozen=True)
class Shard:
    """Rank `rank`'s part of the model of `cfg` (the whole model's) split over `size` ranks."""

    cfg: ModelConfig
    rank: int
    size: int

    def __post_init__(self) -> None:
        check_tensor_parallel(self.cfg, self.size)

    @property
    def config(self) -> ModelConfig:
        """The model this rank runs: its heads and intermediate channels; `vocab_size` stays the
        whole vocabulary's (rank 0 gathers the logits whole)."""
        c, t = self.cfg, self.size
        return replace(
            c,
            num_heads=c.num_heads // t,
            num_kv_heads=max(c.num_kv_heads // t, 1),
            intermediate_size=c.intermediate_size // t,
        )

    @property
    def vocab_rows(self) -> int:
        """Rows of this rank's embedding and LM head."""
        return -(-self.cfg.vocab_size // self.size)

    @functools.cached_property
    def spans(self) -> dict[str, tuple[int, int, int]]:
        """Projection ("q", ..., "down") -> (dim, start, end): the part of its weight kept here."""
        c, r, t = self.cfg, self.rank, self.size
        q = c.num_heads // t * c.head_dim
        kv_heads = max(c.num_kv_heads // t, 1)
        first_kv = r * kv_heads if t <= c.num_kv_heads else r // (t // c.num_kv_heads)
        kv = (0, first_kv * c.head_dim, (first_kv + kv_heads) * c.head_dim)
        i = c.intermediate_size // t
        return {
            "q": (0, r * q, (r + 1) * q),
            "k": kv,
            "v": kv,
            "o": (1, r * q, (r + 1) * q),
            "gate": (0, r * i, (r + 1) * i),
            "up": (0, r * i, (r + 1) * i),
            "down": (1, r * i, (r + 1) * i),
        }

    def weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the checkpoint tensor `name` (HF naming)."""
        if name in _VOCAB:
            rows = self.vocab_rows
            part = tensor[self.rank * rows : (self.rank + 1) * rows]
            return torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
        m = _LAYER.fullmatch(name)
        if m is None:
            return tensor  # a norm
        dim, start, end = self.spans[m.group(1)]
        if dim >= tensor.dim():
            raise ValueError(f"{name}: a bias of a layer split by input cannot be split")
        return tensor.narrow(dim, start, end - start)

    def quantized(self, name: str, weight: QuantWeight) -> QuantWeight:
        """This rank's part of the whole quantized weight of the checkpoint tensor `name`."""
        m = _LAYER.fullmatch(name)
        if m is None:
            raise ValueError(f"{name!r} is not a decoder layer's projection")
        dim, start, end = self.spans[m.group(1)]
        if dim == 0:
            fields = [weight.qweight, weight.scales]
            if isinstance(weight, Int4Weight):
                fields.append(weight.zeros)
            return type(weight)(*(f[start:end].clone() for f in fields))
        if isinstance(weight, Int8Weight):
            return Int8Weight(weight.qweight[:, start:end].clone(), weight.scales.clone())
        group = weight.group_size  # a multiple of start and end (check_tensor_parallel)
        return Int4Weight(
            weight.qweight[:, start // 2 : end // 2].clone(),
            weight.scales[:, start // group : end // group].clone(),
            weight.zeros[:, start // group : end // group].clone(),
        )

    def load(
        self,
        model: LlamaForCausalLM,
        weights: Iterable[tuple[str, torch.Tensor]],
        quantization: str | None,
        group_size: int,
        direct: Mapping[str, QuantWeight],
    ) -> None:
        """Load this rank's part of the checkpoint `weights` into `model` (built of `config`);
        with `quantization`, each decoder linear weight is quantized whole (or taken from
        `direct`, the whole model's weights that map from GGUF blocks), then split."""
        dtype = model.embed_tokens.weight.dtype
        parts = {name: self.quantized(name, w) for name, w in direct.items()}

        def local() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                m = _LAYER.fullmatch(name)
                quantized = m is not None and m.group(2) == "weight" and name not in direct
                if quantization is not None and quantized:
                    whole = quantize_weight(tensor.to(dtype), quantization, group_size)
                    parts[name] = self.quantized(name, whole)
                yield name, self.weight(name, tensor)

        model.load_weights(local())
        if quantization is not None:
            quantize_model(model, quantization, group_size, parts)
