"""llama.cpp's Q4_0 / Q4_1 / Q8_0 blocks mapped into our int4 / int8 weights.

A block holds 32 consecutive weights of a row:
- Q4_0, 18 bytes: fp16 d, then 16 bytes of codes; w = (q - 8) * d.
- Q4_1, 20 bytes: fp16 d, fp16 m, then 16 bytes of codes; w = q * d + m.
- Q8_0, 34 bytes: fp16 d, then 32 int8 codes; w = q * d.
In the 4-bit blocks, byte i holds weight i in its low nibble and weight i + 16 in its high one.

Q4_0 and Q4_1 are int4 with groups of 32 as they stand: the codes are kept and (scale, zero) =
(d, 0) or (d, m + 8 d), so `(q - 8) * scale + zero` gives back llama.cpp's values up to the
rounding of scale and zero to bfloat16 (8 significant bits), the dtype the kernels take. Q8_0 has a
scale per 32 weights and our int8 one per row, so its rows are requantized from the block values
(exact float32 products); the codes stay the same only where every block of a row has the same
scale and reaches +-127. No other pairing maps exactly: those weights are quantized from the float
model like any other checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from gguf import GGMLQuantizationType

from tandem.engine.quant.int4 import Int4Weight, pack_codes
from tandem.engine.quant.int8 import Int8Weight, quantize_int8

BLOCK_SIZE = 32
_BLOCK_BYTES = {
    GGMLQuantizationType.Q4_0: 18,
    GGMLQuantizationType.Q4_1: 20,
    GGMLQuantizationType.Q8_0: 34,
}


def direct_types(method: str, group_size: int) -> frozenset[GGMLQuantizationType]:
    """The GGUF tensor types that map into `method` (with `group_size`) without the float model."""
    if method == "int8":
        return frozenset({GGMLQuantizationType.Q8_0})
    if group_size == BLOCK_SIZE:
        return frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1})
    return frozenset()


def map_blocks(
    tensors: Iterable[tuple[str, GGMLQuantizationType, torch.Tensor]],
) -> Iterator[tuple[str, Int4Weight | Int8Weight]]:
    """(name, type, raw blocks [rows, bytes]) -> (name, weight); types from `direct_types`."""
    for name, qtype, raw in tensors:
        if qtype == GGMLQuantizationType.Q8_0:
            yield name, q8_0_to_int8(raw)
        else:
            yield name, q4_to_int4(qtype, raw)


def _split(qtype: GGMLQuantizationType, raw: torch.Tensor) -> torch.Tensor:
    """[rows, bytes] -> [rows, blocks, bytes per block]."""
    return raw.view(raw.shape[0], -1, _BLOCK_BYTES[qtype])


def _fp16(two_bytes: torch.Tensor) -> torch.Tensor:  # [..., 2] uint8 -> [...] float32
    return two_bytes.contiguous().view(torch.float16).squeeze(-1).float()


def q4_to_int4(qtype: GGMLQuantizationType, raw: torch.Tensor) -> Int4Weight:
    """Q4_0 / Q4_1 blocks -> int4 with groups of 32, codes unchanged."""
    blocks = _split(qtype, raw)  # [rows, n_blocks, block bytes]
    d = _fp16(blocks[..., 0:2])  # [rows, n_blocks]
    if qtype == GGMLQuantizationType.Q4_1:
        zeros = _fp16(blocks[..., 2:4]) + 8 * d
        packed = blocks[..., 4:]  # [rows, n_blocks, 16]
    elif qtype == GGMLQuantizationType.Q4_0:
        zeros = torch.zeros_like(d)
        packed = blocks[..., 2:]
    else:
        raise ValueError(f"{qtype.name} is not a 4-bit block type")
    codes = torch.cat([packed & 0xF, packed >> 4], dim=-1)  # [rows, n_blocks, 32] in order
    return Int4Weight(pack_codes(codes.view(raw.shape[0], -1)), d, zeros)


def q8_0_to_int8(raw: torch.Tensor) -> Int8Weight:
    """Q8_0 blocks -> int8 with one scale per row, requantized from the blocks' values."""
    blocks = _split(GGMLQuantizationType.Q8_0, raw)  # [rows, n_blocks, 34]
    d = _fp16(blocks[..., 0:2])  # [rows, n_blocks]
    codes = blocks[..., 2:].contiguous().view(torch.int8).float()  # [rows, n_blocks, 32]
    return quantize_int8((codes * d[..., None]).view(raw.shape[0], -1))
