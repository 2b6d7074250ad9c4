"""Translations between the KVTransfer messages and Python/torch values (no pickle anywhere).

The Push stream carries serialized `KVChunk`s that gRPC hands over as bytes, untouched, so that a
layer's KV bytes are copied once on each side: `layer_message` joins the pieces of the sender's
cache straight into the message (the protobuf runtime would copy them twice more), and
`parse_chunk` gives the receiver the data as a view of the received message. The bytes are a
valid `KVChunk` either way; any other encoding of one parses too, through the protobuf runtime.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from google.protobuf.message import DecodeError

from kv_transfer.layout import as_bytes, from_bytes
from tandem.engine.dtypes import TORCH_DTYPES
from tandem.v1 import kv_transfer_pb2 as pb

SERVICE = "tandem.v1.KVTransfer"
PUSH_METHOD = f"/{SERVICE}/Push"

_LAYER_KEY = b"\x12"  # KVChunk.layer: field 2, length-delimited
_DATA_KEY = b"\x1a"  # LayerChunk.data: field 3, length-delimited


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while shift < 64:
        byte = view[pos]  # IndexError when truncated
        value |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return value, pos
        shift += 7
    raise ValueError("varint longer than 10 bytes")


def layer_message(
    layer: int, offset: int = 0, pieces: Sequence[memoryview] = (), num_layers: int = 0
) -> bytes:
    """A serialized KVChunk{layer: LayerChunk{layer, offset, num_layers, data}} whose `data` is
    `pieces` (flat byte views) joined, in one copy."""
    size = sum(len(p) for p in pieces)
    head = pb.LayerChunk(layer=layer, offset=offset, num_layers=num_layers).SerializeToString()
    if size:
        head += _DATA_KEY + _varint(size)
    return b"".join([_LAYER_KEY, _varint(len(head) + size), head, *pieces])


def _data_span(view: memoryview, pos: int, end: int) -> tuple[int, int, int] | None:
    """(key start, data start, data end) of the one `data` field in the LayerChunk encoded in
    view[pos:end]; None when there is none, or more than one, or the fields do not add up."""
    found = None
    while pos < end:
        field_start = pos
        key, pos = _read_varint(view, pos)
        wire_type = key & 7
        if wire_type == 0:
            _, pos = _read_varint(view, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            n, pos = _read_varint(view, pos)
            if key >> 3 == 3:
                if found is not None:
                    return None
                found = (field_start, pos, pos + n)
            pos += n
        else:
            return None
    return found if pos == end else None


def parse_chunk(message: bytes) -> tuple[pb.KVChunk, memoryview]:
    """A Push message as its KVChunk and, for a layer chunk, its `data` as a view of `message`
    (the returned chunk's own `data` is then empty). Raises ValueError when malformed."""
    view = memoryview(message)
    try:
        if view[:1] == _LAYER_KEY:
            length, start = _read_varint(view, 1)
            span = _data_span(view, start, len(view)) if start + length == len(view) else None
            if span is not None:
                key, a, b = span
                rest = bytes(view[start:key]) + bytes(view[b:])
                return pb.KVChunk(layer=pb.LayerChunk.FromString(rest)), view[a:b]
        chunk = pb.KVChunk.FromString(message)
    except (DecodeError, IndexError, ValueError) as e:
        raise ValueError(f"malformed KVChunk: {e}") from e
    data = chunk.layer.data if chunk.WhichOneof("part") == "layer" else b""
    return chunk, memoryview(data)


# dtypes of the trailer's `extras` (a proposer's state: float hidden states, integer positions)
TENSOR_DTYPES = TORCH_DTYPES | {"int64": torch.int64, "int32": torch.int32}
_TENSOR_DTYPE_NAMES = {v: k for k, v in TENSOR_DTYPES.items()}


def tensor_to_proto(name: str, tensor: torch.Tensor) -> pb.NamedTensor:
    if tensor.dtype not in _TENSOR_DTYPE_NAMES:
        raise ValueError(f"tensor {name!r}: dtype {tensor.dtype} is not one of {TENSOR_DTYPES}")
    cpu = tensor.detach().to("cpu").contiguous()
    return pb.NamedTensor(
        name=name,
        dtype=_TENSOR_DTYPE_NAMES[cpu.dtype],
        shape=list(cpu.shape),
        data=bytes(as_bytes(cpu)),
    )


def tensor_from_proto(msg: pb.NamedTensor) -> torch.Tensor:
    if msg.dtype not in TENSOR_DTYPES:
        raise ValueError(f"tensor {msg.name!r}: unknown dtype {msg.dtype!r}")
    return from_bytes(bytearray(msg.data), TENSOR_DTYPES[msg.dtype], tuple(msg.shape))
