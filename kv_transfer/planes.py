"""Sender-side data planes: how one layer's KV bytes reach the receiver.

Each plane yields the `LayerChunk` control messages that go on the gRPC stream after it has
moved (or started moving) the bytes. `GrpcPlane` puts the bytes in the chunks themselves;
`PairPlane` sends the layer over a torch.distributed pair and yields a marker; `ShmPlane` writes
straight into the receiver's shared-memory blocks and yields a marker.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterator

import torch
from torch.distributed import Work

from kv_transfer.layout import as_bytes, copy_tokens, gather_tokens, slot_mapping
from kv_transfer.pairs import Pair, wait_sent
from kv_transfer.shm import SharedKVCache
from kv_transfer.state import FailureCause, TransferError
from kv_transfer.ticket import KVTicket
from tandem.v1 import kv_transfer_pb2 as pb


class DataPlane(ABC):
    kind: int  # a pb.DataPlane value

    def fill_header(self, header: pb.TransferHeader) -> None:  # noqa: B027 (optional hook)
        """Add what the receiver needs to find this plane's bytes."""

    @abstractmethod
    def send_layer(
        self, layer: int, cache: torch.Tensor, slots: torch.Tensor, deadline: float
    ) -> Iterator[pb.LayerChunk]:
        """Move the KV of `slots` in `cache` (one layer of the sender's cache) to the receiver,
        not after `deadline` (time.monotonic()) when writing into the receiver's memory.

        The sender's blocks may be released once this generator is exhausted."""

    def flush(self, timeout_s: float) -> None:  # noqa: B027 (optional hook)
        """Wait until every byte sent is delivered."""


class GrpcPlane(DataPlane):
    kind = pb.DATA_PLANE_GRPC

    def __init__(self, chunk_bytes: int = 1 << 20) -> None:
        self.chunk_bytes = chunk_bytes

    def send_layer(
        self, layer: int, cache: torch.Tensor, slots: torch.Tensor, deadline: float
    ) -> Iterator[pb.LayerChunk]:
        data = as_bytes(gather_tokens(cache, slots).cpu())  # [2, num_tokens, heads, dim]
        for offset in range(0, len(data), self.chunk_bytes):
            piece = data[offset : offset + self.chunk_bytes]
            yield pb.LayerChunk(layer=layer, offset=offset, data=piece.tobytes())


class PairPlane(DataPlane):
    kind = pb.DATA_PLANE_PAIR

    def __init__(self, pair: Pair, num_layers: int) -> None:
        self.pair = pair
        self.tag_base = pair.next_tag_base(num_layers)
        self._in_flight: list[tuple[Work, torch.Tensor]] = []  # (work, the tensor it reads)

    def fill_header(self, header: pb.TransferHeader) -> None:
        header.pair_id = self.pair.pair_id
        header.tag_base = self.tag_base

    def send_layer(
        self, layer: int, cache: torch.Tensor, slots: torch.Tensor, deadline: float
    ) -> Iterator[pb.LayerChunk]:
        tokens = gather_tokens(cache, slots)  # a copy: the blocks are free once this returns
        self._in_flight.append((self.pair.send(tokens, self.tag_base + layer), tokens))
        yield pb.LayerChunk(layer=layer)

    def flush(self, timeout_s: float) -> None:
        for work, _ in self._in_flight:
            wait_sent(work, timeout_s)
        self._in_flight.clear()


class ShmPlane(DataPlane):
    kind = pb.DATA_PLANE_SHM

    def __init__(self, target: SharedKVCache, ticket: KVTicket) -> None:
        self.target = target
        self.dst_slots = slot_mapping(
            ticket.block_ids, ticket.layout.block_size, ticket.num_tokens, torch.device("cpu")
        )

    def send_layer(
        self, layer: int, cache: torch.Tensor, slots: torch.Tensor, deadline: float
    ) -> Iterator[pb.LayerChunk]:
        # The fence: past the receiver's deadline its blocks may belong to another request.
        if time.monotonic() >= deadline:
            raise TransferError(FailureCause.TIMEOUT, "past the receiver's deadline: not writing")
        copy_tokens(cache, slots, self.target.kv_caches[layer], self.dst_slots)
        yield pb.LayerChunk(layer=layer)
