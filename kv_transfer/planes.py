"""Sender-side data planes: how a run of layers' KV bytes reaches the receiver.

Each plane moves (or starts moving) the bytes of the consecutive layers it is handed and yields
the serialized `KVChunk` messages that go on the Push stream (gRPC, or the receiver's host-local
socket: `local_control`). `GrpcPlane` puts the bytes in the
messages themselves; `PairPlane` sends each layer over a torch.distributed pair and yields a
marker after each group of sends; `ShmPlane` writes straight into the receiver's shared cache
(shared memory, or GPU memory opened by CUDA IPC; a stream of a per-rank transfer writes its
heads of one decode rank's cache) and yields one marker. Handing over every layer
that is ready at once (all of them when the prefill did not stream layer by layer) keeps the
control stream at a few messages per transfer.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.distributed import Work

from kv_transfer.layout import gather_tokens, plan_layer_copy, row_nbytes, slot_mapping, wire_pieces
from kv_transfer.pairs import WINDOW_BYTES, Pair, wait_done
from kv_transfer.state import FailureCause, TransferError
from kv_transfer.ticket import KVTicket
from kv_transfer.wire import layer_message
from tandem.engine.tp.kv_view import KVLayer
from tandem.v1 import kv_transfer_pb2 as pb


class DataPlane(ABC):
    kind: int  # a pb.DataPlane value

    def fill_header(self, header: pb.TransferHeader) -> None:  # noqa: B027 (optional hook)
        """Add what the receiver needs to find this plane's bytes."""

    @abstractmethod
    def send_layers(
        self, layers: range, kv_caches: Sequence[KVLayer], slots: torch.Tensor, deadline: float
    ) -> Iterator[bytes]:
        """Move the KV of `slots` in `kv_caches[l]` (the sender's cache) for each l in `layers`
        to the receiver, not after `deadline` (time.monotonic()) when writing into the
        receiver's memory; yields the stream's messages (`wire.layer_message`).

        The caller holds the source blocks while the generator runs, and may release them once
        it is exhausted."""

    def flush(self, timeout_s: float) -> None:  # noqa: B027 (optional hook)
        """Wait until every byte sent is delivered."""


class GrpcPlane(DataPlane):
    kind = pb.DATA_PLANE_GRPC

    def __init__(self, chunk_bytes: int = 4 << 20) -> None:
        self.chunk_bytes = chunk_bytes

    def send_layers(
        self, layers: range, kv_caches: Sequence[KVLayer], slots: torch.Tensor, deadline: float
    ) -> Iterator[bytes]:
        row = row_nbytes(kv_caches[0])
        chunk = max(1, self.chunk_bytes // row) * row  # whole rows: the receiver writes in place
        layer_bytes = 2 * len(slots) * row
        pieces: list[memoryview] = []
        size = sent = 0  # bytes in `pieces`; bytes of `layers` before them
        for layer in layers:
            for piece in wire_pieces(kv_caches[layer], slots):
                while len(piece):
                    take = min(len(piece), chunk - size)
                    pieces.append(piece[:take])
                    piece, size = piece[take:], size + take
                    if size == chunk:
                        first, offset = divmod(sent, layer_bytes)
                        yield layer_message(layers.start + first, offset, pieces)
                        pieces, size, sent = [], 0, sent + size
        if pieces:
            first, offset = divmod(sent, layer_bytes)
            yield layer_message(layers.start + first, offset, pieces)


class PairPlane(DataPlane):
    kind = pb.DATA_PLANE_PAIR

    def __init__(self, pair: Pair, num_layers: int) -> None:
        self.pair = pair
        self.tag_base = pair.next_tag_base(num_layers)
        self._in_flight: deque[tuple[Work, torch.Tensor]] = deque()  # (work, the tensor it reads)
        self._free: list[torch.Tensor] = []  # staging tensors whose sends are done

    def fill_header(self, header: pb.TransferHeader) -> None:
        header.pair_id = self.pair.pair_id
        header.tag_base = self.tag_base

    def send_layers(
        self, layers: range, kv_caches: Sequence[KVLayer], slots: torch.Tensor, deadline: float
    ) -> Iterator[bytes]:
        # A marker follows the sends it announces (the receiver waits on those recvs only, and
        # Gloo moves no bytes before they are posted), after 1, 2, 4, ... layers up to
        # WINDOW_BYTES: the receiver takes a group while the next one is gathered. The staging
        # tensors stay within two windows: a group reuses those of announced sends once they are
        # done (fresh memory costs a page fault per 4 KB, and a transfer's worth of it is a
        # prompt's whole KV).
        layer_bytes = 2 * len(slots) * row_nbytes(kv_caches[0])
        most = max(1, WINDOW_BYTES // max(layer_bytes, 1))
        start, size = layers.start, 1
        while start < layers.stop:
            group = range(start, min(start + size, layers.stop))
            while self._in_flight and len(self._in_flight) + len(group) > 2 * most:
                work, tokens = self._in_flight.popleft()
                wait_done(work, deadline - time.monotonic())
                self._free.append(tokens)
            for layer in group:
                staging = self._free.pop() if self._free else None
                tokens = gather_tokens(kv_caches[layer], slots, out=staging)  # blocks free after
                self._in_flight.append((self.pair.send(tokens, self.tag_base + layer), tokens))
            yield layer_message(group.start, num_layers=len(group))
            start, size = group.stop, min(2 * size, most)

    def flush(self, timeout_s: float) -> None:
        for work, _ in self._in_flight:
            wait_done(work, timeout_s)
        self._in_flight.clear()
        self._free.clear()


class ShmPlane(DataPlane):
    kind = pb.DATA_PLANE_SHM

    def __init__(self, targets: Sequence[KVLayer], ticket: KVTicket) -> None:
        """`targets`: the receiver's cache layers as the sender opened them, or the stream's
        heads of them (`KVSender._shared_targets`)."""
        self.targets = targets
        device = targets[0].device
        self.dst_slots = slot_mapping(
            ticket.block_ids, ticket.layout.block_size, ticket.num_tokens, device
        )
        self._copy: Callable[[range, float], bool] | None = None

    def send_layers(
        self, layers: range, kv_caches: Sequence[KVLayer], slots: torch.Tensor, deadline: float
    ) -> Iterator[bytes]:
        if self._copy is None:  # the same slots for every layer: planned once
            self._copy = plan_layer_copy(kv_caches, slots, self.targets, self.dst_slots)
        # The fence: past the receiver's deadline its blocks may belong to another request, so
        # no layer starts then (each lands before the marker, and before the next one starts).
        if not self._copy(layers, deadline):
            raise TransferError(FailureCause.TIMEOUT, "past the receiver's deadline: not writing")
        yield layer_message(layers.start, num_layers=len(layers))
