"""The ranks of a tensor-parallel engine: where ranks 1.. run, and each rank's runner.

Lifecycle: `Ranks.start` opens a TCPStore on loopback, has its launcher start ranks 1..t-1 (local
processes, `LocalProcesses`; Ray actors in the worker's placement group, tandem/cluster/
rank_actors.py), each running `rank_main`, and joins the group as rank 0; every rank then loads
its shard and meets the others at a barrier, so a rank that cannot load fails the engine's start.
In each step, rank 0's `TPModelRunner.prepare` broadcasts the step message and its `execute` runs
the model; the other ranks' `TPModelRunner.serve` receives the message and runs the same
forward, whose collectives pair with rank 0's. `Ranks.stop` (the engine's `close`, garbage
collection or exit) broadcasts STOP and joins them; one that does not exit in time is killed. A
rank that dies or hangs fails rank 0's step within the group's timeout (`TensorParallelError`);
if rank 0 dies, the others' wait ends with a closed connection and they exit.

A worker's rank 0 also sends, between steps, a keep-alive at most every KEEPALIVE_S
(`keep_alive`); `healthy` says whether every rank is alive and the group unbroken. A worker may
run a service of its own in each rank 1.. (`start_service`: a per-rank KV transfer's receiver or
sender over the rank's own cache, docs/kv_transfer.md): rank 0 sends it through the store, each
rank starts it between steps and hands back what it returns; rank 0 then gives it orders and
reads its reports through a pair of `Mailbox`es per rank.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.multiprocessing

from tandem.config import EngineConfig, child_environment, take_environment
from tandem.engine.attention import SeqSpec
from tandem.engine.dtypes import model_device
from tandem.engine.runner import ModelInput, ModelRunner, StepResult
from tandem.engine.scheduler import SchedulerOutput
from tandem.engine.tp.group import HOST, TPGroup
from tandem.engine.tp.integrity import StepLedger, answer_integrity, check_ranks
from tandem.engine.tp.mailbox import Mailbox
from tandem.engine.tp.step import (
    INTEGRITY,
    KEEPALIVE,
    RUN_SERVICE,
    STOP,
    StepMessage,
    acknowledge,
    send_control,
)
from tandem.engine.tp.vocab import TargetVocab, WholeVocab

# How a rank starts rank 0's service (RUN_SERVICE) over its KV cache tensors.
RunService = Callable[[list[torch.Tensor]], None]
# What a rank runs once it has joined the group: load its shard, then serve steps.
RankMain = Callable[[EngineConfig, Path, TPGroup, RunService], None]


@dataclass(frozen=True)
class RankContext:
    """What a worker's service gets in the rank it runs in (`Ranks.start_service`)."""

    rank: int
    size: int
    kv_caches: list[torch.Tensor]  # the rank's own: its KV heads
    orders: Mailbox  # from rank 0
    reports: Mailbox  # to rank 0
    # set when the rank stops (its loops end), before `closers` run (what the service opened)
    stopping: threading.Event = field(default_factory=threading.Event)
    closers: list[Callable[[], None]] = field(default_factory=list)

    def stop(self) -> None:
        """End the service's loops (one waiting for an order is woken), then close what it
        opened."""
        self.stopping.set()
        with contextlib.suppress(dist.DistError):  # rank 0's store is gone, and the wait with it
            self.orders.wake()
        for close in self.closers:
            close()

    def next_order(self, poll_s: float | None) -> Any | None:
        """Rank 0's next order for a service loop. With work in flight (`poll_s` given) the one
        there now, else None after sleeping `poll_s`; with none, waiting for it. None once the
        rank is stopping (the loop then ends)."""
        order = self.orders.wait() if poll_s is None else self.orders.get()
        if order is None and poll_s is not None and not self.stopping.is_set():
            time.sleep(poll_s)
        return None if self.stopping.is_set() else order


# A worker's service in each rank 1..: called once in the rank's process, it starts its threads
# and returns what rank 0 learns of it (picklable); it must be picklable itself (a module's
# function, or a partial of one).
RankService = Callable[[RankContext], Any]


@dataclass(frozen=True)
class RankLink:
    """Rank 0's end of its service in rank `rank`: what it returned, the mailboxes, and
    whether the rank still runs (a dead rank reports nothing more)."""

    rank: int
    started: Any
    orders: Mailbox  # to the rank
    reports: Mailbox  # from the rank
    alive: Callable[[], bool]


JOIN_SECONDS = 10.0  # how long `stop` waits for a rank to exit before killing it
# How long the ranks may take to start and load their shards (a rank that dies meanwhile fails
# the start at once); the group's own timeout (`tp_timeout_s`) bounds the collectives of steps.
LOAD_TIMEOUT = timedelta(minutes=30)
START_POLL_S = 0.05  # how often `start` looks whether the ranks are up (or dead)
KEEPALIVE_S = 0.5  # an idle worker's rank 0 proves its group alive this often


class TensorParallelError(RuntimeError):
    """A collective failed: a rank died, or did not join within the group's timeout."""


class TPModelRunner(ModelRunner):
    """Rank 0: broadcasts each step before running it. Ranks 1..: `serve` runs rank 0's steps."""

    def __init__(self, *args: Any, group: TPGroup, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = group
        self.ledger = StepLedger()  # the steps this rank sent (rank 0) or ran
        # Rank 0's whole LM head (and embedding) for a Medusa or EAGLE drafter (vocab.py), set
        # once every rank has loaded
        self.whole_vocab: WholeVocab | None = None

    def target_vocab(self) -> TargetVocab:
        if self.whole_vocab is None:
            raise RuntimeError("no whole vocabulary was gathered to rank 0 for a drafter")
        return self.whole_vocab

    def prepare(self, out: SchedulerOutput, block_tables: dict[str, list[int]]) -> ModelInput:
        inp = super().prepare(out, block_tables)
        step = StepMessage(
            inp.input_ids, inp.positions, inp.seqs, inp.sample_indices, list(out.block_copies)
        )
        step.send(self.group)
        self.ledger.record(step)
        return inp

    def check_ranks(self, live: list[int], first_heads: list[int]) -> None:
        """Rank 0, between steps: every rank agrees with what rank 0 sent, the holders of the
        same KV heads (`first_heads[r]`: rank r's first) hold the same KV in the `live` blocks
        (integrity.py)."""
        check_ranks(self.group, self.ledger, self.kv_caches, live, first_heads)

    def execute(self, *args: Any, **kwargs: Any) -> StepResult:
        with self._collectives():
            return super().execute(*args, **kwargs)

    def first_layers_logits(
        self,
        num_layers: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seqs: list[SeqSpec],
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """Rank 0: a layer-skip draft's forward, broadcast first as a step of `num_layers`
        layers that every rank mirrors over its heads' KV."""
        with self._collectives():
            step = StepMessage(input_ids, positions, seqs, rows, [], num_layers)
            step.send(self.group)
            self.ledger.record(step)
            return super().first_layers_logits(num_layers, input_ids, positions, seqs, rows)

    @contextlib.contextmanager
    def _collectives(self) -> Iterator[None]:
        """Around rank 0's work with the ranks: a failed collective as `TensorParallelError`."""
        group = self.group
        if group.broken:
            raise TensorParallelError("an earlier step lost a tensor-parallel rank")
        try:
            yield
        except RuntimeError as e:
            if not group.broken:  # not a collective's failure
                raise
            raise TensorParallelError(
                f"a tensor-parallel rank of {group.size} failed or did not answer within "
                f"{group.timeout.total_seconds():g} s: {e}"
            ) from e

    @torch.inference_mode()
    def serve(self, run_service: RunService) -> None:
        """Run rank 0's steps until it stops the ranks; start its service over the KV caches,
        or check this rank against rank 0, when asked."""
        while (step := StepMessage.receive(self.group)) != STOP:
            if step == RUN_SERVICE:
                run_service(self.kv_caches)
            elif step == KEEPALIVE:
                acknowledge(self.group)
            elif step == INTEGRITY:
                answer_integrity(self.group, self.ledger, self.kv_caches)
            if not isinstance(step, StepMessage):
                continue
            self.ledger.record(step)
            self.copy_blocks(step.block_copies)
            meta = self.backend.build_metadata(step.seqs, self.device)
            n = step.num_layers
            caches = self.kv_caches if n is None else self.kv_caches[:n]
            hidden = self.model(step.input_ids, step.positions, caches, meta, num_layers=n)
            if step.sample_indices.numel():
                self.model.compute_logits(hidden[step.sample_indices])  # the gather's other end


def rank_device(device: torch.device, rank: int, size: int) -> torch.device:
    """Rank `rank`'s device on a host whose GPUs it sees all: the CPU, or GPU `rank`."""
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


class RankHandle(Protocol):
    """One rank 1.. as its launcher started it (a `multiprocessing` process is one)."""

    @property
    def name(self) -> str: ...

    @property
    def exitcode(self) -> int | None: ...  # None while it runs

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...

    def kill(self) -> None: ...


# What a launcher starts rank r with: rank_main(*args), args = (main, config, model path, rank,
# the store's port, the rank's device).
RankArgs = tuple[RankMain, EngineConfig, Path, int, int, torch.device]


class RankLauncher(ABC):
    """Where ranks 1.. of an engine run, and which device each of them sees."""

    @abstractmethod
    def device(self, device: torch.device, rank: int, size: int) -> torch.device:
        """Rank `rank`'s device as its own process names it (`device`: the engine's)."""

    @abstractmethod
    def launch(self, ranks: list[RankArgs]) -> list[RankHandle]:
        """Start one rank per `RankArgs`, each running `rank_main(*args)`."""


class LocalProcesses(RankLauncher):
    """Ranks as processes of this host, started by rank 0 (torch.multiprocessing), each with rank
    0's environment of the moment."""

    def device(self, device: torch.device, rank: int, size: int) -> torch.device:
        return rank_device(device, rank, size)

    def launch(self, ranks: list[RankArgs]) -> list[RankHandle]:
        context = _rank_context()
        env = child_environment()
        processes = [
            context.Process(
                target=_local_rank, args=(env, *args), name=f"tandem-tp-rank-{args[3]}", daemon=True
            )
            for args in ranks
        ]
        for process in processes:
            process.start()
        return list(processes)


def _rank_context() -> Any:
    """Fork from a server that imported torch and the engine once, where there is one; a spawned
    rank imports them itself, ~2 s of a core each (a TP 4 engine of the tiny test model starts
    in 2.3 s against 5.0 spawned, Zen 4). The server is rank 0's child and ends with it."""
    if "forkserver" not in torch.multiprocessing.get_all_start_methods():
        return torch.multiprocessing.get_context("spawn")
    context = torch.multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context


def _local_rank(env: dict[str, str], *args: Any) -> None:
    """A local rank: rank 0's environment as it is now (the fork server's is as it was when it
    started), then `rank_main`."""
    take_environment(env)
    rank_main(*args)


class Ranks:
    """Ranks 1..t-1 of an engine, wherever their launcher runs them, and rank 0's group."""

    def __init__(self, group: TPGroup, handles: list[RankHandle], store: dist.Store) -> None:
        self.group = group
        self.handles = handles
        self._store = store  # the ranks' rendezvous and service hand-over; kept while they run
        self._last_sent = time.monotonic()  # of the last keep-alive
        self._finalizer = weakref.finalize(self, _stop, group, handles)

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        model_path: Path,
        main: RankMain,
        launcher: RankLauncher | None = None,
    ) -> Ranks:
        """Have `launcher` (default: local processes) start ranks 1.. running `main`, and join
        them as rank 0."""
        launcher = launcher or LocalProcesses()
        mc = config.model
        size, engine_device = mc.tensor_parallel_size, model_device(mc)
        device = launcher.device(engine_device, 0, size)
        store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=LOAD_TIMEOUT)
        port = store.port
        handles = launcher.launch(
            [
                (main, config, model_path, rank, port, launcher.device(engine_device, rank, size))
                for rank in range(1, size)
            ]
        )
        try:
            _await_started(store, handles)
            group = TPGroup.join(store, 0, size, device, mc.tp_timeout_s)
        except RuntimeError as e:
            _kill(handles)
            codes = [h.exitcode for h in handles]
            raise TensorParallelError(f"the ranks did not join (exit codes {codes}): {e}") from e
        return cls(group, handles, store)

    @property
    def healthy(self) -> bool:
        """Every rank is alive and no collective has failed."""
        return not self.group.broken and all(h.is_alive() for h in self.handles)

    def keep_alive(self) -> None:
        """Rank 0, idle: a keep-alive to the ranks if none went for KEEPALIVE_S; a failure (a
        dead rank) breaks the group (`healthy` turns False)."""
        if self.group.broken or time.monotonic() - self._last_sent < KEEPALIVE_S:
            return
        self._last_sent = time.monotonic()
        with contextlib.suppress(RuntimeError):  # the group is marked broken
            send_control(self.group, KEEPALIVE)
            acknowledge(self.group)  # a round trip: a stopped rank fails it within the timeout

    def start_service(self, service: RankService) -> list[RankLink]:
        """Have every rank 1.. run `service` (between steps, once) over its own KV cache;
        their links in rank order. Raises what a rank's service raised."""
        self._store.set(_SERVICE_KEY, pickle.dumps(service))  # type: ignore[arg-type]
        send_control(self.group, RUN_SERVICE)
        links = []
        for rank in range(1, self.group.size):
            started = pickle.loads(self._store.get(f"{_SERVICE_KEY}/{rank}"))
            if isinstance(started, BaseException):
                raise started
            orders, reports = _mailboxes(self._store, rank)
            alive = self.handles[rank - 1].is_alive
            links.append(RankLink(rank, started, orders, reports, alive))
        return links

    def stop(self) -> None:
        """Stop the ranks (once)."""
        self._finalizer()

    def kill(self) -> None:
        """Kill the ranks without a word to them (they may be stuck in a collective)."""
        self._finalizer.detach()
        _kill(self.handles)


def rank_main(
    main: RankMain,
    config: EngineConfig,
    model_path: Path,
    rank: int,
    port: int,
    device: torch.device,
) -> None:
    """A rank 1.., wherever its launcher started it: join the group, then `main`."""
    mc = config.model
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif mc.cpu_threads is not None:
        torch.set_num_threads(mc.cpu_threads)
    store = dist.TCPStore(HOST, port, is_master=False, timeout=LOAD_TIMEOUT)
    store.set(f"started/{rank}", "")
    group = TPGroup.join(store, rank, mc.tensor_parallel_size, device, mc.tp_timeout_s)
    started: list[RankContext] = []
    service = partial(_run_service, port, rank, mc.tensor_parallel_size, started)
    try:
        main(config, model_path, group, service)
    finally:
        for ctx in started:
            ctx.stop()


_SERVICE_KEY = "service"


def _mailboxes(
    store: dist.Store, rank: int, waiter: dist.Store | None = None
) -> tuple[Mailbox, Mailbox]:
    """Rank `rank`'s orders (from rank 0; `waiter`: the rank's connection to wait for them on)
    and reports (to it)."""
    name = f"{_SERVICE_KEY}/{rank}"
    return Mailbox(store, f"{name}/orders", waiter), Mailbox(store, f"{name}/reports")


def _run_service(
    port: int, rank: int, size: int, started: list[RankContext], caches: list[torch.Tensor]
) -> None:
    """Rank `rank`: start rank 0's service over `caches`, on store connections of its own (one
    to wait for orders on: `Mailbox.wait`; its context joins `started`); what it returns (or
    raises) goes back to rank 0."""
    store = dist.TCPStore(HOST, port, is_master=False, timeout=LOAD_TIMEOUT)
    waiter = dist.TCPStore(HOST, port, is_master=False, timeout=LOAD_TIMEOUT)
    service: RankService = pickle.loads(store.get(_SERVICE_KEY))
    orders, reports = _mailboxes(store, rank, waiter)
    ctx = RankContext(rank, size, caches, orders, reports)
    started.append(ctx)
    try:
        result = service(ctx)
    except Exception as e:
        result = e
    store.set(f"{_SERVICE_KEY}/{rank}", pickle.dumps(result))  # type: ignore[arg-type]


def _await_started(store: dist.Store, handles: list[RankHandle]) -> None:
    """Wait until every rank has reached the store; one that exits first (an import error, a
    bad environment) fails the start at once rather than after the timeout."""
    keys = [f"started/{rank}" for rank in range(1, len(handles) + 1)]
    deadline = time.monotonic() + LOAD_TIMEOUT.total_seconds()
    while not store.check(keys):
        for handle in handles:
            if not handle.is_alive():
                raise TensorParallelError(f"{handle.name} exited with code {handle.exitcode}")
        if time.monotonic() > deadline:
            raise TensorParallelError(f"the ranks did not start within {LOAD_TIMEOUT}")
        time.sleep(START_POLL_S)


def _stop(group: TPGroup, handles: list[RankHandle]) -> None:
    if not group.broken:  # else some rank is dead or stuck in a collective: kill them all
        # A rank already gone cannot take the message; the join below then finds it dead.
        with contextlib.suppress(RuntimeError):
            send_control(group, STOP)
        for handle in handles:
            handle.join(JOIN_SECONDS)
    _kill(handles)


def _kill(handles: list[RankHandle]) -> None:
    """Kill every rank (whatever its launcher keeps of it after its main returned goes too)."""
    for handle in handles:
        handle.kill()
    for handle in handles:
        handle.join(JOIN_SECONDS)
