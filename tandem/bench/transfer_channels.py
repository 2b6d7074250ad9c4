"""The throughput part of `tandem bench transfer`, one side per child process: the receiver
(a `KVReceiver` over a zeroed paged cache, and the TCP reference's sink) and the sender (a
`KVSender` per channel over a seeded random cache, and the TCP and memcpy / device-copy
references on the same bytes); both check what moved with a position-weighted checksum."""

from __future__ import annotations

import math
import random
import socket
import time
from collections.abc import Sequence
from typing import Any

import torch

from kv_transfer import KVReceiver, KVSender, TransferState
from kv_transfer.layout import as_bytes, gather_tokens, slot_mapping
from kv_transfer.pairs import backend_for
from kv_transfer.shm import create_shared_cache
from kv_transfer.ticket import KVLayout, KVTicket
from tandem.bench.transfer_config import TRANSFER_TIMEOUT_S, TransferBenchConfig

_FINGERPRINT = "bench-transfer"  # the throughput part has no model; both sides agree on this


def block_order(num_blocks: int, seed: int) -> list[int]:
    """A seeded permutation of a cache's blocks: transfers read and write paged, not linear."""
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    return order


def kv_checksum(
    kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], num_tokens: int
) -> float:
    """A checksum of the first `num_tokens` tokens of a block table in every layer, weighted by
    layer, K/V and token position, so misplaced tokens or layers change it."""
    cache0 = kv_caches[0]
    slots = slot_mapping(list(block_ids), cache0.shape[2], num_tokens, cache0.device)
    weights = torch.arange(1, 2 * num_tokens + 1, dtype=torch.float64, device=cache0.device)
    total = 0.0
    for layer, cache in enumerate(kv_caches):
        per_token = gather_tokens(cache, slots).sum(dim=(2, 3), dtype=torch.float64)  # [2, n]
        total += (layer + 1) * float((per_token.reshape(-1) * weights).sum())
    return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ChannelReceiver:
    """Receiver process of the throughput part: a KVReceiver and the TCP reference's sink."""

    def __init__(
        self, config: TransferBenchConfig, device: str, layout: KVLayout, num_blocks: int, shm: bool
    ) -> None:
        self.device = torch.device(device)
        self.layout = layout
        self.shm = create_shared_cache(layout, num_blocks, self.device) if shm else None
        shape = (2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self.kv_caches = caches = (
            self.shm.kv_caches
            if self.shm is not None
            else [
                torch.zeros(shape, dtype=layout.torch_dtype, device=self.device)
                for _ in range(layout.num_layers)
            ]
        )
        shared = self.shm.locator if self.shm is not None else ""
        self.receiver = KVReceiver(caches, _FINGERPRINT, shared_cache=shared)
        self.blocks = block_order(num_blocks, config.seed + 1)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.conn: socket.socket | None = None
        self.sink = bytearray()

    def info(self) -> dict[str, Any]:
        pairs = self.receiver.pairs
        return {
            "endpoint": self.receiver.endpoint,
            "pair_store": pairs.address if pairs is not None else "",
            "tcp_port": self.listener.getsockname()[1],
        }

    def expect(self, key: str, num_tokens: int) -> KVTicket:
        """Reserve the blocks (zero: the cache starts zeroed; `checksum_and_zero` zeroes again)."""
        blocks = self.blocks[: math.ceil(num_tokens / self.layout.block_size)]
        return self.receiver.expect(key, blocks, num_tokens, timeout_s=TRANSFER_TIMEOUT_S)

    def arrived(self, key: str, timeout_s: float) -> dict[str, Any]:
        """Poll until the reservation is reported; its outcome and the received bytes' checksum."""
        deadline = time.monotonic() + timeout_s
        while True:
            arrival = next((a for a in self.receiver.poll() if a.request_key == key), None)
            if arrival is not None:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"reservation {key} not reported within {timeout_s} s")
            time.sleep(0.001)
        return {
            "state": arrival.state.name,
            "error": str(arrival.error) if arrival.error else None,
            "nbytes": arrival.nbytes,
            "data_plane": arrival.data_plane,
            "receiver_s": arrival.seconds,
        }

    def checksum_and_zero(self, num_tokens: int) -> float:
        """The received bytes' checksum; then the blocks are zeroed, so that a later transfer
        that writes nothing cannot pass. Zeroed here, not just before the next transfer: the
        shared-memory sender's stores would then find every line dirty in this process's cache
        (+1 ms at 512 tokens, measured), a handicap no memcpy reference and no engine has."""
        blocks = self.blocks[: math.ceil(num_tokens / self.layout.block_size)]
        total = kv_checksum(self.kv_caches, blocks, num_tokens)
        slots = slot_mapping(blocks, self.layout.block_size, num_tokens, self.device)
        for cache in self.kv_caches:
            cache.view(2, -1, *cache.shape[3:]).index_fill_(1, slots, 0)
        _sync(self.device)
        return total

    def tcp_accept(self) -> None:
        self.conn, _ = self.listener.accept()
        self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def tcp_recv(self, nbytes: int) -> int:
        """Receive `nbytes` into a preallocated, touched buffer; answer one byte."""
        assert self.conn is not None
        if len(self.sink) < nbytes:
            self.sink = bytearray(nbytes)  # zero-filled: its pages are touched once, here
        view = memoryview(self.sink)[:nbytes]
        got = 0
        while got < nbytes:
            n = self.conn.recv_into(view[got:])
            if n == 0:
                raise ConnectionError(f"the sender closed after {got} of {nbytes} bytes")
            got += n
        self.conn.sendall(b"k")
        return got

    def close(self) -> None:
        self.receiver.close()
        if self.conn is not None:
            self.conn.close()
        self.listener.close()
        if self.shm is not None:
            self.shm.close()


class ChannelSender:
    """Sender process of the throughput part: one KVSender per channel over a random source
    cache, and the TCP and memcpy references on the same bytes."""

    def __init__(
        self,
        config: TransferBenchConfig,
        device: str,
        layout: KVLayout,
        num_blocks: int,
        channels: tuple[str, ...],
        copy_device: str,
    ) -> None:
        self.device = torch.device(device)
        self.copy_device = torch.device(copy_device)  # the device-copy reference's destination
        self.layout = layout
        shape = (2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        gen = torch.Generator().manual_seed(config.seed)
        self.kv_caches = [
            torch.randn(shape, generator=gen).to(dtype=layout.torch_dtype, device=self.device)
            for _ in range(layout.num_layers)
        ]
        self.blocks = block_order(num_blocks, config.seed)
        self.senders = {c: KVSender(_FINGERPRINT, channel=c) for c in channels}
        self.sock: socket.socket | None = None
        self._wire: dict[int, torch.Tensor] = {}  # num_tokens -> every layer's wire bytes, flat
        self._copies: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self._checksums: dict[int, float] = {}

    def info(self) -> dict[str, Any]:
        return {}

    def _source_blocks(self, num_tokens: int) -> list[int]:
        return self.blocks[: math.ceil(num_tokens / self.layout.block_size)]

    def setup_pair(self, endpoint: str, pair_store: str) -> float:
        """Seconds to set up the pair with the receiver (later transfers reuse it)."""
        sender = self.senders["pair"]
        t0 = time.perf_counter()
        sender.pairs.get(
            endpoint, pair_store, backend_for(self.device), sender.pair_setup_timeout_s
        )
        return time.perf_counter() - t0

    def transfer(self, channel: str, ticket: KVTicket) -> dict[str, Any]:
        """One transfer, every layer ready at once; seconds from begin() to DONE."""
        sender = self.senders[channel]
        n = ticket.num_tokens
        blocks = self._source_blocks(n)
        t0 = time.perf_counter()
        transfer = sender.begin(ticket, self.kv_caches)
        transfer.set_source(blocks)
        transfer.all_layers_ready()
        transfer.finish(0)
        state = transfer.wait()
        seconds = time.perf_counter() - t0
        sender.poll()
        if state != TransferState.SUCCESS:
            raise RuntimeError(f"{channel} transfer {ticket.request_key}: {transfer.status.error}")
        if transfer.plane_name != channel:
            raise RuntimeError(f"asked for the {channel} plane, got {transfer.plane_name!r}")
        if n not in self._checksums:
            self._checksums[n] = kv_checksum(self.kv_caches, blocks, n)
        return {
            "seconds": seconds,
            "nbytes": transfer.nbytes,
            "data_plane": transfer.plane_name,
            "checksum": self._checksums[n],
        }

    def wire(self, num_tokens: int) -> torch.Tensor:
        """Every layer's wire tensor [2, tokens, heads, dim] back to back, as flat bytes."""
        flat = self._wire.get(num_tokens)
        if flat is None:
            blocks = self._source_blocks(num_tokens)
            slots = slot_mapping(blocks, self.layout.block_size, num_tokens, self.device)
            layers = [gather_tokens(c, slots).reshape(-1) for c in self.kv_caches]
            flat = self._wire[num_tokens] = torch.cat(layers).view(torch.uint8)
        return flat

    def tcp_connect(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def tcp_send(self, num_tokens: int) -> dict[str, Any]:
        """Stream the transfer's bytes, layer by layer, until the receiver's one-byte answer."""
        assert self.sock is not None
        data = as_bytes(self.wire(num_tokens).cpu())
        step = self.layout.layer_nbytes(num_tokens)
        t0 = time.perf_counter()
        for offset in range(0, len(data), step):
            self.sock.sendall(data[offset : offset + step])
        if self.sock.recv(1) != b"k":
            raise ConnectionError("the TCP reference's receiver did not answer")
        return {"seconds": time.perf_counter() - t0, "nbytes": len(data)}

    def copy(self, num_tokens: int, reference: str) -> dict[str, Any]:
        """One-way copy of the transfer's bytes between two preallocated tensors: host memcpy,
        or device to device (`device_copy`)."""
        key = (num_tokens, reference)
        if key not in self._copies:
            src = self.wire(num_tokens)
            if reference == "memcpy":
                src = src.cpu()
            dst = torch.empty_like(src, device=self.copy_device if src.is_cuda else src.device)
            dst.copy_(src)  # touch every page before timing
            self._copies[key] = (src, dst)
        src, dst = self._copies[key]
        _sync(src.device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(src.device)
        _sync(dst.device)
        return {"seconds": time.perf_counter() - t0, "nbytes": src.numel()}

    def close(self) -> None:
        for sender in self.senders.values():
            sender.close()
        if self.sock is not None:
            self.sock.close()
