"""Receiver-side data planes: what the decode worker does with each layer message of a stream.

One sink per transfer, the counterpart of the sender's plane (`kv_transfer.planes`):
- `GrpcSink` takes the stream's bytes in order, as rows of the wire tensors of consecutive
  layers, and writes whole rows straight from the received message into the reserved blocks
  when the caches share a format (CPU), else gathers each layer and converts it;
- `PairSink` receives the layers a marker announces from the torch.distributed pair, several
  recvs in flight into reused staging buffers (also while the next marker is read), each
  scattered once it landed;
- `ShmSink` has nothing to move: the sender wrote the layers into our shared cache itself.

Layers arrive in order; a sink refuses anything else (a repeat, a gap, bytes past the end) as
bad metadata. Writes go through the reservation's lock, and stop once it is no longer writable.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import torch

from kv_transfer.layout import from_bytes, scatter_rows, scatter_tokens
from kv_transfer.pairs import WINDOW_BYTES, Pair, wait_done
from kv_transfer.state import FailureCause, TransferError
from kv_transfer.ticket import KVLayout
from tandem.engine.tp.kv_view import KVLayer
from tandem.v1 import kv_transfer_pb2 as pb


class Blocks(Protocol):
    """Where a transfer writes: a reservation's slots, under its lock, while writable."""

    slots: torch.Tensor
    lock: threading.Lock
    writable: bool


def _bad(message: str) -> TransferError:
    return TransferError(FailureCause.BAD_METADATA, message)


class LayerSink(ABC):
    def __init__(
        self, kv_caches: Sequence[KVLayer], blocks: Blocks, layout: KVLayout, num_tokens: int
    ) -> None:
        self.kv_caches = kv_caches
        self.blocks = blocks
        self.layout = layout  # the sender's: its dtype is the wire's
        self.num_tokens = num_tokens
        self.layers_done = 0  # layers [0, layers_done) are in the blocks
        self.announced = 0  # layers [0, announced) were announced by pair/shm markers

    @property
    def wire_shape(self) -> tuple[int, int, int, int]:
        return (2, self.num_tokens, self.layout.num_kv_heads, self.layout.slot_dim)

    @abstractmethod
    def add(self, msg: pb.LayerChunk, data: memoryview, deadline: float) -> None:
        """Handle one layer message (`data`: its bytes, read in place) by `deadline`
        (time.monotonic()); raises TransferError."""

    def drain(self, deadline: float) -> None:  # noqa: B027 (optional hook)
        """Finish the layers announced so far (before the trailer is taken)."""

    def _announced(self, msg: pb.LayerChunk, data: memoryview) -> range:
        """The layers a pair/shm marker announces, checked to follow the ones announced."""
        layers = range(msg.layer, msg.layer + max(msg.num_layers, 1))
        if len(data) or msg.offset:
            raise _bad("a marker carries no data")
        if layers.start != self.announced or layers.stop > len(self.kv_caches):
            raise _bad(f"layers {layers.start}..{layers.stop - 1} after {self.announced}")
        self.announced = layers.stop
        return layers

    def _write_tokens(self, layer: int, tokens: torch.Tensor) -> None:
        with self.blocks.lock:
            if self.blocks.writable:
                scatter_tokens(self.kv_caches[layer], self.blocks.slots, tokens)


class GrpcSink(LayerSink):
    def __init__(
        self, kv_caches: Sequence[KVLayer], blocks: Blocks, layout: KVLayout, num_tokens: int
    ) -> None:
        super().__init__(kv_caches, blocks, layout, num_tokens)
        cache = kv_caches[0]
        self.row = layout.layer_nbytes(1) // 2  # bytes of one row: one token's K or V
        self.rows_per_layer = 2 * num_tokens
        self.received = 0  # bytes of the stream so far
        self.tail = b""  # bytes of an incomplete row (a sender that split rows)
        # Same format on a CPU cache: rows go from the message into the blocks.
        self.in_place = (
            isinstance(cache, torch.Tensor)
            and cache.device.type == "cpu"
            and cache.dtype == layout.torch_dtype
        )
        self.staging: bytearray | None = None  # one layer's wire bytes otherwise

    def add(self, msg: pb.LayerChunk, data: memoryview, deadline: float) -> None:
        at = msg.layer * self.rows_per_layer * self.row + msg.offset
        if at != self.received:
            raise _bad(f"bytes at {at} of the stream, expected {self.received}")
        total = len(self.kv_caches) * self.rows_per_layer * self.row
        if self.received + len(data) > total:
            raise _bad(f"{self.received + len(data)} bytes of KV, the layers hold {total}")
        first_row = (self.received - len(self.tail)) // self.row
        self.received += len(data)
        if self.tail:
            data = memoryview(self.tail + data)
        whole = len(data) // self.row * self.row
        data, self.tail = data[:whole], bytes(data[whole:])
        while len(data):
            layer, row = divmod(first_row, self.rows_per_layer)
            take = min(len(data) // self.row, self.rows_per_layer - row)
            self._put(layer, row, data[: take * self.row])
            data, first_row = data[take * self.row :], first_row + take

    def _put(self, layer: int, row: int, data: memoryview) -> None:
        """Whole rows [row, row + len(data) // self.row) of layer `layer`'s wire tensor."""
        end = row + len(data) // self.row
        if self.in_place:
            with self.blocks.lock:
                if self.blocks.writable:
                    scatter_rows(self.kv_caches[layer], self.blocks.slots, row, data)
        else:
            if self.staging is None:
                self.staging = bytearray(self.rows_per_layer * self.row)
            self.staging[row * self.row : end * self.row] = data
            if end == self.rows_per_layer:
                wire = from_bytes(self.staging, self.layout.torch_dtype, self.wire_shape)
                self._write_tokens(layer, wire)
        if end == self.rows_per_layer:
            self.layers_done = layer + 1


class PairSink(LayerSink):
    def __init__(
        self,
        kv_caches: Sequence[KVLayer],
        blocks: Blocks,
        layout: KVLayout,
        num_tokens: int,
        pair: Pair,
        tag_base: int,
    ) -> None:
        super().__init__(kv_caches, blocks, layout, num_tokens)
        self.pair = pair
        self.tag_base = tag_base
        self.window = max(2, WINDOW_BYTES // max(layout.layer_nbytes(num_tokens), 1))
        self.free: list[torch.Tensor] = []  # staging buffers, [2, num_tokens, heads, slot_dim]
        self.posted: deque[tuple[int, torch.distributed.Work, torch.Tensor]] = deque()

    def add(self, msg: pb.LayerChunk, data: memoryview, deadline: float) -> None:
        """Post the recvs of the announced layers (their sends are posted), with up to
        WINDOW_BYTES of recvs in flight (two at least), and write the layers that landed; the
        reader goes on to the next marker while the rest lands."""
        for layer in self._announced(msg, data):
            while len(self.posted) >= self.window:
                self._land(deadline)
            buf = self.free.pop() if self.free else self._staging()
            self.posted.append((layer, self.pair.post_recv(buf, self.tag_base + layer), buf))
        while self.posted and self.posted[0][1].is_completed():
            self._land(deadline)

    def drain(self, deadline: float) -> None:
        while self.posted:
            self._land(deadline)

    def _land(self, deadline: float) -> None:
        """Wait for the oldest recv and write its layer into the blocks."""
        layer, work, buf = self.posted.popleft()
        wait_done(work, deadline - time.monotonic())
        self._write_tokens(layer, buf)
        self.free.append(buf)
        self.layers_done = layer + 1

    def _staging(self) -> torch.Tensor:
        cache = self.kv_caches[0]
        return torch.empty(self.wire_shape, dtype=self.layout.torch_dtype, device=cache.device)


class ShmSink(LayerSink):
    def add(self, msg: pb.LayerChunk, data: memoryview, deadline: float) -> None:
        self.layers_done = self._announced(msg, data).stop
