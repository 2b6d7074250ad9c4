"""KV layout conversion: paged blocks <-> the token-major wire tensor, and tensors <-> bytes.

On the wire a layer is one contiguous [2, num_tokens, heads, slot_dim] tensor in the sender's
cache dtype (a quantized cache's slots carry their scales: `tandem/engine/kv_quant.py`), so it
does not depend on either side's block size; the receiver scatters it into its own blocks
(converting the format) through a slot mapping, exactly as the model writes new KV.
"""

from __future__ import annotations

import torch

from tandem.engine.kv_quant import copy_slots, decode, encode, select_slots


def slot_mapping(
    block_ids: list[int] | tuple[int, ...], block_size: int, num_tokens: int, device: torch.device
) -> torch.Tensor:
    """Flat cache slots of the first `num_tokens` tokens of a block table. # [num_tokens]"""
    pos = torch.arange(num_tokens, device=device)
    blocks = torch.tensor(block_ids, dtype=torch.long, device=device)
    return blocks[pos // block_size] * block_size + pos % block_size


def gather_tokens(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One layer's KV of the given slots as a contiguous wire tensor.

    cache: [2, num_blocks, block_size, heads, slot_dim] -> [2, num_tokens, heads, slot_dim]"""
    flat = cache.view(2, -1, *cache.shape[3:])  # [2, num_slots, heads, slot_dim]
    return select_slots(flat, 1, slots)


def scatter_tokens(cache: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor) -> None:
    """Write a wire tensor [2, num_tokens, heads, slot_dim] into the given slots.

    Another dtype is converted through float32: a cast between float caches, (de)quantization
    where one side is int8/fp8; the same dtype is copied byte for byte, scales included."""
    flat = cache.view(2, -1, *cache.shape[3:])
    tokens = tokens.to(cache.device)
    if tokens.dtype != cache.dtype:
        tokens = encode(decode(tokens, torch.float32), cache.dtype)
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
