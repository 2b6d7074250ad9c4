"""Llama-family models and their loaders (HF safetensors directories and GGUF files).

The loaders (and the GGUF reader they need) are imported by `load_model` only: a model built in
code (the GPU check, `tandem/bench/gpu.py`) needs neither.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from tandem.engine import routes
from tandem.engine.attention import AttentionBackend
from tandem.engine.models.llama import LlamaForCausalLM
from tandem.engine.tp.group import TPGroup
from tandem.model_config import ModelConfig, load_config

__all__ = ["LlamaForCausalLM", "ModelConfig", "load_model"]

# What torch's layers call to draw their initial parameters (nn.Linear, nn.Embedding).
_INITIALIZERS = frozenset(
    {
        torch.nn.init.kaiming_uniform_,
        torch.nn.init.uniform_,
        torch.nn.init.normal_,
        torch.Tensor.uniform_,
        torch.Tensor.normal_,
    }
)


class _NoRandomInit(TorchFunctionMode):
    """Layers built in this mode keep their parameters as allocated, undrawn: the checkpoint
    then sets every one (`load_weights` fails on any it lacks), and drawing random values first
    took a third of a SmolLM2 load. A mode, not a patch of `torch.nn.init`: it holds in this
    thread only (workers load side by side in threads)."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        if func in _INITIALIZERS:
            return args[0] if args else (kwargs or {})["tensor"]
        return func(*args, **(kwargs or {}))


def load_model(
    path: Path,
    backend_cls: type[AttentionBackend],
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
    quant_group_size: int = 32,
    kernel_routes: str = "auto",
    tp: TPGroup | None = None,
) -> LlamaForCausalLM:
    """The model in `dtype` on `device`; `quantization` ("int8" | "int4") then quantizes the
    decoder layers' linear layers (tandem/engine/quant/); on CPU its products take the routes
    `kernel_routes` says (tandem/engine/routes.py). With `tp`, this rank's shard of it
    (tandem/engine/tp/shard.py), loaded without holding the whole model."""
    from tandem.engine.models.loader import iter_weights
    from tandem.engine.quant.model import gguf_direct_weights, quantize_model
    from tandem.engine.tp.shard import Shard  # imports quant, which imports this package

    cfg = load_config(path)
    shard = None if tp is None else Shard(cfg, tp.rank, tp.size)
    local = cfg if shard is None else shard.config
    backend = backend_cls(local.num_heads, local.num_kv_heads, local.head_dim, block_size)
    with _NoRandomInit():
        model = LlamaForCausalLM(local, backend, dtype, device, tp)
    direct = {}
    if quantization is not None:
        direct = gguf_direct_weights(path, quantization, quant_group_size)
    if shard is not None:
        shard.load(model, iter_weights(path), quantization, quant_group_size, direct)
    else:
        model.load_weights(iter_weights(path))
        if quantization is not None:
            quantize_model(model, quantization, quant_group_size, direct)
    if device.type == "cpu":
        routes.bind(model.routed_products(), kernel_routes, exact=dtype == torch.bfloat16)
    return model.eval()
