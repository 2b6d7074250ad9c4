"""A paged KV cache in POSIX shared memory, so a prefill worker on the same host can write a
request's KV straight into a decode worker's blocks (one copy, no socket).

The decode worker creates the cache (`SharedKVCache.create`) and passes its path in its tickets
(`KVTicket.shared_cache`); the prefill worker attaches by path. The file lives in /dev/shm, named
with the creator's pid, and is unlinked when the creator closes it, or by the next `create` on the
host once the creator is gone (killed); mappings already made stay valid until they are dropped.

CPU tensors only; a CUDA cache plays the same role through CUDA IPC (`cuda_ipc.py`), and
`SharedCacheAttachments` opens either kind by the locator in the ticket.
"""

from __future__ import annotations

import math
import os
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import torch

from kv_transfer.cuda_ipc import CudaSharedKVCache, is_cuda_locator
from kv_transfer.ticket import KVLayout

SHM_DIR = Path("/dev/shm")


def shm_available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


class SharedKVCache:
    """Per-layer KV tensors [2, num_blocks, block_size, heads, slot_dim] over one shared file."""

    def __init__(self, path: Path, layout: KVLayout, num_blocks: int, owner: bool) -> None:
        self.path = path
        self.layout = layout
        self.num_blocks = num_blocks
        self.owner = owner
        shape = (2, num_blocks, layout.block_size, layout.num_kv_heads, layout.slot_dim)
        numel = layout.num_layers * math.prod(shape)
        storage = torch.from_file(str(path), shared=True, size=numel, dtype=layout.torch_dtype)
        self.kv_caches = list(storage.view(layout.num_layers, *shape).unbind(0))

    @property
    def locator(self) -> str:
        """What a ticket names this cache by."""
        return str(self.path)

    @classmethod
    def create(cls, layout: KVLayout, num_blocks: int) -> SharedKVCache:
        remove_stale_caches()
        path = SHM_DIR / f"tandem-kv-{os.getpid()}-{uuid.uuid4().hex}"
        return cls(path, layout, num_blocks, owner=True)  # from_file creates it, zero-filled

    @classmethod
    def attach(cls, path: str, layout: KVLayout) -> SharedKVCache:
        size = Path(path).stat().st_size
        per_block = layout.layer_nbytes(layout.block_size) * layout.num_layers
        if size % per_block:
            raise ValueError(
                f"{path} is {size} bytes, not a whole number of {per_block}-byte blocks"
            )
        return cls(Path(path), layout, size // per_block, owner=False)

    def close(self) -> None:
        self.kv_caches = []
        if self.owner:
            self.path.unlink(missing_ok=True)


def remove_stale_caches() -> int:
    """Unlink caches whose creating process is gone (a decode worker killed without cleanup)."""
    removed = 0
    for path in SHM_DIR.glob("tandem-kv-*-*"):
        pid = path.name.split("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            path.unlink(missing_ok=True)
            removed += 1
    return removed


SharedCache = SharedKVCache | CudaSharedKVCache


def can_share(device: torch.device) -> bool:
    """Whether a cache on `device` can be shared with same-host senders."""
    return device.type == "cuda" or (device.type == "cpu" and shm_available())


def create_shared_cache(layout: KVLayout, num_blocks: int, device: torch.device) -> SharedCache:
    """A receiver's cache that same-host senders can open: CUDA IPC on a GPU, else /dev/shm."""
    if device.type == "cuda":
        return CudaSharedKVCache.create(layout, num_blocks, device)
    return SharedKVCache.create(layout, num_blocks)


def attach(locator: str, layout: KVLayout) -> SharedCache:
    """Open a receiver's shared cache by its ticket's locator: a CUDA IPC export or a path."""
    if is_cuda_locator(locator):
        return CudaSharedKVCache.attach(locator, layout)
    return SharedKVCache.attach(locator, layout)


class SharedCacheAttachments:
    """The sender's open receivers' caches (mappings or CUDA IPC openings) by locator, least
    recently used dropped first; a locator that could not be opened is not tried again for
    `retry_s` (its error is raised again at once). Safe to call from several threads."""

    def __init__(self, max_open: int = 16, retry_s: float = 60.0) -> None:
        self.max_open = max_open
        self.retry_s = retry_s
        self._open: OrderedDict[str, SharedCache] = OrderedDict()
        self._failed: dict[str, tuple[float, Exception]] = {}  # locator -> (when, why)
        self._lock = threading.Lock()

    def get(self, locator: str, layout: KVLayout) -> SharedCache:
        with self._lock:
            failed = self._failed.get(locator)
            if failed is not None and time.monotonic() - failed[0] < self.retry_s:
                raise ValueError(f"{failed[1]} (failed {time.monotonic() - failed[0]:.0f} s ago)")
            cache = self._open.get(locator)
            if cache is None or cache.layout != layout:
                try:
                    cache = self._open[locator] = attach(locator, layout)
                except (OSError, ValueError, RuntimeError) as e:  # RuntimeError: CUDA's
                    self._failed[locator] = (time.monotonic(), e)
                    raise
                while len(self._open) > self.max_open:  # planes keep the tensors they took
                    self._open.popitem(last=False)[1].close()
            self._open.move_to_end(locator)
            return cache

    def close(self) -> None:
        with self._lock:
            while self._open:
                self._open.popitem()[1].close()
