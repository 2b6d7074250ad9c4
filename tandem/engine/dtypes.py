"""The torch dtypes and devices behind the config tree's names (tandem/config.py is torch-free)."""

from __future__ import annotations

import torch

from tandem.config import DTYPES, EngineConfig, ModelSettings

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}
# Quantized KV cache formats (tandem/engine/kv_quant.py), scaled per token.
KV_TORCH_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def model_dtype(settings: ModelSettings) -> torch.dtype:
    return TORCH_DTYPES[settings.dtype]


def model_device(settings: ModelSettings) -> torch.device:
    return torch.device(settings.device)


def kv_dtype(config: EngineConfig) -> torch.dtype:
    """The KV cache tensors' dtype: the model's, or a quantized one."""
    kv = config.cache.kv_cache_dtype
    return model_dtype(config.model) if kv == "auto" else KV_TORCH_DTYPES[kv]
