"""Llama-family models and their loaders (HF safetensors directories and GGUF files).

The loaders (and the GGUF reader they need) are imported by `load_model` only: a model built in
code (the GPU check, `tandem/bench/gpu.py`) needs neither.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.engine import routes
from tandem.engine.attention import AttentionBackend
from tandem.engine.models.llama import LlamaForCausalLM
from tandem.model_config import ModelConfig, load_config

__all__ = ["LlamaForCausalLM", "ModelConfig", "load_model"]


def load_model(
    path: Path,
    backend_cls: type[AttentionBackend],
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
    quant_group_size: int = 32,
    kernel_routes: str = "auto",
) -> LlamaForCausalLM:
    """The model in `dtype` on `device`; `quantization` ("int8" | "int4") then quantizes the
    decoder layers' linear layers (tandem/engine/quant/); on CPU its products take the routes
    `kernel_routes` says (tandem/engine/routes.py)."""
    from tandem.engine.models.loader import iter_weights
    from tandem.engine.quant.model import gguf_direct_weights, quantize_model

    cfg = load_config(path)
    backend = backend_cls(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, block_size)
    model = LlamaForCausalLM(cfg, backend, dtype, device)
    model.load_weights(iter_weights(path))
    if quantization is not None:
        direct = gguf_direct_weights(path, quantization, quant_group_size)
        quantize_model(model, quantization, quant_group_size, direct)
    if device.type == "cpu":
        routes.bind(model.routed_products(), kernel_routes, exact=dtype == torch.bfloat16)
    return model.eval()
