"""KV layout conversion: paged blocks <-> the token-major wire tensor, and tensors <-> bytes.

On the wire a layer is one contiguous [2, num_tokens, heads, slot_dim] tensor in the sender's
cache dtype (a quantized cache's slots carry their scales: `tandem/engine/kv_quant.py`), so it
does not depend on either side's block size; the receiver scatters it into its own blocks
(converting the format) through a slot mapping, exactly as the model writes new KV.

Copies on CPU follow the shape of the slots. Runs of consecutive slots (blocks allocated next to
each other, the usual case in a fresh cache) move as a few slice copies at memcpy speed; a
scattered table moves as one indexed copy, by whole blocks where both sides' blocks line up
(same block size: one index per block, not per token), else by tokens.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from tandem.engine.kv_quant import copy_slots, decode, encode, select_slots


def slot_mapping(
    block_ids: list[int] | tuple[int, ...], block_size: int, num_tokens: int, device: torch.device
) -> torch.Tensor:
    """Flat cache slots of the first `num_tokens` tokens of a block table. # [num_tokens]"""
    pos = torch.arange(num_tokens, device=device)
    blocks = torch.tensor(block_ids, dtype=torch.long, device=device)
    return blocks[pos // block_size] * block_size + pos % block_size


# Slice copies up to this many runs; beyond, one indexed copy beats a Python loop of slices.
MAX_SLICE_RUNS = 64


def slot_runs(slots: torch.Tensor) -> np.ndarray:
    """Where runs of consecutive slots start, as indices into `slots`, plus len(slots) last."""
    index = slots.cpu().numpy()
    breaks = np.flatnonzero(np.diff(index) != 1) + 1
    return np.concatenate(([0], breaks, [len(index)]))


def _rows(cache: torch.Tensor) -> np.ndarray:
    """A CPU cache layer as bytes: [2, num_slots, slot_bytes]."""
    return cache.view(torch.uint8).numpy().reshape(2, cache.shape[1] * cache.shape[2], -1)


def gather_tokens(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One layer's KV of the given slots as a contiguous wire tensor.

    cache: [2, num_blocks, block_size, heads, slot_dim] -> [2, num_tokens, heads, slot_dim]"""
    if cache.device.type == "cpu":
        runs = slot_runs(slots)
        if len(runs) - 1 <= MAX_SLICE_RUNS:
            rows, index = _rows(cache), slots.numpy()
            pieces = [rows[:, index[a] : index[a] + b - a] for a, b in itertools.pairwise(runs)]
            wire = np.concatenate(pieces, axis=1) if pieces else rows[:, :0].copy()
            return torch.from_numpy(wire).view(cache.dtype).view(2, -1, *cache.shape[3:])
    flat = cache.view(2, -1, *cache.shape[3:])  # [2, num_slots, heads, slot_dim]
    return select_slots(flat, 1, slots)


def copy_tokens(
    src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    """One layer's KV from `src_slots` of `src` into `dst_slots` of `dst` (another cache of the
    same format, e.g. a decode worker's shared memory) without an intermediate wire tensor where
    the slots allow; the last block of a block-wise copy is copied whole (its tail slots belong
    to the same reservation and are not read before they are written)."""
    if src.device.type != "cpu" or dst.device.type != "cpu" or src.dtype != dst.dtype:
        scatter_tokens(dst, dst_slots, gather_tokens(src, src_slots))
        return
    s, d = src_slots.numpy(), dst_slots.numpy()
    runs = np.union1d(slot_runs(src_slots), slot_runs(dst_slots))
    src_rows, dst_rows = _rows(src), _rows(dst)
    if len(runs) - 1 <= MAX_SLICE_RUNS:
        for a, b in itertools.pairwise(runs):
            dst_rows[:, d[a] : d[a] + b - a] = src_rows[:, s[a] : s[a] + b - a]
        return
    block_size = src.shape[2]
    if dst.shape[2] == block_size:  # aligned: slot tables start at a block's first slot
        src_blocks = src.view(torch.uint8).numpy().reshape(2, src.shape[1], -1)
        dst_blocks = dst.view(torch.uint8).numpy().reshape(2, dst.shape[1], -1)
        dst_blocks[:, d[::block_size] // block_size] = src_blocks[:, s[::block_size] // block_size]
        return
    dst_rows[:, d] = src_rows[:, s]


def scatter_tokens(cache: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor) -> None:
    """Write a wire tensor [2, num_tokens, heads, slot_dim] into the given slots.

    Another dtype is converted through float32: a cast between float caches, (de)quantization
    where one side is int8/fp8; the same dtype is copied byte for byte, scales included."""
    flat = cache.view(2, -1, *cache.shape[3:])
    tokens = tokens.to(cache.device)
    if tokens.dtype != cache.dtype:
        tokens = encode(decode(tokens, torch.float32), cache.dtype)
    if cache.device.type == "cpu":
        runs = slot_runs(slots)
        if len(runs) - 1 <= MAX_SLICE_RUNS:
            rows, src, index = _rows(cache), tokens.view(torch.uint8).numpy(), slots.numpy()
            src = src.reshape(2, len(index), -1)
            for a, b in itertools.pairwise(runs):
                rows[:, index[a] : index[a] + b - a] = src[:, a:b]
            return
    copy_slots(flat, 1, slots, tokens)


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without copying (bf16 included)."""
    array = tensor.contiguous().view(torch.uint8).numpy()
    return memoryview(array.data).cast("B")


def from_bytes(
    data: bytes | bytearray | memoryview, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """A tensor over raw bytes (no copy for a writable buffer)."""
    if len(data) == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).view(shape)
