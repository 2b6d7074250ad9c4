"""A tensor-parallel process group: its rank, size and the collectives the model calls.

Built on an explicit c10d backend (`ProcessGroupGloo` / `ProcessGroupNCCL`), not the default
group, so an engine's ranks never touch torch.distributed's global state (the KV transfer pairs
build their own groups too, `kv_transfer/pairs.py`). Every collective waits at most the group's
timeout: a rank that died or hangs fails the others' step with an error instead of blocking it.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

HOST = "127.0.0.1"  # the ranks of one engine run on one host


class TPGroup:
    def __init__(
        self, backend: Any, rank: int, size: int, device: torch.device, timeout_s: float
    ) -> None:
        self.backend = backend  # a c10d Backend; torch's stubs do not declare its collectives
        self.rank = rank
        self.size = size
        self.device = device  # where this rank's tensors live (NCCL: its own GPU)
        self.broken = False  # a collective failed: the group's state is undefined from then on
        self.wait_seconds = 0.0  # spent in collectives since the group was made (benchmarks)
        self.timeout = timedelta(seconds=timeout_s)

    @classmethod
    def join(
        cls, store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float
    ) -> TPGroup:
        """Join the group of `size` ranks on `store`; blocks until every rank has joined (an
        error after the store's timeout). Collectives wait at most `timeout_s`."""
        store = dist.PrefixStore("tp", store)
        timeout = timedelta(seconds=timeout_s)
        if device.type == "cuda":
            nccl = dist.ProcessGroupNCCL.Options()
            nccl._timeout = timeout
            backend: Any = dist.ProcessGroupNCCL(store, rank, size, nccl)
            return cls(backend, rank, size, device, timeout_s)
        gloo = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        gloo._timeout = timeout
        gloo._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
        return cls(dist.ProcessGroupGloo(store, rank, size, gloo), rank, size, device, timeout_s)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        self._wait(self.backend.allreduce([tensor]), self.timeout)
        return tensor

    def broadcast(self, tensor: torch.Tensor, timeout: timedelta | None = None) -> torch.Tensor:
        """Rank 0's `tensor` into every rank's, in place; waits at most `timeout` (default: the
        group's)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = timeout or self.timeout
        self._wait(self.backend.broadcast([tensor], opts), opts.timeout)
        return tensor

    def gather_columns(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0: every rank's `tensor` ([rows, cols], equal shapes) side by side, [rows, cols *
        size]; the other ranks get their own `tensor` back."""
        return self._gather(tensor, dim=1)

    def gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0: every rank's `tensor` ([rows, cols], equal shapes) stacked, [rows * size,
        cols]; the other ranks get their own `tensor` back."""
        return self._gather(tensor, dim=0)

    def _gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == 0 else []
        outputs = [parts] if self.rank == 0 else []  # Gloo: nothing at all on the others
        opts = dist.GatherOptions()
        opts.rootRank = 0
        opts.timeout = self.timeout
        self._wait(self.backend.gather(outputs, [tensor], opts), self.timeout)
        return torch.cat(parts, dim=dim) if self.rank == 0 else tensor

    def _wait(self, work: dist.Work, timeout: timedelta) -> None:
        start = time.perf_counter()
        try:
            work.wait(timeout)
        except RuntimeError:
            self.broken = True
            raise
        finally:
            self.wait_seconds += time.perf_counter() - start

    def barrier(self, timeout: timedelta) -> None:
        """Wait until every rank has come here, at most `timeout`."""
        self.broadcast(torch.zeros(1, device=self.device), timeout)
