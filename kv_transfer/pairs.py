"""Pairwise torch.distributed groups: one two-rank group per (prefill, decode) process pair.

There is no global world. The decode worker hosts a TCPStore (its `pair_store` address); a
prefill worker that wants to send asks it to join a new pair over gRPC (`OpenPair`) while it
joins the same pair itself, both through a `PrefixStore` named by the pair id, so one store
serves any number of pairs. Rank 0 sends, rank 1 receives. CPU tensors go over Gloo and CUDA
tensors over NCCL through the same calls.

Each layer of a transfer travels as one send/recv with its own tag (`tag_base + layer`), so
transfers on one pair do not need to take turns, and a receiver can post the recvs of several
layers at once. Sizes must match exactly (Gloo aborts a receiver
that gets more bytes than it posted), which the header, validated against the ticket, guarantees.
A timed-out send or recv closes the pair for good: both sides drop it and a new one is made.

Cost: a Gloo pair is one socket and one worker thread on a device shared by all pairs, about 35
KB of memory per pair (measured); an NCCL pair is one communicator. The sender keeps at most
`max_pairs`, closing the least recently used one, and closes pairs idle for `idle_s` (looked at
on each of its polls, which the prefill loop makes every iteration). Dropping the last reference
to a group (and to its pending work) closes it; the peer's pending recv fails.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

TAG_SPACE = 2**30  # tags wrap inside a 32-bit int
# A sender's marker announces at most this many bytes of posted sends (one layer at least); a
# receiver posts at most this many bytes of recvs at once (two layers at least).
WINDOW_BYTES = 32 << 20


@functools.cache
def _gloo_device(host: str) -> Any:
    """One Gloo device (one event-loop thread) shared by all of this process's pairs."""
    return dist.ProcessGroupGloo.create_device(hostname=host)


def make_group(backend: str, store: dist.Store, rank: int, host: str, timeout_s: float) -> Any:
    """A two-rank group on `store`; blocks until the other rank joins (DistStoreError after
    `timeout_s`). `host` is the address this side's Gloo sockets bind to: a routable one across
    hosts. A pair id must never be reused: Gloo's addresses stay in the store."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timeout
        opts._threads = 1  # send/recv only: one worker thread is enough
        opts._devices = [_gloo_device(host)]
        return dist.ProcessGroupGloo(store, rank, 2, opts)
    if backend == "nccl":
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, nccl_opts)
    raise ValueError(f"pair backend must be 'gloo' or 'nccl', got {backend!r}")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class Pair:
    """One end of a two-rank group. `send` is asynchronous (returns the work to wait on)."""

    def __init__(self, pair_id: str, group: Any, rank: int) -> None:
        # A c10d Backend (ProcessGroupGloo/NCCL); torch's stubs do not declare its send/recv.
        self.pair_id = pair_id
        self.group = group
        self.rank = rank
        self.last_used = time.monotonic()
        self._tags = itertools.count()

    def next_tag_base(self, num_tags: int) -> int:
        return next(self._tags) * num_tags % TAG_SPACE

    def send(self, tensor: torch.Tensor, tag: int) -> dist.Work:
        self.last_used = time.monotonic()
        return self.group.send([tensor], 1 - self.rank, tag)

    def post_recv(self, tensor: torch.Tensor, tag: int) -> dist.Work:
        """Start receiving into `tensor` (asynchronous, like `send`)."""
        self.last_used = time.monotonic()
        return self.group.recv([tensor], 1 - self.rank, tag)


def wait_done(work: dist.Work, timeout_s: float) -> None:
    """Wait for a send or recv; raises on a dead peer or after `timeout_s`."""
    work.wait(timedelta(seconds=max(timeout_s, 0.001)))


class PairHost:
    """Decode side: the rendezvous store and the pairs that senders opened with this process."""

    def __init__(self, host: str, max_pairs: int = 64) -> None:
        self.host = host
        self.max_pairs = max_pairs
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        self._pairs: dict[str, Pair] = {}
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.store.port}"

    def open(self, pair_id: str, backend: str, timeout_s: float) -> Pair:
        with self._lock:
            if len(self._pairs) >= self.max_pairs:
                raise RuntimeError(f"this worker already has {self.max_pairs} pairs")
        store = dist.PrefixStore(f"pair/{pair_id}", self.store)
        pair = Pair(pair_id, make_group(backend, store, 1, self.host, timeout_s), rank=1)
        with self._lock:
            self._pairs[pair_id] = pair
        return pair

    def get(self, pair_id: str) -> Pair | None:
        with self._lock:
            return self._pairs.get(pair_id)

    def close(self, pair_id: str) -> None:
        with self._lock:
            self._pairs.pop(pair_id, None)

    def __len__(self) -> int:
        return len(self._pairs)


class PairPool:
    """Prefill side: at most `max_pairs` live pairs, one per receiver, LRU and idle eviction.

    `open_remote(endpoint, pair_id, backend, timeout_s)` asks the receiver to join (the gRPC
    OpenPair call, run in the background while this side joins); `close_remote(endpoint,
    pair_id)` tells it the pair is gone."""

    def __init__(
        self,
        host: str,
        open_remote: Callable[[str, str, str, float], Callable[[], None]],
        close_remote: Callable[[str, str], None],
        max_pairs: int = 8,
        idle_s: float = 300.0,
    ) -> None:
        self.host = host
        self.max_pairs = max_pairs
        self.idle_s = idle_s
        self._open_remote = open_remote
        self._close_remote = close_remote
        self._pairs: OrderedDict[str, Pair] = OrderedDict()  # by receiver endpoint
        self._lock = threading.Lock()
        self._opening: dict[str, threading.Lock] = {}

    def get(self, endpoint: str, store_address: str, backend: str, timeout_s: float) -> Pair:
        """The pair with `endpoint`, set up on first use (raises when that fails)."""
        with self._lock:
            opening = self._opening.setdefault(endpoint, threading.Lock())
        with opening:  # one setup per receiver at a time; others reuse its pair
            with self._lock:
                pair = self._pairs.get(endpoint)
                if pair is not None:
                    self._pairs.move_to_end(endpoint)
                    pair.last_used = time.monotonic()  # a transfer has it: not idle
                    return pair
            pair = self._connect(endpoint, store_address, backend, timeout_s)
        with self._lock:
            self._pairs[endpoint] = pair
            evicted = [self._pairs.popitem(last=False) for _ in range(len(self) - self.max_pairs)]
        for old_endpoint, old in evicted:
            self._close_remote(old_endpoint, old.pair_id)
        return pair

    def _connect(self, endpoint: str, store_address: str, backend: str, timeout_s: float) -> Pair:
        pair_id = uuid.uuid4().hex
        remote_joined = self._open_remote(endpoint, pair_id, backend, timeout_s)
        host, port = store_address.rsplit(":", 1)
        client = dist.TCPStore(
            host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s)
        )
        store = dist.PrefixStore(f"pair/{pair_id}", client)
        pair = Pair(pair_id, make_group(backend, store, 0, self.host, timeout_s), rank=0)
        remote_joined()  # raises when the receiver refused or failed to join
        return pair

    def drop(self, endpoint: str) -> None:
        """Forget the pair with `endpoint` (after a failure on it); get() makes a new one."""
        with self._lock:
            pair = self._pairs.pop(endpoint, None)
        if pair is not None:
            self._close_remote(endpoint, pair.pair_id)

    def close_idle(self) -> int:
        """Close the pairs unused for more than `idle_s`; returns how many."""
        now = time.monotonic()
        with self._lock:  # get() marks a pair used under this lock: none is taken and closed
            idle = [(e, p) for e, p in self._pairs.items() if now - p.last_used > self.idle_s]
            for endpoint, _ in idle:
                del self._pairs[endpoint]
        for endpoint, pair in idle:
            self._close_remote(endpoint, pair.pair_id)
        return len(idle)

    def close(self) -> None:
        for endpoint in list(self._pairs):
            self.drop(endpoint)

    def __len__(self) -> int:
        return len(self._pairs)
