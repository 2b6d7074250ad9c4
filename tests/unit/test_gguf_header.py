"""tandem.gguf_header against gguf.GGUFReader: the same scalar fields, array lengths and tensors
(names, dimensions, types and data offsets)."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from tandem.gguf_header import read_header


def test_header_matches_gguf_reader(smollm2_path: Path) -> None:
    reader = gguf.GGUFReader(smollm2_path)
    header = read_header(smollm2_path)
    arrays = {k: f for k, f in reader.fields.items() if f.types[0] == gguf.GGUFValueType.ARRAY}
    scalars = {  # GGUF.* are the reader's own: version, counts
        k: f.contents()
        for k, f in reader.fields.items()
        if k not in arrays and not k.startswith("GGUF.")
    }
    assert header.fields == scalars
    assert header.array_lengths == {k: len(f.data) for k, f in arrays.items()}
    assert header.tensor_names == {t.name for t in reader.tensors}
    assert [(t.name, t.dims, t.type, t.offset) for t in header.tensors] == [
        (t.name, tuple(map(int, t.shape)), int(t.tensor_type), int(t.data_offset))
        for t in reader.tensors
    ]


def test_a_file_of_other_bytes_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_header(path)
