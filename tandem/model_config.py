"""Architecture description of a Llama-family checkpoint, read from config.json or GGUF metadata.

Torch-free: the router reads a model's vocabulary size, context length and end tokens from here.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.gguf_header import GGUFHeader, read_header

# HF `architectures` / GGUF `general.architecture` values this engine implements.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

GGUF_ARCHITECTURES = frozenset(SUPPORTED_ARCHITECTURES.values())


@dataclass(frozen=True)
class ModelConfig:
    """What the model code needs to know; built by a loader from config.json or GGUF metadata."""

    architecture: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in set(SUPPORTED_ARCHITECTURES.values()):
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def load_config(path: str | Path) -> ModelConfig:
    """Read the architecture of an HF directory (config.json) or a .gguf file."""
    path = Path(path)
    if is_gguf(path):
        stat = path.stat()  # a replaced file has another size or mtime: read afresh
        return _cached_gguf_config(path.resolve(), stat.st_mtime_ns, stat.st_size)
    return _hf_config(path)


@functools.lru_cache(maxsize=8)  # a model load asks for it three times (model, weights, blocks)
def _cached_gguf_config(path: Path, mtime_ns: int, size: int) -> ModelConfig:
    return _gguf_config(read_header(path))


def is_gguf(path: Path) -> bool:
    return path.suffix == ".gguf"


def _hf_config(path: Path) -> ModelConfig:
    raw: dict[str, Any] = json.loads((path / "config.json").read_text())
    hf_arch = (raw.get("architectures") or ["<none>"])[0]
    if hf_arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {hf_arch!r} in {path / 'config.json'}; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    arch = SUPPORTED_ARCHITECTURES[hf_arch]
    num_heads = raw["num_attention_heads"]
    rope_theta, rope_scaling = _hf_rope(raw)
    return ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=_context_len(raw),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        # Qwen2 always has q/k/v biases and its config has no flag for them.
        attention_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
        qk_norm=arch == "qwen3",
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_token_ids(raw.get("eos_token_id")),
    )


def _context_len(raw: dict[str, Any]) -> int:
    """max_position_embeddings, capped at the sliding window where one applies (Mistral).

    The engine attends over the whole context, which equals sliding-window attention only while
    the context fits in the window.
    """
    context_len: int = raw.get("max_position_embeddings", 2048)
    window = raw.get("sliding_window")
    if window and raw.get("use_sliding_window", True):
        context_len = min(context_len, window)
    return context_len


def _hf_rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers >= 5 folds `rope_theta` and `rope_scaling` into one `rope_parameters` dict;
    # checkpoints on the Hub still mostly use the older two keys.
    params = raw.get("rope_parameters")
    if params is None:
        return raw.get("rope_theta", 10000.0), raw.get("rope_scaling")
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") == "default":
        return params.get("rope_theta", 10000.0), None
    return params.get("rope_theta", 10000.0), scaling


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


def _gguf_field(header: GGUFHeader, key: str, default: Any = None) -> Any:
    return header.fields.get(key, default)


def _gguf_arch(header: GGUFHeader) -> str:
    arch = _gguf_field(header, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    return str(arch)


def _gguf_config(header: GGUFHeader) -> ModelConfig:
    arch = _gguf_arch(header)

    def meta(key: str, default: Any = None) -> Any:
        return _gguf_field(header, f"{arch}.{key}", default)

    tensor_names = header.tensor_names
    hidden = meta("embedding_length")
    num_heads = meta("attention.head_count")
    vocab_size = meta("vocab_size")
    if vocab_size is None:
        vocab_size = header.array_lengths["tokenizer.ggml.tokens"]
    rope_scaling = None
    scaling_type = meta("rope.scaling.type")
    if scaling_type not in (None, "none"):
        rope_scaling = {"rope_type": scaling_type, "factor": meta("rope.scaling.factor")}
        original = meta("rope.scaling.original_context_length")
        if original is not None:
            rope_scaling["original_max_position_embeddings"] = original
    eos = _gguf_field(header, "tokenizer.ggml.eos_token_id")
    # Chat models stop on end-of-turn, which llama.cpp records apart from end-of-sequence.
    eot = _gguf_field(header, "tokenizer.ggml.eot_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=meta("feed_forward_length"),
        num_layers=meta("block_count"),
        num_heads=num_heads,
        num_kv_heads=meta("attention.head_count_kv", num_heads),
        head_dim=meta("attention.key_length", hidden // num_heads),
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=meta("rope.freq_base", 10000.0),
        rope_scaling=rope_scaling,
        max_position_embeddings=meta("context_length", 2048),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm=arch == "qwen3",
        bos_token_id=_gguf_field(header, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(i for i in (eos, eot) if i is not None)),
    )
