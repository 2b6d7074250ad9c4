"""Prefill and decode pools as Ray actors, and the controller that sizes them.

Each worker is a Ray actor (`WorkerActor`) running a complete worker server (gRPC, engine loop,
KV endpoint, metrics, registration), placed in its own placement group: a GPU bundle set on GPU
nodes (`{"GPU": 1}` per tensor-parallel rank), a CPU bundle per rank on CPU-only machines. A
tensor-parallel worker's actor is its rank 0 and starts ranks 1.. as actors in the group's other
bundles (rank_actors.py); the worker is as healthy as all its ranks (`ping` says False once it
lost one), and it is replaced whole. Routers find workers through the registry, not through Ray.

The controller keeps each pool at its desired size. A worker slot's life:

    pending (its placement group waits for resources, or cannot fit this cluster: `reason`
      says which and how much; past `placement_timeout_s` the slot is dropped, the pool's
      desired size lowered by one and an error event recorded)
    -> starting (placement group reserved, actor loading the model) -> serving (answers pings)
      -> dead (actor gone, 3 missed pings, or a tensor-parallel rank lost): killed, placement
         group freed (with the rank actors in it), replaced
      -> draining (scale-down): the worker stops taking work, finishes what it has, deregisters;
         then its actor and placement group go

`reconcile()` does one pass (tests call it directly); the Ray actor `ControllerLoop` runs it
every `interval_s` on a thread, and optionally feeds the SLO autoscaler, with the pending workers
counted in each pool's size; a size set by hand (`scale`) holds the autoscaler off that pool for
its `manual_hold_s`, while `apply` carries out the autoscaler's own decisions.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from types import FrameType
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tandem.cluster.autoscaler import Autoscaler, AutoscalerConfig, Decision
from tandem.cluster.signals import ClusterSignals
from tandem.config import EngineConfig, WorkerConfig
from tandem.drain_signal import DrainSignal
from tandem.engine.spec.factory import prefill_speculative
from tandem.registry import ROLES, Registry

log = logging.getLogger(__name__)

CONTROLLER_NAME = "tandem-controller"
NAMESPACE = "tandem"
MISSED_PINGS = 3
MAX_EVENTS = 100  # error events a controller keeps


@dataclass(frozen=True)
class PoolSpec:
    cpus_per_worker: float = 1.0  # rank 0's (and, on CPU workers, each tensor-parallel rank's)
    gpus_per_worker: int = 0  # GPU bundles per worker, one per rank; 0 = CPU workers
    strategy: str = "PACK"  # placement within a worker's bundle set (one rank: see below)
    # Custom Ray resources a worker needs, e.g. {"tandem_prefill": 1} to keep it on the nodes of
    # the KubeRay worker group that advertises that resource.
    resources: dict[str, float] = field(default_factory=dict)
    tensor_parallel_size: int = 1  # ranks per worker: the worker actor and N-1 rank actors

    def __post_init__(self) -> None:
        tp, gpus = self.tensor_parallel_size, self.gpus_per_worker
        if tp < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
        if gpus and tp > gpus:
            raise ValueError(
                f"tensor_parallel_size={tp} needs {tp} GPUs per worker, one per rank; "
                f"gpus_per_worker={gpus}"
            )

    @property
    def placement_strategy(self) -> str:
        """`strategy`, but STRICT_PACK for a tensor-parallel worker: its ranks meet over
        loopback and rank 0 maps their KV caches in shared memory, so they share a node."""
        return "STRICT_PACK" if self.tensor_parallel_size > 1 else self.strategy

    def bundles(self) -> list[dict[str, float]]:
        """Bundle r holds rank r: the first one rank 0 (the worker actor) with the pool's
        resources, the others one GPU each (GPU workers) or the worker's CPUs (CPU workers)."""
        if self.gpus_per_worker:
            first = {"GPU": 1.0, "CPU": self.cpus_per_worker, **self.resources}
            return [first] + [{"GPU": 1.0}] * (self.gpus_per_worker - 1)
        first = {"CPU": self.cpus_per_worker, **self.resources}
        return [first] + [{"CPU": self.cpus_per_worker}] * (self.tensor_parallel_size - 1)


@dataclass(frozen=True)
class ClusterSpec:
    model: str
    registry_url: str
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig.create options
    decode_engine: dict[str, Any] = field(default_factory=dict)  # e.g. {"speculative": ...}
    host: str = "127.0.0.1"
    heartbeat_ttl_s: float = 3.0
    drain_timeout_s: float = 60.0
    placement_timeout_s: float = 300.0  # a worker that cannot be placed this long is dropped
    prefill: PoolSpec = field(default_factory=PoolSpec)
    decode: PoolSpec = field(default_factory=PoolSpec)

    def pool(self, role: str) -> PoolSpec:
        return self.prefill if role == "prefill" else self.decode


class WorkerActor:
    """One worker server inside a Ray actor process."""

    def __init__(self, role: str, spec: ClusterSpec, name: str) -> None:
        # Workers publish their own address: with a wildcard host (a pod that binds 0.0.0.0),
        # bind and advertise this node's IP, which routers and other workers can reach.
        host = spec.host if spec.host not in ("", "0.0.0.0") else ray.util.get_node_ip_address()
        options = dict(spec.engine)
        if role == "decode":
            options.update(spec.decode_engine)
        tp = spec.pool(role).tensor_parallel_size
        if tp > 1:  # a dead rank must fail the steps before the registry forgets the worker
            options.update(tensor_parallel_size=tp)
            options.setdefault("tp_timeout_s", spec.heartbeat_ttl_s / 2)
        speculative = options.pop("speculative", None)
        if role == "prefill":
            speculative = prefill_speculative(spec.decode_engine.get("speculative", speculative))
        config = WorkerConfig(
            EngineConfig.create(spec.model, speculative, **options),
            host=host,
            registry_url=spec.registry_url,
            heartbeat_ttl_s=spec.heartbeat_ttl_s,
        )
        # The actor's process: loads torch.
        from tandem.cluster.rank_actors import RayActors
        from tandem.cluster.workers import build_worker

        # Ranks 1.. in the other bundles of the group the controller placed this actor in
        # (an actor placed outside one starts them as local processes).
        pg = ray.util.get_current_placement_group()
        ranks = RayActors(pg, name, NAMESPACE) if tp > 1 and pg is not None else None
        self.server = build_worker(role, config, ranks)
        self.drain_timeout_s = spec.drain_timeout_s
        self._drain_lock = threading.Lock()  # one drain: SIGTERM's or the controller's
        self._drained = False
        self._ray_sigterm = signal.getsignal(signal.SIGTERM)
        self._sigterm = DrainSignal()
        if threading.current_thread() is threading.main_thread():  # a sync actor's: always
            signal.signal(signal.SIGTERM, self._on_sigterm)
            threading.Thread(
                target=self._drain_then_exit, name="drain-on-sigterm", daemon=True
            ).start()

    def info(self) -> dict[str, str]:
        return {"worker_id": self.server.worker_id, "endpoint": self.server.endpoint}

    def ping(self) -> bool:
        """Alive and healthy: False once the worker lost a tensor-parallel rank."""
        return not self.server.lost.is_set()

    def drain(self, timeout_s: float) -> None:
        """Drain the server, once: a second caller waits for the first drain to end."""
        with self._drain_lock:
            if not self._drained:
                self.server.drain(timeout_s)
                self._drained = True

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        """SIGTERM (its pod deleted, `ray stop`): put Ray's own handler back (a second SIGTERM
        ends the process at once) and set the flag `_drain_then_exit` waits for. Nothing more
        here: see `DrainSignal` for why a handler takes no lock."""
        signal.signal(signal.SIGTERM, self._ray_sigterm)
        self._sigterm.handle(signum, frame)

    def _drain_then_exit(self) -> None:
        """Once SIGTERM came: drain, then exit through Ray's handler. Ray's handler alone would
        exit at once and fail every request in flight. The main thread stays free meanwhile:
        the controller's pings are answered until the process exits, and then it replaces the
        worker."""
        self._sigterm.wait()
        log.info("SIGTERM: draining %s", self.server.worker_id)
        self.drain(self.drain_timeout_s)
        os.kill(os.getpid(), signal.SIGTERM)


@dataclass
class _Slot:
    role: str
    actor: Any
    pg: PlacementGroup
    ready: Any  # ObjectRef of info()
    worker_id: str = ""
    state: str = "pending"  # pending | starting | serving | draining
    reason: str = "placing"  # why it is pending (or starting)
    missed: int = 0
    drained: Any = None  # ObjectRef of drain()
    created: float = field(default_factory=time.monotonic)


class PoolController:
    def __init__(self, spec: ClusterSpec, prefill: int = 1, decode: int = 1) -> None:
        self.spec = spec
        self.desired = {"prefill": prefill, "decode": decode}
        self.slots: list[_Slot] = []
        self.replaced = 0
        self.events: list[dict[str, Any]] = []  # the last MAX_EVENTS errors, oldest first
        self._lock = threading.RLock()
        self._actor_class = ray.remote(max_concurrency=4)(WorkerActor)  # type: ignore[call-overload]

    # -- commands -----------------------------------------------------------------------------

    def scale(self, prefill: int | None = None, decode: int | None = None) -> dict[str, int]:
        with self._lock:
            for role, n in (("prefill", prefill), ("decode", decode)):
                if n is not None:
                    if n < 0:
                        raise ValueError(f"{role} must be >= 0, got {n}")
                    self.desired[role] = n
            return dict(self.desired)

    def drain(self, worker_id: str) -> bool:
        """Drain one worker; the pool then starts a replacement to stay at its size."""
        with self._lock:
            for slot in self.slots:
                if slot.worker_id == worker_id and slot.state == "serving":
                    self._start_drain(slot)
                    return True
        return False

    def status(self) -> list[dict[str, Any]]:
        with self._lock:
            return [
                {
                    "role": s.role,
                    "worker_id": s.worker_id,
                    "state": s.state,
                    "reason": s.reason if s.state in ("pending", "starting") else "",
                    "age_s": time.monotonic() - s.created,
                }
                for s in self.slots
            ]

    def recent_events(self) -> list[dict[str, Any]]:
        """The last error events (time, role, error), oldest first."""
        with self._lock:
            return list(self.events)

    def worker_actor(self, worker_id: str) -> Any:
        """The actor handle of a worker (for operators' tooling and fault-injection tests)."""
        with self._lock:
            return next((s.actor for s in self.slots if s.worker_id == worker_id), None)

    def apply(self, decision: Decision) -> None:
        """The autoscaler's decision (`scale` is the operator's)."""
        with self._lock:
            self.desired[decision.pool] = decision.target

    def pending(self, role: str) -> int:
        """Workers of `role` asked for and not serving yet (placing or loading the model)."""
        with self._lock:
            return sum(s.role == role and s.state in ("pending", "starting") for s in self.slots)

    # -- one pass -----------------------------------------------------------------------------

    def reconcile(self) -> None:
        with self._lock:
            for slot in list(self.slots):
                self._check(slot)
            for role in ROLES:
                active = [s for s in self.slots if s.role == role and s.state != "draining"]
                for _ in range(self.desired[role] - len(active)):
                    self.slots.append(self._start(role))
                extra = len(active) - self.desired[role]
                # Drain the newest first: still starting ones cost nothing to stop.
                for slot in sorted(active, key=lambda s: s.created, reverse=True)[: max(extra, 0)]:
                    self._start_drain(slot)

    def _start(self, role: str) -> _Slot:
        pool = self.spec.pool(role)
        name = f"tandem-{role}-{uuid.uuid4().hex[:8]}"
        pg = placement_group(pool.bundles(), strategy=pool.placement_strategy, name=name)
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
        actor = self._actor_class.options(
            num_cpus=pool.cpus_per_worker,
            num_gpus=1 if pool.gpus_per_worker else 0,
            resources=pool.resources,
            scheduling_strategy=strategy,
        ).remote(role, self.spec, name)
        log.info("starting a %s worker", role)
        return _Slot(role, actor, pg, actor.info.remote())

    def _check(self, slot: _Slot) -> None:
        if slot.state == "pending" and not self._placed(slot):
            return
        if slot.state == "starting":
            done, _ = ray.wait([slot.ready], timeout=0)
            if done:
                try:
                    slot.worker_id = ray.get(slot.ready)["worker_id"]
                    slot.state = "serving"
                except Exception as e:  # the actor died while loading
                    log.warning("%s worker failed to start: %s", slot.role, e)
                    self._remove(slot, replaced=True)
            return
        if slot.state == "draining":
            done, _ = ray.wait([slot.drained], timeout=0)
            if done:
                self._remove(slot)
            return
        ping = slot.actor.ping.remote()
        done, _ = ray.wait([ping], timeout=2.0)
        try:
            if done and ray.get(ping):
                slot.missed = 0
                return
            if done:  # it lost a tensor-parallel rank: replace the whole worker
                log.warning("worker %s lost a rank", slot.worker_id)
                slot.missed = MISSED_PINGS
            else:
                slot.missed += 1
        except Exception as e:
            log.warning("worker %s is dead: %s", slot.worker_id, e)
            slot.missed = MISSED_PINGS
        if slot.missed >= MISSED_PINGS:
            self._remove(slot, replaced=True)

    def _placed(self, slot: _Slot) -> bool:
        """Starting once its placement group is reserved; else why not, and dropped (an error
        event, the pool's desired size one lower) past the placement timeout."""
        if placement_group_table(slot.pg).get("state") == "CREATED":
            slot.state, slot.reason = "starting", "loading the model"
            return True
        slot.reason = placement_reason(
            self.spec.pool(slot.role).bundles(), ray.cluster_resources(), ray.available_resources()
        )
        waited = time.monotonic() - slot.created
        if waited < self.spec.placement_timeout_s:
            return False
        message = f"dropped a {slot.role} worker not placed in {waited:.0f} s: {slot.reason}"
        log.error("%s", message)
        self.events = [*self.events, {"time": time.time(), "role": slot.role, "error": message}]
        self.events = self.events[-MAX_EVENTS:]
        self.desired[slot.role] = max(self.desired[slot.role] - 1, 0)
        self._remove(slot)
        return False

    def _start_drain(self, slot: _Slot) -> None:
        if slot.state in ("pending", "starting"):
            self._remove(slot)
            return
        log.info("draining %s", slot.worker_id)
        slot.state = "draining"
        slot.drained = slot.actor.drain.remote(self.spec.drain_timeout_s)

    def _remove(self, slot: _Slot, replaced: bool = False) -> None:
        ray.kill(slot.actor, no_restart=True)
        remove_placement_group(slot.pg)
        self.slots.remove(slot)
        if replaced:
            self.replaced += 1


def placement_reason(
    bundles: list[dict[str, float]], total: dict[str, float], free: dict[str, float]
) -> str:
    """Why a worker's bundles are not placed: a resource the whole cluster has too little of
    (infeasible: it waits for the cluster to grow), or one that is taken now."""
    need: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            need[name] = need.get(name, 0.0) + amount
    short = {k: v for k, v in need.items() if v > total.get(k, 0.0)}
    if short:
        has = ", ".join(f"{k} {total.get(k, 0.0):g}" for k in short)
        return f"infeasible on this cluster: needs {_amounts(short)}, the cluster has {has}"
    taken = {k: v for k, v in need.items() if v > free.get(k, 0.0)}
    if taken:
        left = ", ".join(f"{k} {free.get(k, 0.0):g}" for k in taken)
        return f"waiting for resources: needs {_amounts(taken)}, free {left}"
    return "placing"


def _amounts(resources: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in resources.items())


class ControllerLoop(PoolController):
    """The controller as a Ray actor: reconciles on a thread; optionally autoscales."""

    def __init__(
        self,
        spec: ClusterSpec,
        prefill: int = 1,
        decode: int = 1,
        interval_s: float = 1.0,
        autoscale: AutoscalerConfig | None = None,
        dry_run: bool = False,
    ) -> None:
        super().__init__(spec, prefill, decode)
        self.interval_s = interval_s
        self.autoscaler = Autoscaler(autoscale) if autoscale is not None else None
        self.dry_run = dry_run
        self.decisions: list[Decision] = []
        self._signals = (
            ClusterSignals(Registry(spec.registry_url), spec.model)
            if autoscale is not None
            else None
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reconcile", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.reconcile()
                self._autoscale()
            except Exception:
                log.exception("reconcile failed")

    def scale(self, prefill: int | None = None, decode: int | None = None) -> dict[str, int]:
        """An operator's size, which the autoscaler then holds for its `manual_hold_s`."""
        with self._lock:
            sizes = super().scale(prefill, decode)
            for role, n in (("prefill", prefill), ("decode", decode)):
                if n is not None and self.autoscaler is not None:
                    self.autoscaler.hold(role, time.monotonic())
            return sizes

    def _autoscale(self) -> None:
        if self.autoscaler is None or self._signals is None:
            return
        observed = self._signals.observe()  # scrapes the workers: outside the lock
        with self._lock:
            metrics = replace(
                observed,
                pending_prefill=self.pending("prefill"),
                pending_decode=self.pending("decode"),
            )
            decisions = self.autoscaler.observe(metrics)
        for decision in decisions:
            log.info(
                "autoscaler%s: %s %d -> %d (%s) inputs=%s",
                " (dry run)" if self.dry_run else "",
                decision.pool,
                decision.current,
                decision.target,
                decision.reason,
                decision.inputs,
            )
            self.decisions.append(decision)
            if not self.dry_run:
                self.apply(decision)

    def ready(self) -> bool:
        """True once every pool has its desired number of serving workers."""
        with self._lock:
            for role in ROLES:
                states = [s.state for s in self.slots if s.role == role]
                if states != ["serving"] * self.desired[role]:
                    return False
            return True

    def shutdown(self) -> None:
        """Stop reconciling, drain every serving worker at once (up to the drain timeout: the
        routers of other processes may still have requests on them), then remove them all."""
        self._stop.set()
        self._thread.join(5.0)
        with self._lock:
            for slot in list(self.slots):
                if slot.state != "draining":
                    self._start_drain(slot)  # one not serving yet goes at once
            drained = [s.drained for s in self.slots]
            if drained:
                ray.wait(drained, num_returns=len(drained), timeout=self.spec.drain_timeout_s)
            for slot in list(self.slots):
                self._remove(slot)


def start_controller(
    spec: ClusterSpec,
    prefill: int,
    decode: int,
    autoscale: AutoscalerConfig | None = None,
    dry_run: bool = False,
    interval_s: float = 1.0,
) -> Any:
    """The named controller actor (one per Ray namespace)."""
    actor_class = ray.remote(num_cpus=0, max_concurrency=8)(ControllerLoop)  # type: ignore[call-overload]
    return actor_class.options(name=CONTROLLER_NAME, namespace=NAMESPACE, lifetime=None).remote(
        spec, prefill, decode, interval_s, autoscale, dry_run
    )


def get_controller() -> Any:
    return ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
