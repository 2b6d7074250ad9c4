"""KV cache tensors over one named file in /dev/shm, which any process of the host can map.

A tensor-parallel worker's ranks 1.. move their caches into such a file when rank 0 asks
(tp/ranks.py), and a decode worker computes in one (kv_transfer/shm.py), so that a same-host
prefill worker maps every rank's cache by its path and writes a request's KV straight into it.
A file is named with its creator's PID namespace and pid: `remove_stale_files` (called by each
`create` and `unlink`) unlinks those of this namespace whose creator is gone (killed without
cleanup), so a cluster that stops cleanly leaves none of them, whichever of its workers were
killed before. Containers that share /dev/shm (`--ipc=host`) but not their pids never take each
other's live files for stale ones. Mappings already made stay valid until they are dropped.
"""

from __future__ import annotations

import math
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")
PREFIX = "tandem-kv-"


def _pid_namespace() -> int:
    """This process's PID namespace (its inode; 0 where /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


OWN_PREFIX = f"{PREFIX}{_pid_namespace()}-"  # + the creator's pid, "-", a unique hex


def shm_available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


@dataclass(frozen=True)
class SharedKVFile:
    """Every layer's [2, num_blocks, block_size, heads, slot_dim] tensor, back to back in the
    file at `path`: what a process needs to map it (it pickles: ranks hand it to rank 0)."""

    path: str
    num_layers: int
    layer_shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def create(
        cls, num_layers: int, layer_shape: tuple[int, ...], dtype: torch.dtype
    ) -> SharedKVFile:
        """A new file (zero-filled once mapped) named with this process's pid."""
        remove_stale_files()
        path = SHM_DIR / f"{OWN_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        return cls(str(path), num_layers, tuple(layer_shape), dtype)

    def map(self) -> list[torch.Tensor]:
        """The layers' tensors over the file (created, zero-filled, if it does not exist)."""
        numel = self.num_layers * math.prod(self.layer_shape)
        storage = torch.from_file(self.path, shared=True, size=numel, dtype=self.dtype)
        return list(storage.view(self.num_layers, *self.layer_shape).unbind(0))

    def unlink(self) -> None:
        """Unlink this file, and those of creators that are gone."""
        Path(self.path).unlink(missing_ok=True)
        remove_stale_files()


def move_into_shared_file(caches: list[torch.Tensor]) -> SharedKVFile:
    """Move a CPU cache's layers (one shape and dtype) into a new shared file, in place: each
    tensor keeps its identity and now views the file (a copy of the cache, once)."""
    file = SharedKVFile.create(len(caches), tuple(caches[0].shape), caches[0].dtype)
    for cache, shared in zip(caches, file.map(), strict=True):
        shared.copy_(cache)
        cache.set_(shared)  # type: ignore[call-overload]  # a tensor source: its storage
    return file


def remove_stale_files() -> int:
    """Unlink the caches of this PID namespace whose creating process is gone (a worker or rank
    killed without cleanup)."""
    removed = 0
    for path in SHM_DIR.glob(f"{OWN_PREFIX}*-*"):
        pid = path.name.removeprefix(OWN_PREFIX).split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            path.unlink(missing_ok=True)
            removed += 1
    return removed
