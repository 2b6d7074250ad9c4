"""KV layout conversion: paged blocks <-> the token-major wire tensor, and tensors <-> bytes.

On the wire a layer is one contiguous [2, num_tokens, heads, slot_dim] tensor in the sender's
cache dtype (a quantized cache's slots carry their scales: `tandem/engine/kv_quant.py`), so it
does not depend on either side's block size; the receiver scatters it into its own blocks
(converting the format) through a slot mapping, exactly as the model writes new KV. Seen as
bytes, a layer is `2 * num_tokens` rows of `heads * slot_dim` elements: the K rows of its tokens,
then the V rows.

Copies on CPU follow the shape of the slots, and never touch fresh memory they do not need:
- a cache is seen as rows of raw bytes, each one NumPy item (a `void` dtype of a row's size);
- indexed copies go through the native row copy (`tandem/engine/csrc/copy_rows.cpp`, built with
  the attention kernel): rows consecutive on both sides (a block's tokens) move as one memcpy,
  and writes into a KV cache (a scatter, the shared-memory copy) use non-temporal stores, so a
  copy of scattered blocks runs near a sequential memcpy (~12 against ~7 GB/s with NumPy for a
  377 MB shared-memory copy on 2 cores, measured); without the extension NumPy copies whole
  rows by memcpy (~3.5x the same copy over a uint8 axis), and runs of consecutive slots as a
  few slice copies;
- the gRPC plane sends a layer as views of the cache's own rows, one per run (`wire_pieces`), so
  the one copy is the join into the message, and the receiver writes rows from the message;
- a gather can write into a staging tensor the caller reuses (the pair plane's);
- large indexed copies run on a few threads; the layers that a shared-memory copy finds ready
  together go over them whole, a share of the layers each (`plan_layer_copy`).

A tensor-parallel worker's ranks each move their own heads (docs/kv_transfer.md): a stream's
layer is a `HeadWindow` (tandem/engine/tp/kv_view.py) when it carries some of a rank's heads; a
gather takes the rank's rows, then the window's heads of them, and a scatter writes the window's
heads of the slots in place.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType

import numpy as np
import torch

from tandem.engine import native
from tandem.engine.kv_quant import copy_slots, decode, encode, select_slots
from tandem.engine.tp.kv_view import HeadWindow, KVLayer


def slot_mapping(
    block_ids: list[int] | tuple[int, ...], block_size: int, num_tokens: int, device: torch.device
) -> torch.Tensor:
    """Flat cache slots of the first `num_tokens` tokens of a block table. # [num_tokens]"""
    pos = torch.arange(num_tokens, device=device)
    blocks = torch.tensor(block_ids, dtype=torch.long, device=device)
    return blocks[pos // block_size] * block_size + pos % block_size


# Slice copies up to this many runs; beyond, one indexed copy beats a Python loop of slices.
MAX_SLICE_RUNS = 64
# `wire_pieces` hands out a view per run when runs average at least this many rows; shorter
# runs cost more as views than as one gathered copy.
MIN_VIEW_RUN = 4
# Indexed copies of at least PARALLEL_BYTES are split over COPY_THREADS threads: NumPy lets go of
# the GIL while it copies (~1.4x on 2 cores for a shared-memory transfer, measured).
COPY_THREADS = min(4, os.cpu_count() or 1)
PARALLEL_BYTES = 1 << 20
_copiers: dict[int, ThreadPoolExecutor] = {}  # by process id: a forked child makes its own


def _copy_pool() -> ThreadPoolExecutor:
    pool = _copiers.get(os.getpid())
    if pool is None:
        pool = _copiers[os.getpid()] = ThreadPoolExecutor(COPY_THREADS, "kv-copy")
    return pool


def rows_of(cache: KVLayer, slots_per_row: int = 1) -> np.ndarray:
    """A CPU cache layer as a flat array of raw rows, each `slots_per_row` slots of K (or V)
    as one item: the K rows of every slot, then the V rows. [2 * num_slots // slots_per_row]"""
    assert isinstance(cache, torch.Tensor), "a rank's heads are gathered, not seen as rows"
    raw = cache.view(torch.uint8).numpy().reshape(2 * cache.shape[1] * cache.shape[2], -1)
    row = np.dtype((np.void, raw.shape[1] * slots_per_row))
    return raw.reshape(-1).view(row)


def row_nbytes(cache: KVLayer) -> int:
    """Bytes of one token's K (or V) over all heads: a row of the wire tensor."""
    return cache.shape[3] * cache.shape[4] * cache.element_size()


def kv_rows(slots: torch.Tensor | np.ndarray, num_slots: int) -> np.ndarray:
    """Rows (of `rows_of`) holding the K, then the V, of `slots`: the wire tensor's row order."""
    index = slots.cpu().numpy() if isinstance(slots, torch.Tensor) else slots
    return np.concatenate((index, index + num_slots))


def row_runs(index: np.ndarray) -> np.ndarray:
    """Where runs of consecutive rows start, as positions in `index`, plus len(index) last."""
    breaks = np.flatnonzero(np.diff(index) != 1) + 1
    return np.concatenate(([0], breaks, [len(index)]))


def _native() -> ModuleType | None:
    """The compiled row copy (`tandem/engine/csrc/copy_rows.cpp`), or None: NumPy copies."""
    return native.extension()


def _take(rows: np.ndarray, index: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """rows[index], contiguous (into `out` when given): by the native copy, else as slice
    copies when the index is a few runs."""
    if out is not None or _native() is not None:
        out = np.empty(len(index), rows.dtype) if out is None else out
        _indexed_copy(out, None, rows, index, stream=False)  # read again soon: keep it cached
        return out
    runs = row_runs(index)
    if len(runs) - 1 > MAX_SLICE_RUNS:
        return rows[index]
    pieces = [rows[index[a] : index[a] + b - a] for a, b in itertools.pairwise(runs)]
    return np.concatenate(pieces) if pieces else rows[:0].copy()


def _indexed_copy(
    dst: np.ndarray,
    dst_index: np.ndarray | None,
    src: np.ndarray,
    src_index: np.ndarray | None = None,
    stream: bool = True,
) -> None:
    """dst[dst_index] = src[src_index] over whole rows (an index of None: the rows in order),
    over threads when it is large; by the native copy (runs of rows at once) where it is built,
    which writes a destination that is not read again soon (`stream`: a KV cache, not a wire
    tensor about to be sent) by non-temporal stores."""
    ext = _native()
    index = dst_index if dst_index is not None else src_index
    assert index is not None, "dst_index, src_index: one at least"
    n = len(index)
    nbytes = n * dst.dtype.itemsize

    def part(at: slice) -> None:
        to = None if dst_index is None else dst_index[at]
        fro = None if src_index is None else src_index[at]
        if ext is not None:
            d, s = dst if to is not None else dst[at], src if fro is not None else src[at]
            ext.copy_rows(d, to, s, fro, dst.dtype.itemsize, stream)
        else:
            dst[at if to is None else to] = src[at if fro is None else fro]

    if COPY_THREADS == 1 or nbytes < PARALLEL_BYTES:
        part(slice(0, n))
        return
    bounds = [n * i // COPY_THREADS for i in range(COPY_THREADS + 1)]
    list(_copy_pool().map(part, [slice(a, b) for a, b in itertools.pairwise(bounds)]))


def _put(rows: np.ndarray, index: np.ndarray, src: np.ndarray) -> None:
    """rows[index] = src: by the native copy, else as slice copies when the index is a few
    runs."""
    if _native() is None:
        runs = row_runs(index)
        if len(runs) - 1 <= MAX_SLICE_RUNS:
            for a, b in itertools.pairwise(runs):
                rows[index[a] : index[a] + b - a] = src[a:b]
            return
    _indexed_copy(rows, index, src)


def gather_tokens(
    cache: KVLayer, slots: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """One layer's KV of the given slots as a contiguous wire tensor (written into `out`, a
    contiguous tensor of the cache's device, dtype and that shape, when given).

    cache: [2, num_blocks, block_size, heads, slot_dim] -> [2, num_tokens, heads, slot_dim]"""
    if isinstance(cache, HeadWindow):  # the rank's rows, then the window's heads of them
        heads = gather_tokens(cache.cache, slots)[:, :, cache.first : cache.first + cache.count]
        return out.copy_(heads) if out is not None else heads.contiguous()
    if cache.device.type == "cpu":
        rows = rows_of(cache)
        target = None if out is None else out.view(torch.uint8).numpy().reshape(-1).view(rows.dtype)
        wire = _take(rows, kv_rows(slots, cache.shape[1] * cache.shape[2]), target)
        if out is not None:
            return out
        return torch.from_numpy(wire.view(np.uint8)).view(cache.dtype).view(2, -1, *cache.shape[3:])
    flat = cache.view(2, -1, *cache.shape[3:])  # [2, num_slots, heads, slot_dim]
    if out is None:
        return select_slots(flat, 1, slots)
    torch.index_select(flat.view(torch.uint8), 1, slots, out=out.view(torch.uint8))
    return out


def wire_pieces(cache: KVLayer, slots: torch.Tensor) -> list[memoryview]:
    """One layer's wire tensor as flat byte pieces in order (K rows, then V rows).

    On CPU, where runs of consecutive slots are long enough, the pieces are views of the cache
    itself, one per run: valid only while the blocks are held. Otherwise one gathered copy."""
    if isinstance(cache, torch.Tensor) and cache.device.type == "cpu":
        index = kv_rows(slots, cache.shape[1] * cache.shape[2])
        runs = row_runs(index)
        if (len(runs) - 1) * MIN_VIEW_RUN <= len(index):
            rows = rows_of(cache)
            return [
                rows[index[a] : index[a] + b - a].view(np.uint8).data
                for a, b in itertools.pairwise(runs)
            ]
    return [as_bytes(gather_tokens(cache, slots).cpu())]


def plan_copy(
    src: KVLayer, src_slots: torch.Tensor, dst: KVLayer, dst_slots: torch.Tensor
) -> Callable[[KVLayer, KVLayer], None]:
    """A copy of the KV of `src_slots` into `dst_slots` between two caches shaped as `src` and
    `dst` (one layer each; e.g. the prefill cache and a decode worker's shared memory), planned
    once for every layer of a transfer: call it with each (source layer, destination layer).

    It needs no wire tensor. The native copy moves the runs of rows that are consecutive on
    both sides at once; NumPy copies a few runs as slices, else whole blocks where the block
    sizes match (the last block copied whole: its tail slots belong to the same reservation and
    are not read before they are written), else token rows."""
    if not _same_cpu_format(src, dst):
        return lambda s_layer, d_layer: scatter_tokens(
            d_layer, dst_slots, gather_tokens(s_layer, src_slots)
        )
    s = kv_rows(src_slots, src.shape[1] * src.shape[2])
    d = kv_rows(dst_slots, dst.shape[1] * dst.shape[2])
    if _native() is None:
        runs = np.union1d(row_runs(s), row_runs(d))
        if len(runs) - 1 <= MAX_SLICE_RUNS:
            slices = [(s[a], d[a], b - a) for a, b in itertools.pairwise(runs)]

            def copy_slices(s_layer: KVLayer, d_layer: KVLayer) -> None:
                src_rows, dst_rows = rows_of(s_layer), rows_of(d_layer)
                for at, to, n in slices:
                    dst_rows[to : to + n] = src_rows[at : at + n]

            return copy_slices
        block_size = src.shape[2]
        if dst.shape[2] == block_size:  # slot tables start at a block's first slot
            sb = kv_rows(src_slots[::block_size] // block_size, src.shape[1])
            db = kv_rows(dst_slots[::block_size] // block_size, dst.shape[1])
            return lambda s_layer, d_layer: _indexed_copy(
                rows_of(d_layer, block_size), db, rows_of(s_layer, block_size), sb
            )
    return lambda s_layer, d_layer: _indexed_copy(rows_of(d_layer), d, rows_of(s_layer), s)


def plan_layer_copy(
    src: Sequence[KVLayer],
    src_slots: torch.Tensor,
    dst: Sequence[KVLayer],
    dst_slots: torch.Tensor,
) -> Callable[[range, float], bool]:
    """`plan_copy` for runs of layers of two caches (lists of layers): call it with each run of
    layers ready and a time (`time.monotonic()`) from which no layer may start; it returns False
    when it stopped there.

    With the native copy on the CPU, a run of layers is split over the copy threads, whole layers
    each: one hand-off per run, where a layer at a time over all the threads pays one per layer
    (a shared-memory transfer of SmolLM2's 30 layers: 3.5 -> 1.8 ms at 512 tokens, 16 -> 6.5 ms
    at 2k, 34 -> 25 ms at 8k, measured on 2 cores). Elsewhere layer by layer, a CUDA copy landed
    before the next layer starts."""
    copy = plan_copy(src[0], src_slots, dst[0], dst_slots)
    devices = [src[0].device, dst[0].device]
    cpu = all(device.type == "cpu" for device in devices)

    def layer_by_layer(layers: range, until: float) -> bool:
        for layer in layers:
            if time.monotonic() >= until:
                return False
            copy(src[layer], dst[layer])
            if not cpu:
                wait_for_copy(*devices)
        return True

    ext = _native()
    if ext is None or not _same_cpu_format(src[0], dst[0]) or COPY_THREADS == 1:
        return layer_by_layer
    s = kv_rows(src_slots, src[0].shape[1] * src[0].shape[2])
    d = kv_rows(dst_slots, dst[0].shape[1] * dst[0].shape[2])
    layer_nbytes = len(s) * row_nbytes(src[0])

    def share(layers: range, until: float) -> bool:
        for layer in layers:
            if time.monotonic() >= until:
                return False
            to, fro = rows_of(dst[layer]), rows_of(src[layer])
            ext.copy_rows(to, d, fro, s, to.dtype.itemsize, True)
        return True

    def over_threads(layers: range, until: float) -> bool:
        if len(layers) == 1 or len(layers) * layer_nbytes < PARALLEL_BYTES:
            return layer_by_layer(layers, until)  # one layer: over the threads by rows
        n = min(COPY_THREADS, len(layers))
        shares = [layers[len(layers) * i // n : len(layers) * (i + 1) // n] for i in range(n)]
        return all(list(_copy_pool().map(share, shares, itertools.repeat(until))))

    return over_threads


def _same_cpu_format(a: KVLayer, b: KVLayer) -> bool:
    """Two single CPU tensors of one dtype: rows copy between them as they are."""
    tensors = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    return tensors and a.device.type == b.device.type == "cpu" and a.dtype == b.dtype


def wait_for_copy(*devices: torch.device) -> None:
    """Until the work queued so far on each CUDA device's current stream has run (not what is
    queued after it: an event, not a stream synchronize)."""
    for device in set(devices):
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            event.synchronize()


def scatter_tokens(cache: KVLayer, slots: torch.Tensor, tokens: torch.Tensor) -> None:
    """Write a wire tensor [2, num_tokens, heads, slot_dim] into the given slots.

    Another dtype is converted through float32: a cast between float caches, (de)quantization
    where one side is int8/fp8; the same dtype is copied byte for byte, scales included."""
    tokens = tokens.to(cache.device)
    if tokens.dtype != cache.dtype:
        tokens = encode(decode(tokens, torch.float32), cache.dtype)
    if isinstance(cache, HeadWindow):  # the window's heads of the slots, in place
        whole = cache.cache
        flat = whole.view(2, -1, *whole.shape[3:])[:, :, cache.first : cache.first + cache.count]
        copy_slots(flat, 1, slots, tokens)
        return
    if cache.device.type == "cpu":
        scatter_rows(cache, slots, 0, as_bytes(tokens))
        return
    copy_slots(cache.view(2, -1, *cache.shape[3:]), 1, slots, tokens)


def scatter_rows(cache: KVLayer, slots: torch.Tensor, first_row: int, data: memoryview) -> None:
    """Write whole wire rows, from row `first_row` of a layer's wire tensor on (row r <
    num_tokens is the K of token r, row num_tokens + r its V), into the slots of a CPU cache of
    the same format."""
    rows = rows_of(cache)
    src = np.frombuffer(data, dtype=rows.dtype)
    index = kv_rows(slots, cache.shape[1] * cache.shape[2])[first_row : first_row + len(src)]
    _put(rows, index, src)


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
