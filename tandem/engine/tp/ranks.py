"""The ranks of a tensor-parallel engine: the processes rank 0 starts, and each rank's runner.

Lifecycle: `RankProcesses.start` opens a TCPStore on loopback, spawns ranks 1..t-1
(torch.multiprocessing, spawn) and joins the group as rank 0; every rank then loads its shard and
meets the others at a barrier, so a rank that cannot load fails the engine's start. In each step,
rank 0's `TPModelRunner.prepare` broadcasts the step message and its `execute` runs the model; the
other ranks' `TPModelRunner.serve` receives the message and runs the same forward, whose
collectives pair with rank 0's. `RankProcesses.stop` (the engine's `close`, garbage collection
or exit) broadcasts STOP and joins them; one that does not exit in time is killed. A rank that
dies or hangs fails rank 0's step within the group's timeout (`TensorParallelError`); if rank 0
dies, the others' wait ends with a closed connection and they exit.

A worker's rank 0 also sends, between steps, a keep-alive at most every KEEPALIVE_S
(`keep_alive`), and reads the ranks' KV cache tensors once (`kv_caches`, for its KV transfer:
kv_view.py); `healthy` says whether every rank is alive and the group unbroken.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.multiprocessing

from tandem.config import EngineConfig
from tandem.engine.dtypes import model_device
from tandem.engine.runner import ModelInput, ModelRunner, StepResult
from tandem.engine.scheduler import SchedulerOutput
from tandem.engine.tp.group import HOST, TPGroup
from tandem.engine.tp.step import KEEPALIVE, SHARE_KV, STOP, StepMessage, send_control

if TYPE_CHECKING:  # generic in the stubs only
    from multiprocessing.queues import Queue

    # Where a rank hands rank 0 its KV cache tensors when asked (SHARE_KV): (rank, per layer).
    KVQueue = Queue[tuple[int, list[torch.Tensor]]]
# What a spawned rank runs once it has joined the group: load its shard, then serve steps.
RankMain = Callable[[EngineConfig, Path, TPGroup, "KVQueue"], None]
JOIN_SECONDS = 10.0  # how long `stop` waits for a rank to exit before killing it
# How long the ranks may take to start and load their shards (a rank that dies meanwhile fails
# the start at once); the group's own timeout (`tp_timeout_s`) bounds the collectives of steps.
LOAD_TIMEOUT = timedelta(minutes=30)
START_POLL_S = 0.05  # how often `start` looks whether the rank processes are up (or dead)
KEEPALIVE_S = 0.5  # an idle worker's rank 0 proves its group alive this often


class TensorParallelError(RuntimeError):
    """A collective failed: a rank died, or did not join within the group's timeout."""


class TPModelRunner(ModelRunner):
    """Rank 0: broadcasts each step before running it. Ranks 1..: `serve` runs rank 0's steps."""

    def __init__(self, *args: Any, group: TPGroup, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = group

    def prepare(self, out: SchedulerOutput, block_tables: dict[str, list[int]]) -> ModelInput:
        inp = super().prepare(out, block_tables)
        StepMessage(
            inp.input_ids, inp.positions, inp.seqs, inp.sample_indices, list(out.block_copies)
        ).send(self.group)
        return inp

    def execute(self, *args: Any, **kwargs: Any) -> StepResult:
        group = self.group
        if group.broken:
            raise TensorParallelError("an earlier step lost a tensor-parallel rank")
        try:
            return super().execute(*args, **kwargs)
        except RuntimeError as e:
            if not group.broken:  # not a collective's failure
                raise
            raise TensorParallelError(
                f"a tensor-parallel rank of {group.size} failed or did not answer within "
                f"{group.timeout.total_seconds():g} s: {e}"
            ) from e

    @torch.inference_mode()
    def serve(self, kv_queue: KVQueue) -> None:
        """Run rank 0's steps until it stops the ranks; hand it the KV caches when asked."""
        while (step := StepMessage.receive(self.group)) != STOP:
            if step == SHARE_KV:
                for cache in self.kv_caches:
                    cache.share_memory_()  # here, not in the queue's thread: steps follow
                kv_queue.put((self.group.rank, self.kv_caches))
            if not isinstance(step, StepMessage):
                continue
            self.copy_blocks(step.block_copies)
            meta = self.backend.build_metadata(step.seqs, self.device)
            hidden = self.model(step.input_ids, step.positions, self.kv_caches, meta)
            if step.sample_indices.numel():
                self.model.compute_logits(hidden[step.sample_indices])  # the gather's other end


def rank_device(device: torch.device, rank: int, size: int) -> torch.device:
    """Rank `rank`'s device: the CPU, or GPU `rank` of this host."""
    if device.type == "cpu":
        return device
    if device.type != "cuda" or device.index is not None:
        raise ValueError(
            f"tensor_parallel_size={size} runs on device 'cpu' or 'cuda' (rank r on cuda:r), "
            f"got {str(device)!r}"
        )
    if size > torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size={size} needs {size} GPUs; this host has "
            f"{torch.cuda.device_count()}"
        )
    return torch.device("cuda", rank)


class RankProcesses:
    """Ranks 1..t-1 of an engine, as local processes, and rank 0's group with them."""

    def __init__(
        self,
        group: TPGroup,
        processes: list[BaseProcess],
        store: dist.Store,
        kv_queue: KVQueue,
    ) -> None:
        self.group = group
        self.processes = processes
        self._store = store  # the ranks' rendezvous; kept while they run
        self._kv_queue = kv_queue
        self._last_sent = time.monotonic()  # of the last keep-alive
        self._finalizer = weakref.finalize(self, _stop, group, processes)

    @classmethod
    def start(cls, config: EngineConfig, model_path: Path, main: RankMain) -> RankProcesses:
        """Spawn ranks 1.. running `main` and join them as rank 0."""
        mc = config.model
        size = mc.tensor_parallel_size
        device = rank_device(model_device(mc), 0, size)
        store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=LOAD_TIMEOUT)
        context = torch.multiprocessing.get_context("spawn")
        kv_queue: KVQueue = context.Queue()
        processes: list[BaseProcess] = [
            context.Process(
                target=_rank_main,
                args=(main, config, model_path, rank, store.port, kv_queue),
                name=f"tandem-tp-rank-{rank}",
                daemon=True,
            )
            for rank in range(1, size)
        ]
        for process in processes:
            process.start()
        try:
            _await_started(store, processes)
            group = TPGroup.join(store, 0, size, device, mc.tp_timeout_s)
        except RuntimeError as e:
            _kill(processes)
            codes = [p.exitcode for p in processes]
            raise TensorParallelError(f"the ranks did not join (exit codes {codes}): {e}") from e
        return cls(group, processes, store, kv_queue)

    @property
    def healthy(self) -> bool:
        """Every rank process is alive and no collective has failed."""
        return not self.group.broken and all(p.is_alive() for p in self.processes)

    def keep_alive(self) -> None:
        """Rank 0, idle: a keep-alive to the ranks if none went for KEEPALIVE_S; a failure (a
        dead rank) breaks the group (`healthy` turns False)."""
        if self.group.broken or time.monotonic() - self._last_sent < KEEPALIVE_S:
            return
        self._last_sent = time.monotonic()
        with contextlib.suppress(RuntimeError):  # the group is marked broken
            send_control(self.group, KEEPALIVE)

    def kv_caches(self, own: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Rank r's KV cache tensors (per layer) at [r], rank 0's being `own`: the others'
        mapped into this process (shared memory, CUDA IPC). Call between steps, at the start:
        a rank moves its CPU cache into shared memory first (a copy of its KV budget)."""
        send_control(self.group, SHARE_KV)
        timeout = LOAD_TIMEOUT.total_seconds()
        shared = dict(self._kv_queue.get(timeout=timeout) for _ in self.processes)
        return [own, *(shared[rank] for rank in range(1, self.group.size))]

    def stop(self) -> None:
        """Stop the ranks (once)."""
        self._finalizer()

    def kill(self) -> None:
        """Kill the ranks without a word to them (they may be stuck in a collective)."""
        self._finalizer.detach()
        _kill(self.processes)


def _rank_main(
    main: RankMain, config: EngineConfig, model_path: Path, rank: int, port: int, kv_queue: KVQueue
) -> None:
    """A spawned rank: join the group, then `main`."""
    mc = config.model
    size = mc.tensor_parallel_size
    device = rank_device(model_device(mc), rank, size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif mc.cpu_threads is not None:
        torch.set_num_threads(mc.cpu_threads)
    store = dist.TCPStore(HOST, port, is_master=False, timeout=LOAD_TIMEOUT)
    store.set(f"started/{rank}", "")
    main(config, model_path, TPGroup.join(store, rank, size, device, mc.tp_timeout_s), kv_queue)


def _await_started(store: dist.Store, processes: list[BaseProcess]) -> None:
    """Wait until every rank process has reached the store; a process that exits first (an
    import error, a bad environment) fails the start at once rather than after the timeout."""
    keys = [f"started/{rank}" for rank in range(1, len(processes) + 1)]
    deadline = time.monotonic() + LOAD_TIMEOUT.total_seconds()
    while not store.check(keys):
        for process in processes:
            if process.exitcode is not None:
                raise TensorParallelError(f"{process.name} exited with code {process.exitcode}")
        if time.monotonic() > deadline:
            raise TensorParallelError(f"the ranks did not start within {LOAD_TIMEOUT}")
        time.sleep(START_POLL_S)


def _stop(group: TPGroup, processes: list[BaseProcess]) -> None:
    if not group.broken:  # else some rank is dead or stuck in a collective: kill them all
        # A rank already gone cannot take the message; the join below then finds it dead.
        with contextlib.suppress(RuntimeError):
            send_control(group, STOP)
        for process in processes:
            process.join(JOIN_SECONDS)
    _kill(processes)


def _kill(processes: list[BaseProcess]) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join()
