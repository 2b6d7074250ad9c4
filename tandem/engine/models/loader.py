"""Checkpoint loading: a Hugging Face safetensors directory or a llama.cpp GGUF file.

Both formats come out the same way: a `ModelConfig`, float32 weights under Hugging Face parameter
names, and a `transformers` tokenizer. The model code never sees which format it came from.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors import safe_open
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tandem.config import tandem_home
from tandem.engine.models.config import SUPPORTED_ARCHITECTURES, ModelConfig

GGUF_ARCHITECTURES = frozenset(SUPPORTED_ARCHITECTURES.values())

# Types `gguf.quants.dequantize` handles that we have checked against transformers' loader.
GGUF_TENSOR_TYPES = frozenset(
    {
        gguf.GGMLQuantizationType.F32,
        gguf.GGMLQuantizationType.F16,
        gguf.GGMLQuantizationType.BF16,
        gguf.GGMLQuantizationType.Q8_0,
        gguf.GGMLQuantizationType.Q4_0,
        gguf.GGMLQuantizationType.Q4_1,
        gguf.GGMLQuantizationType.Q4_K,
        gguf.GGMLQuantizationType.Q6_K,
    }
)

_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def load_config(path: str | Path) -> ModelConfig:
    """Read the architecture of an HF directory (config.json) or a .gguf file."""
    path = Path(path)
    if _is_gguf(path):
        return _gguf_config(_gguf_reader(path))
    return _hf_config(path)


def iter_weights(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, float32 tensor) for every weight in the checkpoint."""
    path = Path(path)
    if _is_gguf(path):
        yield from _iter_gguf_weights(path)
    else:
        yield from _iter_safetensors_weights(path)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer.

    For GGUF, transformers rebuilds it from the file's metadata, which takes seconds; the result
    is saved under `$TANDEM_HOME/tokenizers`, keyed by the file's name, size and mtime, and
    loaded from there next time.
    """
    path = Path(path)
    if not _is_gguf(path):
        return AutoTokenizer.from_pretrained(str(path))
    stat = path.stat()
    cached = tandem_home() / "tokenizers" / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if cached.is_dir():
        return AutoTokenizer.from_pretrained(str(cached))
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".partial-"))
    try:
        tokenizer.save_pretrained(partial)
        with contextlib.suppress(OSError):  # another process saved it first
            partial.rename(cached)
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # gone already after the rename
    return tokenizer


def _is_gguf(path: Path) -> bool:
    return path.suffix == ".gguf"


# --- Hugging Face directory ---------------------------------------------------------------


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


def _iter_safetensors_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name).float()


# --- GGUF file ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _cached_reader(path: Path, mtime_ns: int, size: int) -> gguf.GGUFReader:
    return gguf.GGUFReader(path)


def _gguf_reader(path: Path) -> gguf.GGUFReader:
    # Parsing the metadata takes seconds (the vocabulary is read string by string) and
    # load_config + iter_weights open the same file back to back; mtime and size key out stale
    # copies when the file is replaced.
    stat = path.stat()
    return _cached_reader(path.resolve(), stat.st_mtime_ns, stat.st_size)


def _gguf_field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _gguf_arch(reader: gguf.GGUFReader) -> str:
    arch = _gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    return str(arch)


def _gguf_config(reader: gguf.GGUFReader) -> ModelConfig:
    arch = _gguf_arch(reader)

    def meta(key: str, default: Any = None) -> Any:
        return _gguf_field(reader, f"{arch}.{key}", default)

    tensor_names = {t.name for t in reader.tensors}
    hidden = meta("embedding_length")
    num_heads = meta("attention.head_count")
    vocab_size = meta("vocab_size")
    if vocab_size is None:
        vocab_size = len(reader.fields["tokenizer.ggml.tokens"].data)
    rope_scaling = None
    scaling_type = meta("rope.scaling.type")
    if scaling_type not in (None, "none"):
        rope_scaling = {"rope_type": scaling_type, "factor": meta("rope.scaling.factor")}
        original = meta("rope.scaling.original_context_length")
        if original is not None:
            rope_scaling["original_max_position_embeddings"] = original
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    # Chat models stop on end-of-turn, which llama.cpp records apart from end-of-sequence.
    eot = _gguf_field(reader, "tokenizer.ggml.eot_token_id")
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
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(i for i in (eos, eot) if i is not None)),
    )


def _hf_name(gguf_name: str) -> str:
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GGUF_GLOBAL_NAMES and kind == "weight":
        return f"{_GGUF_GLOBAL_NAMES[stem]}.weight"
    m = _GGUF_BLOCK_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _GGUF_BLOCK_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{_GGUF_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def _unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp's convert_hf_to_gguf reorders each head's rows from HF's rotate-half RoPE layout
    # to the interleaved (Meta) layout: reshape(n_head, 2, d/2, ...).swapaxes(1, 2). Undo it.
    return w.reshape(n_head, -1, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _iter_gguf_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    reader = _gguf_reader(path)
    config = _gguf_config(reader)
    # Check every tensor before yielding any, so a bad file fails before a model is half loaded.
    named = []
    for tensor in reader.tensors:
        if tensor.tensor_type not in GGUF_TENSOR_TYPES:
            raise ValueError(
                f"GGUF tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name}; "
                f"supported: {sorted(t.name for t in GGUF_TENSOR_TYPES)}"
            )
        named.append((_hf_name(tensor.name), tensor))
    for name, tensor in named:
        # GGUF lists dimensions fastest-first (ggml `ne`); torch wants them slowest-first.
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # copy: F32 data is a view into the read-only memory map.
        weight = torch.from_numpy(np.array(array, dtype=np.float32)).reshape(shape)
        yield name, _hf_rows(name, weight, config)


def iter_gguf_blocks(
    path: str | Path, types: frozenset[gguf.GGMLQuantizationType]
) -> Iterator[tuple[str, gguf.GGMLQuantizationType, torch.Tensor]]:
    """Yield (HF parameter name, type, raw blocks) for the 2-D tensors of `types` in a GGUF file
    (nothing for an HF directory); the blocks are uint8 `[rows, bytes per row]` in HF row order,
    as `iter_weights` yields the same tensors dequantized."""
    path = Path(path)
    if not _is_gguf(path):
        return
    reader = _gguf_reader(path)
    config = _gguf_config(reader)
    for tensor in reader.tensors:
        if tensor.tensor_type in types and len(tensor.shape) == 2:
            name = _hf_name(tensor.name)
            # copy: the data is a view into the read-only memory map.
            blocks = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
            yield name, tensor.tensor_type, _hf_rows(name, blocks, config)


def _hf_rows(name: str, rows: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """`rows` ([out, ...]: weights or whole rows of blocks) in HF order."""
    permuted_heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}
    proj = name.split(".")[-2]
    if config.architecture == "llama" and proj in permuted_heads:
        return _unpermute_rows(rows, permuted_heads[proj])
    return rows
