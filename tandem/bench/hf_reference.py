"""The transformers side of the engine benchmarks: a plain dense `*ForCausalLM` built from a
checkpoint's config with the default (sdpa) attention and holding the same weights as the
engine, and transformers' warnings silenced while it runs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config
from transformers.utils import logging as hf_logging

from tandem.bench.common import BenchError
from tandem.model_config import load_config


def build_reference(model_path: Path, state: dict[str, torch.Tensor], dtype: torch.dtype) -> Any:
    """A dense transformers model from the checkpoint's config and HF-named float32 weights."""
    cfg = load_config(model_path)
    scaling = dict(cfg.rope_scaling or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta, **scaling}
    eos = list(cfg.eos_token_ids)
    common: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=eos or None,
        pad_token_id=eos[0] if eos else None,
        rope_parameters=rope,
    )
    hf_config: Any
    if cfg.architecture == "llama":
        hf_config = LlamaConfig(**common, attention_bias=cfg.attention_bias)
    elif cfg.architecture == "qwen2":
        hf_config = Qwen2Config(**common)
    else:
        hf_config = Qwen3Config(**common, attention_bias=cfg.attention_bias)
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
    result = model.load_state_dict(state, strict=False)
    missing = set(result.missing_keys) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    if missing or result.unexpected_keys:
        raise BenchError(
            f"reference model weights do not match: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(result.unexpected_keys)[:5]}"
        )
    return model.to(dtype).eval()


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings silenced for the duration."""
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
