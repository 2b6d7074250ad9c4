"""Quantize a loaded model: the decoder layers' linear layers become `Int8Linear` / `Int4Linear`,
and the LM head gains an int8 copy.

Every `Linear` inside `model.layers` (qkv_proj, o_proj, gate_up_proj, down_proj) is quantized
from its float weight; weights that map exactly from the checkpoint (GGUF Q4_0 / Q4_1 blocks for
int4 with groups of 32, `gguf_blocks.py`) then overwrite the rows they cover, which is per
projection: a fused qkv_proj can take q and k from blocks and v from the float weight.

The LM head gets an int8 copy for the logits of few-row steps (`lm_head.py`), whatever the method.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from tandem.config import QUANT_METHODS
from tandem.engine.models.linear import Linear
from tandem.engine.models.llama import LlamaForCausalLM, fused_target
from tandem.engine.quant.int4 import Int4Linear, Int4Weight, layer_group_size, quantize_int4
from tandem.engine.quant.int8 import Int8Linear, Int8Weight, quantize_int8
from tandem.engine.quant.lm_head import quantize_lm_head
from tandem.engine.tp.group import TPGroup

QuantWeight = Int4Weight | Int8Weight


def gguf_direct_weights(path: Path, method: str, group_size: int) -> dict[str, QuantWeight]:
    """HF name -> weight for the decoder-layer tensors of a GGUF file that map into `method`
    without the float model (none for an HF directory)."""
    from tandem.engine.models.loader import iter_gguf_blocks  # the GGUF reader: loads only
    from tandem.engine.quant.gguf_blocks import direct_types, map_blocks

    blocks = iter_gguf_blocks(path, direct_types(method, group_size))
    return dict(map_blocks(b for b in blocks if b[0].startswith("model.layers.")))


def quantize_model(
    model: LlamaForCausalLM,
    method: str,
    group_size: int = 32,
    direct: Mapping[str, QuantWeight] | None = None,
) -> None:
    """Swap the linear layers of `model.layers` for quantized ones and give the LM head an int8
    copy, in place.

    `group_size` (int4) is halved for a layer whose input size it does not divide. `direct` maps
    HF parameter names (as the loader yields them) to weights that replace the quantized rows of
    that projection."""
    if method not in QUANT_METHODS:
        raise ValueError(f"quantization must be one of {list(QUANT_METHODS)}, got {method!r}")
    parts: dict[str, list[tuple[int, QuantWeight]]] = {}
    for name, weight in (direct or {}).items():
        target, offset = fused_target(name, model.cfg)
        if target is None or not target.endswith(".weight"):
            raise ValueError(f"direct weight {name!r} is not a linear layer's weight")
        parts.setdefault(target.removesuffix(".weight"), []).append((offset or 0, weight))
    for parent_name, parent in list(model.layers.named_modules(prefix="layers")):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, Linear):
                name = f"{parent_name}.{child_name}"
                part = parts.pop(name, [])
                quantized = quantize_linear(child, method, group_size, part, child.tp)
                setattr(parent, child_name, quantized)
    if parts:
        raise ValueError(f"direct weights for layers that are not quantized: {sorted(parts)[:4]}")
    output = model.embed_tokens if model.lm_head is None else model.lm_head
    model.quantized_lm_head = quantize_lm_head(output.weight)
    model.drop_decode_plan()


def quantize_linear(
    linear: nn.Linear,
    method: str,
    group_size: int,
    parts: list[tuple[int, QuantWeight]],
    tp: TPGroup | None = None,
) -> Int8Linear | Int4Linear:
    """`linear` quantized from its weight, then `parts` ((row offset, weight)) copied over; parts
    that cover every row make the weight without quantizing it. `tp`: a row-parallel layer's
    group."""
    weight = linear.weight.detach()  # [out, in]
    bias = None if linear.bias is None else linear.bias.detach()
    quantized = joined_rows(parts, weight.shape[0])
    if quantized is None or not same_layout(quantized, method, group_size, weight.shape[1]):
        quantized = quantize_weight(weight, method, group_size)
        for offset, part in parts:
            replace_rows(quantized, offset, part)
    if isinstance(quantized, Int8Weight):
        return Int8Linear(quantized, bias, weight.dtype, weight.device, tp=tp)
    return Int4Linear(quantized, bias, weight.dtype, weight.device, tp=tp)


def quantize_weight(weight: torch.Tensor, method: str, group_size: int) -> QuantWeight:
    """`weight` ([out, in]) in `method`; int4's `group_size` halved where it does not divide in."""
    if method == "int8":
        return quantize_int8(weight)
    return quantize_int4(weight, layer_group_size(weight.shape[1], group_size))


def joined_rows(parts: list[tuple[int, QuantWeight]], rows: int) -> QuantWeight | None:
    """The weight that `parts` ((row offset, weight)) make up where they cover rows 0..`rows`
    one after another, all of one format; else None."""
    parts = sorted(parts, key=lambda part: part[0])
    kinds = {type(part) for _, part in parts}
    end = 0
    for offset, part in parts:
        if offset != end:
            return None
        end += len(part.qweight)
    if end != rows or len(kinds) != 1:
        return None
    (kind,) = kinds
    fields = dataclasses.fields(kind)
    return kind(*(torch.cat([getattr(p, f.name) for _, p in parts]) for f in fields))


def same_layout(weight: QuantWeight, method: str, group_size: int, in_features: int) -> bool:
    """Whether `weight` is what `quantize_weight` makes of `in_features` columns: its format, and
    for int4 its group size."""
    if method == "int8":
        return isinstance(weight, Int8Weight) and weight.qweight.shape[1] == in_features
    return (
        isinstance(weight, Int4Weight)
        and 2 * weight.qweight.shape[1] == in_features
        and weight.group_size == layer_group_size(in_features, group_size)
    )


def replace_rows(base: QuantWeight, offset: int, part: QuantWeight) -> None:
    """Copy `part`'s rows over `base`'s from row `offset` on (same format and group size)."""
    if type(part) is not type(base):
        raise ValueError(f"cannot put {type(part).__name__} rows into an {type(base).__name__}")
    pairs = [(getattr(base, f.name), getattr(part, f.name)) for f in dataclasses.fields(base)]
    for (dst, src), field in zip(pairs, dataclasses.fields(base), strict=True):
        if dst[offset : offset + len(src)].shape != src.shape:
            raise ValueError(
                f"cannot put {field.name} of shape {tuple(src.shape)} at row {offset} of "
                f"{field.name} of shape {tuple(dst.shape)}"
            )
    for dst, src in pairs:
        dst[offset : offset + len(src)].copy_(src)
