"""What the two ends agree on: the KV layout, the model fingerprint and the transfer ticket.

The decode worker issues a `KVTicket` when it reserves blocks for a prompt; the router hands it to
the prefill worker with the request. The ticket names where to send (endpoint, and the optional
shared cache, host-local control socket and torch.distributed rendezvous; a tensor-parallel
receiver's ranks each with theirs and the KV heads they hold), which blocks to fill, and what the
receiver will accept (layout and fingerprint); a header that disagrees is refused before
anything is written.
"""

from __future__ import annotations

import hashlib
import json
import socket
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from functools import cache
from pathlib import Path

import torch

from tandem.engine.dtypes import KV_TORCH_DTYPES, TORCH_DTYPES
from tandem.engine.kv_quant import head_dim_of, slot_dim, slot_nbytes
from tandem.engine.tp.kv_view import KVLayer
from tandem.model_config import ModelConfig
from tandem.v1 import kv_transfer_pb2 as pb

CACHE_DTYPES = TORCH_DTYPES | KV_TORCH_DTYPES  # a KV cache's dtype by name: float, int8, fp8
_CACHE_DTYPE_NAMES = {v: k for k, v in CACHE_DTYPES.items()}


@dataclass(frozen=True)
class KVLayout:
    """A worker's paged KV cache: per layer a [2, num_blocks, block_size, heads, slot_dim]
    tensor; `slot_dim` is `head_dim`, plus the scale's bytes in a quantized cache (kv_quant.py)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # a key of CACHE_DTYPES: "float32", "bfloat16", "float16", "int8", "fp8"

    @classmethod
    def of(cls, kv_caches: Sequence[KVLayer]) -> KVLayout:
        _, _, block_size, heads, dim = kv_caches[0].shape
        dtype = kv_caches[0].dtype
        return cls(
            len(kv_caches), heads, head_dim_of(dtype, dim), block_size, _CACHE_DTYPE_NAMES[dtype]
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return CACHE_DTYPES[self.dtype]

    @property
    def slot_dim(self) -> int:
        return slot_dim(self.torch_dtype, self.head_dim)

    def layer_nbytes(self, num_tokens: int) -> int:
        """Bytes of one layer's wire tensor [2, num_tokens, heads, slot_dim]."""
        return 2 * num_tokens * self.num_kv_heads * slot_nbytes(self.torch_dtype, self.head_dim)

    def to_proto(self) -> pb.KVLayout:
        return pb.KVLayout(**asdict(self))

    @classmethod
    def from_proto(cls, msg: pb.KVLayout) -> KVLayout:
        if msg.dtype not in CACHE_DTYPES:
            raise ValueError(f"unknown KV dtype {msg.dtype!r}")
        return cls(msg.num_layers, msg.num_kv_heads, msg.head_dim, msg.block_size, msg.dtype)

    def mismatch(self, other: KVLayout) -> str | None:
        """Why KV in `other`'s layout cannot be converted into this one (None: it can).

        Block size and dtype may differ (the receiver converts, quantizing or dequantizing
        where one side's cache is int8/fp8); the model's shape may not."""
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) != getattr(other, name):
                return f"{name}: receiver has {getattr(self, name)}, sender {getattr(other, name)}"
        return None


@dataclass(frozen=True)
class DecodeRank:
    """One rank of a tensor-parallel decode worker that receives its own heads (a per-rank
    transfer): the model's KV heads it holds (`num_heads` from `first_head`) and its endpoints,
    as a ticket's `endpoint`, `pair_store`, `local_control` and `shared_cache` name rank 0's."""

    first_head: int
    num_heads: int
    endpoint: str
    pair_store: str = ""
    local_control: str = ""
    shared_cache: str = ""  # its cache's locator (shm.py); "" when it shares none

    def to_proto(self) -> pb.DecodeRank:
        return pb.DecodeRank(**asdict(self))

    @classmethod
    def from_proto(cls, msg: pb.DecodeRank) -> DecodeRank:
        return cls(
            msg.first_head,
            msg.num_heads,
            msg.endpoint,
            msg.pair_store,
            msg.local_control,
            msg.shared_cache,
        )

    @property
    def heads(self) -> range:
        return range(self.first_head, self.first_head + self.num_heads)


@dataclass(frozen=True)
class KVTicket:
    request_key: str
    endpoint: str  # host:port of the receiver's KVTransfer service
    block_ids: tuple[int, ...]
    layout: KVLayout
    model_fingerprint: str
    num_tokens: int
    host_id: str = ""
    shared_cache: str = ""  # the receiver's cache for same-host senders (shm.py); "" when none
    pair_store: str = ""  # host:port of its TCPStore for torch.distributed pairs; "" when none
    timeout_s: float = 30.0
    local_control: str = ""  # its host-local control socket (local_control.py); "" when none
    # per-rank transfer: each decode rank's heads and endpoints, rank 0 first (a stream's ticket,
    # `for_rank`: its one decode rank); () when the receiver holds every head
    ranks: tuple[DecodeRank, ...] = ()

    def decode_ranks(self) -> tuple[DecodeRank, ...]:
        """The decode ranks a per-rank sender sends to: `ranks`, or the receiver itself as one
        rank holding every head. The first is the one the ticket's endpoints name."""
        if self.ranks:
            return self.ranks
        heads = self.layout.num_kv_heads
        return (
            DecodeRank(
                0, heads, self.endpoint, self.pair_store, self.local_control, self.shared_cache
            ),
        )

    def for_rank(self, rank: int) -> KVTicket:
        """The ticket as one stream into decode rank `rank` sees it: that rank's endpoints and
        shared cache, listing that rank alone (its heads: where the stream's land in its cache),
        the same blocks, layout and deadline."""
        target = self.decode_ranks()[rank]
        return replace(
            self,
            endpoint=target.endpoint,
            shared_cache=target.shared_cache,
            pair_store=target.pair_store,
            local_control=target.local_control,
            ranks=(target,),
        )

    def to_proto(self) -> pb.KVTicket:
        return pb.KVTicket(
            request_key=self.request_key,
            endpoint=self.endpoint,
            block_ids=self.block_ids,
            layout=self.layout.to_proto(),
            model_fingerprint=self.model_fingerprint,
            num_tokens=self.num_tokens,
            host_id=self.host_id,
            shared_cache=self.shared_cache,
            pair_store=self.pair_store,
            timeout_s=self.timeout_s,
            local_control=self.local_control,
            ranks=[r.to_proto() for r in self.ranks],
        )

    @classmethod
    def from_proto(cls, msg: pb.KVTicket) -> KVTicket:
        return cls(
            msg.request_key,
            msg.endpoint,
            tuple(msg.block_ids),
            KVLayout.from_proto(msg.layout),
            msg.model_fingerprint,
            msg.num_tokens,
            msg.host_id,
            msg.shared_cache,
            msg.pair_store,
            msg.timeout_s,
            msg.local_control,
            tuple(DecodeRank.from_proto(r) for r in msg.ranks),
        )


def model_fingerprint(cfg: ModelConfig, model_path: Path) -> str:
    """Identifies the model whose KV this is: its architecture and its weight files' names and
    sizes (hashing the weights themselves would take minutes on large models)."""
    h = hashlib.blake2b(digest_size=12)
    h.update(json.dumps(asdict(cfg), sort_keys=True, default=str).encode())
    files = [model_path] if model_path.is_file() else sorted(model_path.glob("*.safetensors"))
    for f in files:
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()


@cache
def host_id() -> str:
    """Equal on two processes of one machine (one boot), different across machines."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}/{boot.read_text().strip() if boot.exists() else ''}"
