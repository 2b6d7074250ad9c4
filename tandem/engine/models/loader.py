"""Checkpoint loading: a Hugging Face safetensors directory or a llama.cpp GGUF file.

Both formats come out the same way: a `ModelConfig`, float32 weights under Hugging Face parameter
names, and a `transformers` tokenizer. The model code never sees which format it came from.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import gguf
import numpy as np
import torch
from safetensors import safe_open

from tandem.gguf_header import GGUFHeader, read_header
from tandem.model_config import ModelConfig, is_gguf, load_config
from tandem.tokenizer import tokenizer_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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

_TYPES_BY_ID = {int(t): t for t in gguf.GGMLQuantizationType}
# (HF name, type, torch shape, raw uint8 [rows, bytes per row]) of a GGUF tensor
GGUFTensorData = tuple[str, gguf.GGMLQuantizationType, tuple[int, ...], np.ndarray]

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


def iter_weights(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, float32 tensor) for every weight in the checkpoint."""
    path = Path(path)
    if is_gguf(path):
        yield from _iter_gguf_weights(path)
    else:
        yield from _iter_safetensors_weights(path)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer as `transformers` has it (the router reads the same files
    without transformers: `tandem.tokenizer`). transformers is imported here, not with the
    module: the ranks of a tensor-parallel engine load weights only, and start seconds sooner."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir(path)))


# --- Hugging Face directory ---------------------------------------------------------------


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
def _cached_header(path: Path, mtime_ns: int, size: int) -> GGUFHeader:
    return read_header(path)


def _gguf_tensors(path: Path) -> list[GGUFTensorData]:
    """(HF name, type, shape, raw data) of every tensor of a GGUF file, each type checked before
    any data is read (a bad file fails before a model is half loaded). The shape is torch's
    (slowest dimension first: GGUF lists them fastest first); the data is uint8 `[rows, bytes
    per row]` of the file's memory map, in GGUF row order. The directory comes from
    `gguf_header` (`gguf.GGUFReader` would parse the vocabulary first: seconds a process), kept
    per file: load_config, iter_gguf_blocks and iter_weights read it back to back, and mtime and
    size key out stale copies when the file is replaced."""
    stat = path.stat()
    header = _cached_header(path.resolve(), stat.st_mtime_ns, stat.st_size)
    data = np.memmap(path, mode="r")
    tensors = []
    for t in header.tensors:
        qtype = _TYPES_BY_ID.get(t.type)
        if qtype not in GGUF_TENSOR_TYPES:
            raise ValueError(
                f"GGUF tensor {t.name!r} has unsupported type "
                f"{qtype.name if qtype is not None else t.type}; "
                f"supported: {sorted(t.name for t in GGUF_TENSOR_TYPES)}"
            )
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        row_bytes, rows = t.dims[0] // block * block_bytes, math.prod(t.dims[1:])
        raw = data[t.offset : t.offset + rows * row_bytes].reshape(rows, row_bytes)
        tensors.append((_hf_name(t.name), qtype, tuple(reversed(t.dims)), raw))
    return tensors


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
    config = load_config(path)
    for name, qtype, shape, raw in _gguf_tensors(path):
        yield name, _hf_rows(name, _dequantize(raw, qtype).reshape(shape), config)


def _dequantize(raw: np.ndarray, qtype: gguf.GGMLQuantizationType) -> torch.Tensor:
    """`[rows, bytes]` of `qtype` -> float32 `[rows, values]`, as `gguf.quants.dequantize`
    computes them (bit for bit: the same float32 products and sums), in torch for the block
    types of common files (NumPy's version takes seconds a model)."""
    blocks = torch.from_numpy(np.array(raw))  # copy: the memory map is read-only
    if qtype == gguf.GGMLQuantizationType.Q4_1:
        blocks = blocks.view(len(raw), -1, 20)  # fp16 scale, fp16 minimum, 32 4-bit codes
        codes = blocks[..., 4:]
        values = torch.cat([codes & 0xF, codes >> 4], dim=-1).float()
        return (_fp16(blocks[..., 0:2]) * values + _fp16(blocks[..., 2:4])).view(len(raw), -1)
    if qtype == gguf.GGMLQuantizationType.Q8_0:
        blocks = blocks.view(len(raw), -1, 34)  # fp16 scale, 32 int8 codes
        values = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (values * _fp16(blocks[..., 0:2])).view(len(raw), -1)
    array = gguf.quants.dequantize(blocks.numpy(), qtype)
    return torch.from_numpy(np.asarray(array, dtype=np.float32))


def _fp16(two_bytes: torch.Tensor) -> torch.Tensor:  # [..., 2] uint8 -> [..., 1] float32
    return two_bytes.contiguous().view(torch.float16).float()


def iter_gguf_blocks(
    path: str | Path, types: frozenset[gguf.GGMLQuantizationType]
) -> Iterator[tuple[str, gguf.GGMLQuantizationType, torch.Tensor]]:
    """Yield (HF parameter name, type, raw blocks) for the 2-D tensors of `types` in a GGUF file
    (nothing for an HF directory); the blocks are uint8 `[rows, bytes per row]` in HF row order,
    as `iter_weights` yields the same tensors dequantized."""
    path = Path(path)
    if not is_gguf(path):
        return
    config = load_config(path)
    for name, qtype, shape, raw in _gguf_tensors(path):
        if qtype in types and len(shape) == 2:
            blocks = torch.from_numpy(np.array(raw))  # copy: the memory map is read-only
            yield name, qtype, _hf_rows(name, blocks, config)


def _hf_rows(name: str, rows: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """`rows` ([out, ...]: weights or whole rows of blocks) in HF order."""
    permuted_heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}
    proj = name.split(".")[-2]
    if config.architecture == "llama" and proj in permuted_heads:
        return _unpermute_rows(rows, permuted_heads[proj])
    return rows
