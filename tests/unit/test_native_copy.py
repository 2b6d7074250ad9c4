"""The native row copy (`tandem/engine/csrc/copy_rows.cpp`) equals NumPy's indexed copies, for
any mix of indexed and in-order sides, runs of rows, streamed or not, aligned or not, and refuses
what would write or read out of bounds."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest

from tandem.engine import native


@pytest.fixture(scope="module")
def ext() -> ModuleType:
    module = native.extension()
    assert module is not None, "the native extension did not build (see the log)"
    return module


def rows(n: int, row_bytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, row_bytes), dtype=np.uint8)


# Row sizes: 768 (a float32 K row of SmolLM2), 204 (int8 slots with scales: not a multiple of
# 16), 12,288 (a whole block); streamed copies of small rows fall back to memcpy.
@pytest.mark.parametrize("row_bytes", [768, 204, 12_288, 8])
@pytest.mark.parametrize("stream", [False, True])
def test_indexed_copies_equal_numpy(ext: ModuleType, row_bytes: int, stream: bool) -> None:
    rng = np.random.default_rng(row_bytes)
    src = rows(64, row_bytes, 1)
    # runs of consecutive rows on both sides, then scattered single rows
    src_index = np.concatenate([np.arange(8, 24), rng.permutation(64)[:20]]).astype(np.int64)
    dst_index = np.concatenate([np.arange(40, 56), rng.permutation(80)[56:76]]).astype(np.int64)
    dst_index = dst_index[np.unique(dst_index, return_index=True)[1]][: len(src_index)]
    src_index = src_index[: len(dst_index)]

    dst, want = np.zeros((80, row_bytes), np.uint8), np.zeros((80, row_bytes), np.uint8)
    ext.copy_rows(dst, dst_index, src, src_index, row_bytes, stream)
    want[dst_index] = src[src_index]
    assert np.array_equal(dst, want)

    gathered = np.zeros((len(src_index), row_bytes), np.uint8)  # dst in order
    ext.copy_rows(gathered, None, src, src_index, row_bytes, stream)
    assert np.array_equal(gathered, src[src_index])

    scattered = np.zeros((80, row_bytes), np.uint8)  # src in order, read-only bytes
    ext.copy_rows(scattered, dst_index, bytes(gathered), None, row_bytes, stream)
    want = np.zeros_like(scattered)
    want[dst_index] = gathered
    assert np.array_equal(scattered, want)


def test_unaligned_buffers_copy_exactly(ext: ModuleType) -> None:
    row_bytes = 1024
    src = bytearray(rows(9, row_bytes, 2).tobytes())
    dst = bytearray(9 * row_bytes + 3)
    view = memoryview(dst)[3:]  # destination 3 bytes off any alignment
    ext.copy_rows(view, np.arange(8, dtype=np.int64), memoryview(src)[5:], None, row_bytes, True)
    assert bytes(view[: 8 * row_bytes]) == bytes(src[5 : 5 + 8 * row_bytes])


def test_out_of_bounds_and_bad_buffers_are_refused(ext: ModuleType) -> None:
    src, dst = rows(4, 16, 3), np.zeros((4, 16), np.uint8)
    with pytest.raises(IndexError, match=r"dst_rows: row 4 outside 0\.\.3"):
        ext.copy_rows(dst, np.array([0, 4]), src, np.array([0, 1]), 16)
    with pytest.raises(IndexError, match="src_rows: row -1"):
        ext.copy_rows(dst, np.array([0, 1]), src, np.array([0, -1]), 16)
    with pytest.raises(IndexError, match="src_rows: fewer rows than copied"):
        ext.copy_rows(np.zeros((8, 16), np.uint8), np.arange(8), src, None, 16)
    with pytest.raises(ValueError, match="dst: a C-contiguous writable buffer"):
        ext.copy_rows(bytes(64), np.array([0]), src, None, 16)
    with pytest.raises(ValueError, match="src: a C-contiguous buffer"):
        ext.copy_rows(dst, np.array([0]), src[:, ::2], None, 8)
    with pytest.raises(ValueError, match="of one length"):
        ext.copy_rows(dst, np.array([0, 1]), src, np.array([0]), 16)
    assert not dst.any()  # nothing was written by a refused copy
