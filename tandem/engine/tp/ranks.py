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
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing

from tandem.config import EngineConfig
from tandem.engine.dtypes import model_device
from tandem.engine.runner import ModelInput, ModelRunner, StepResult
from tandem.engine.scheduler import SchedulerOutput
from tandem.engine.tp.group import HOST, TPGroup
from tandem.engine.tp.step import StepMessage, send_stop

# What a spawned rank runs once it has joined the group: load its shard, then serve steps.
RankMain = Callable[[EngineConfig, Path, TPGroup], None]
JOIN_SECONDS = 10.0  # how long `stop` waits for a rank to exit before killing it
# How long the ranks may take to start and load their shards (a rank that dies meanwhile fails
# the start at once); the group's own timeout (`tp_timeout_s`) bounds the collectives of steps.
LOAD_TIMEOUT = timedelta(minutes=30)
START_POLL_S = 0.05  # how often `start` looks whether the rank processes are up (or dead)


class TensorParallelError(RuntimeError):
    """A collective failed: a rank died, or did not join within the group's timeout."""


class TPModelRunner(ModelRunner):
    """Rank 0: broadcasts each step before running it. Ranks 1..: `serve` runs rank 0's steps."""

    def __init__(self, *args: Any, group: TPGroup, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = group

    def prepare(self, out: SchedulerOutput, block_tables: dict[str, list[int]]) -> ModelInput:
        inp = super().prepare(out, block_tables)
        StepMessage(inp.input_ids, inp.positions, inp.seqs, inp.sample_indices).send(self.group)
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
    def serve(self) -> None:
        """Run rank 0's steps until it stops the ranks."""
        while (step := StepMessage.receive(self.group)) is not None:
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

    def __init__(self, group: TPGroup, processes: list[BaseProcess], store: dist.Store) -> None:
        self.group = group
        self.processes = processes
        self._store = store  # the ranks' rendezvous; kept while they run
        self._finalizer = weakref.finalize(self, _stop, group, processes)

    @classmethod
    def start(cls, config: EngineConfig, model_path: Path, main: RankMain) -> RankProcesses:
        """Spawn ranks 1.. running `main` and join them as rank 0."""
        mc = config.model
        size = mc.tensor_parallel_size
        device = rank_device(model_device(mc), 0, size)
        store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=LOAD_TIMEOUT)
        context = torch.multiprocessing.get_context("spawn")
        processes: list[BaseProcess] = [
            context.Process(
                target=_rank_main,
                args=(main, config, model_path, rank, store.port),
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
        return cls(group, processes, store)

    def stop(self) -> None:
        """Stop the ranks (once)."""
        self._finalizer()

    def kill(self) -> None:
        """Kill the ranks without a word to them (they may be stuck in a collective)."""
        self._finalizer.detach()
        _kill(self.processes)


def _rank_main(
    main: RankMain, config: EngineConfig, model_path: Path, rank: int, port: int
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
    main(config, model_path, TPGroup.join(store, rank, size, device, mc.tp_timeout_s))


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
            send_stop(group)
        for process in processes:
            process.join(JOIN_SECONDS)
    _kill(processes)


def _kill(processes: list[BaseProcess]) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join()
