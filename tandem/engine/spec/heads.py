"""Checkpoint directories of draft heads (Medusa, EAGLE): what both methods share.

Our format is a directory with `model.safetensors` and a `config.json` that names the `method`,
the `hidden_size` and `vocab_size` the heads were trained for, the method's own shape fields, and
the base model (`base_model`, its catalogue name or path, and `base_model_fingerprint`). Heads for
another hidden size or vocabulary are refused; heads trained on another model of the same shape
load with a warning (their drafts are still verified exactly; only acceptance suffers). The public
layouts each method also reads are described in `medusa.py` and `eagle.py`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from tandem.engine.models.llama import LlamaForCausalLM
from tandem.model_config import SUPPORTED_ARCHITECTURES, ModelConfig

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def model_fingerprint(model: LlamaForCausalLM) -> str:
    """A short hash of the model's shape and of its first embedding rows rounded to bfloat16 (so
    that float32 and bfloat16 loads of one checkpoint agree)."""
    cfg = model.cfg
    digest = hashlib.blake2b(digest_size=8)
    digest.update(json.dumps([cfg.vocab_size, cfg.hidden_size, cfg.num_layers]).encode())
    rows = model.embed_tokens.weight[:64].detach().to("cpu", torch.bfloat16)
    digest.update(rows.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()


def read_config(path: Path) -> dict[str, Any]:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"speculative heads at {path}: no {CONFIG_FILE}")
    config: dict[str, Any] = json.loads(file.read_text())
    return config


def check_fits(
    path: Path, method: str, hidden_size: int, vocab_size: int, target: ModelConfig
) -> None:
    """Refuse heads whose hidden size or vocabulary differs from the target's."""
    for field, theirs, ours in (
        ("hidden_size", hidden_size, target.hidden_size),
        ("vocab_size", vocab_size, target.vocab_size),
    ):
        if theirs != ours:
            raise ValueError(
                f"{method} heads at {path} have {field}={theirs}; "
                f"the target model has {field}={ours}"
            )


def warn_if_other_model(path: Path, config: dict[str, Any], model: LlamaForCausalLM) -> None:
    recorded = config.get("base_model_fingerprint")
    if recorded is not None and recorded != model_fingerprint(model):
        log.warning(
            "speculative heads at %s were trained for another model (%s); "
            "drafts stay exact but acceptance will be low",
            path,
            config.get("base_model", "unknown"),
        )


def save_heads(out: Path, tensors: dict[str, Tensor], config: dict[str, Any]) -> None:
    """Write `model.safetensors` (float tensors as given, on CPU) and `config.json`."""
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()},
        str(out / WEIGHTS_FILE),
    )
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def base_model_fields(name: str, model: LlamaForCausalLM) -> dict[str, str]:
    """The config.json fields naming the model heads were trained for."""
    return {"base_model": name, "base_model_fingerprint": model_fingerprint(model)}


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """A Hugging Face config.json for `cfg` (what `load_config` reads back)."""
    architecture = next(k for k, v in SUPPORTED_ARCHITECTURES.items() if v == cfg.architecture)
    eos = cfg.eos_token_ids
    return {
        "architectures": [architecture],
        "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else list(eos),
    }


def hf_tensors(module: nn.Module, cfg: ModelConfig, prefix: str = "") -> dict[str, Tensor]:
    """`module`'s parameters under Hugging Face names: q/k/v and gate/up split again (the
    inverse of `fused_target`), `prefix` before every name but `lm_head.weight`."""
    splits = {
        "qkv_proj": (("q_proj", "k_proj", "v_proj"), [cfg.q_size, cfg.kv_size, cfg.kv_size]),
        "gate_up_proj": (("gate_proj", "up_proj"), [cfg.intermediate_size] * 2),
    }
    out: dict[str, Tensor] = {}
    for name, param in module.named_parameters():
        tensor = param.detach()
        owner, proj, kind = name.rsplit(".", 2) if name.count(".") >= 2 else ("", "", name)
        if proj in splits:
            parts, sizes = splits[proj]
            for part, chunk in zip(parts, tensor.split(sizes), strict=True):
                out[f"{prefix}{owner}.{part}.{kind}"] = chunk.clone()  # unshared for safetensors
        elif name == "lm_head.weight":
            out[name] = tensor
        else:
            out[prefix + name] = tensor
    return out
