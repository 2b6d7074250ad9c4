"""A tensor-parallel worker's ranks 1.. as Ray actors, one per bundle of the worker's placement
group (the worker actor, rank 0, holds bundle 0).

`RayActors` is the Ray launcher of tandem/engine/tp/ranks.py: rank r runs `rank_main` in its
actor, placed in bundle r with exactly that bundle's resources (one GPU on GPU nodes, the
worker's CPUs on CPU ones), and meets rank 0 on the loopback store rank 0 opened, so a TP
worker's bundles are packed on one node (`PoolSpec.placement_strategy`: STRICT_PACK). Rank 0
maps the ranks' CPU caches by their named files in /dev/shm (tandem/engine/shared_kv.py: a rank
actor is no child of rank 0, and a same-host prefill worker maps them too).

Lifetime: an actor lives as long as its rank's `run` (the engine's `close` stops the ranks and
kills their actors) and never outlives its worker: the worker actor owns it (Ray kills owned
actors with their owner), and removing the worker's placement group kills what it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tandem.engine.tp.ranks import RankArgs, RankHandle, RankLauncher, rank_main


class RankActor:
    """One rank 1.. of a worker in its own actor process."""

    def run(self, args: RankArgs) -> None:
        """The rank until rank 0 stops it."""
        rank_main(*args)


@dataclass
class ActorRank:
    """A rank actor and its running `run` (a `RankHandle`)."""

    name: str
    actor: Any
    done: Any  # ObjectRef of run()

    @property
    def exitcode(self) -> int | None:
        if self.is_alive():
            return None
        try:
            ray.get(self.done)
        except Exception:  # it raised, or its actor died
            return 1
        return 0

    def is_alive(self) -> bool:
        ready, _ = ray.wait([self.done], timeout=0)
        return not ready

    def join(self, timeout: float | None = None) -> None:
        ray.wait([self.done], timeout=timeout)

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)


@dataclass(frozen=True)
class RayActors(RankLauncher):
    """Ranks in bundles 1.. of `placement_group` (the caller, rank 0, runs in bundle 0)."""

    placement_group: PlacementGroup
    name: str  # the worker's: rank r's actor is named "{name}-rank-{r}"
    namespace: str

    def device(self, device: torch.device, rank: int, size: int) -> torch.device:
        """A GPU rank's actor sees only the GPU of its bundle (Ray sets CUDA_VISIBLE_DEVICES)."""
        bundles = len(self.placement_group.bundle_specs)
        if size > bundles:
            raise ValueError(
                f"tensor_parallel_size={size} needs {size} bundles (one per rank) in the "
                f"worker's placement group {self.name!r}, which has {bundles}"
            )
        return device if device.type == "cpu" else torch.device(device.type, 0)

    def launch(self, ranks: list[RankArgs]) -> list[RankHandle]:
        actor_class: Any = ray.remote(RankActor)
        handles: list[RankHandle] = []
        for args in ranks:
            rank = args[3]
            bundle = dict(self.placement_group.bundle_specs[rank])
            name = f"{self.name}-rank-{rank}"
            actor = actor_class.options(
                name=name,
                namespace=self.namespace,
                num_cpus=bundle.pop("CPU", 0.0),
                num_gpus=bundle.pop("GPU", 0.0),
                resources=bundle,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=rank
                ),
            ).remote()
            handles.append(ActorRank(name, actor, actor.run.remote(args)))
        return handles
