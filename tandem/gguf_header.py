"""The metadata and tensor directory of a GGUF file, read without its arrays or tensor data.

`gguf.GGUFReader` parses every metadata array element into its own NumPy array: for a model's
vocabulary that takes seconds and over 100 MB, in every process that loads the model. A model's
architecture needs only scalar fields, the length of the vocabulary and which tensors exist, and
its loader only where each tensor lies, so this reader steps over array elements and records
each tensor's dimensions, type and place (GGUF v2 and v3, little-endian:
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# Scalar value types: struct format by GGUF type id.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}


_DEFAULT_ALIGNMENT = 32  # of the tensor data, unless `general.alignment` says otherwise


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    dims: tuple[int, ...]  # fastest-varying first (ggml `ne`), as the file lists them
    type: int  # ggml type id (`gguf.GGMLQuantizationType`)
    offset: int  # of its data in the file


@dataclass(frozen=True)
class GGUFHeader:
    fields: dict[str, Any]  # scalar and string metadata values
    array_lengths: dict[str, int]  # metadata arrays: their element counts
    tensors: tuple[GGUFTensor, ...]  # in file order

    @property
    def tensor_names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tensors)


class _Cursor:
    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.pos = data, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("Q")
        self.pos += length
        return bytes(self.data[self.pos - length : self.pos]).decode("utf-8")

    def skip_string(self) -> None:
        length = self.unpack("Q")  # read before `pos +=` loads pos
        self.pos += length

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self.unpack(_SCALARS[kind])

    def skip_array(self) -> int:
        kind, count = self.unpack("I"), self.unpack("Q")
        if kind == _STRING:
            for _ in range(count):
                self.skip_string()
        elif kind == _ARRAY:
            for _ in range(count):
                self.skip_array()
        elif kind in _SCALARS:
            self.pos += count * struct.calcsize(_SCALARS[kind])
        else:
            raise ValueError(f"unknown GGUF array element type {kind}")
        return int(count)


def read_header(path: Path) -> GGUFHeader:
    """ValueError if `path` is not a GGUF v2/v3 file."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        cursor = _Cursor(data)
        if bytes(data[:4]) != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        cursor.pos = 4
        version = cursor.unpack("I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2, 3)")
        num_tensors, num_fields = cursor.unpack("Q"), cursor.unpack("Q")
        fields: dict[str, Any] = {}
        array_lengths: dict[str, int] = {}
        for _ in range(num_fields):
            key, kind = cursor.string(), cursor.unpack("I")
            if kind == _ARRAY:
                array_lengths[key] = cursor.skip_array()
            else:
                fields[key] = cursor.value(kind)
        entries = []
        for _ in range(num_tensors):
            name, num_dims = cursor.string(), cursor.unpack("I")
            dims = tuple(cursor.unpack("Q") for _ in range(num_dims))
            entries.append((name, dims, cursor.unpack("I"), cursor.unpack("Q")))
        alignment = int(fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-cursor.pos // alignment) * alignment  # the tensor data, after padding
        tensors = tuple(GGUFTensor(n, d, t, start + offset) for n, d, t, offset in entries)
        return GGUFHeader(fields, array_lengths, tensors)
