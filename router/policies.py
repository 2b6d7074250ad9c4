"""Worker selection policies. Each picks one worker from the live ones of a pool.

- `round_robin`: in turn.
- `least_loaded`: fewest requests (this router's in-flight ones plus the worker's published
  queue); ties rotate.
- `power_of_two`: the less loaded of two random workers (near least-loaded, without every router
  piling onto the same worker between heartbeats).
- `prefix_aware`: the worker whose published prefix-cache summary holds the longest head of the
  prompt's block hashes; no hit, or a worker much busier than the least loaded one, falls back
  to least-loaded.
"""

from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.prefix_hash import block_hashes, prefix_key
from tandem.registry import WorkerRecord

POLICIES = ("round_robin", "least_loaded", "power_of_two", "prefix_aware")


@dataclass(frozen=True)
class PickContext:
    prompt_token_ids: Sequence[int]
    inflight: Counter[str]  # this router's requests in flight per worker id
    _keys: dict[int, list[int]] = field(default_factory=dict, compare=False)

    def prefix_keys(self, block_size: int) -> list[int]:
        """The prompt's chained block hashes at this block size, as workers publish them."""
        if block_size not in self._keys:
            hashes = block_hashes(self.prompt_token_ids, block_size)
            self._keys[block_size] = [prefix_key(h) for h in hashes]
        return self._keys[block_size]


def load(w: WorkerRecord, ctx: PickContext) -> tuple[int, int]:
    return ctx.inflight[w.worker_id] + w.waiting, -w.kv_blocks_free


class Policy(ABC):
    @abstractmethod
    def pick(self, workers: Sequence[WorkerRecord], ctx: PickContext) -> WorkerRecord:
        """`workers` is non-empty."""


class RoundRobin(Policy):
    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, workers: Sequence[WorkerRecord], ctx: PickContext) -> WorkerRecord:
        ordered = sorted(workers, key=lambda w: w.worker_id)
        return ordered[next(self._turn) % len(ordered)]


class LeastLoaded(Policy):
    """Ties (common at low load) rotate, so back-to-back requests spread over equal workers."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, workers: Sequence[WorkerRecord], ctx: PickContext) -> WorkerRecord:
        loads = {w.worker_id: load(w, ctx)[0] for w in workers}
        least = min(loads.values())
        ties = sorted(
            (w for w in workers if loads[w.worker_id] == least), key=lambda w: w.worker_id
        )
        return ties[next(self._turn) % len(ties)]


class PowerOfTwo(Policy):
    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def pick(self, workers: Sequence[WorkerRecord], ctx: PickContext) -> WorkerRecord:
        if len(workers) == 1:
            return workers[0]
        a, b = self._rng.sample(list(workers), 2)
        return min((a, b), key=lambda w: load(w, ctx))


class PrefixAware(Policy):
    def __init__(self, max_extra_load: int = 8) -> None:
        self.max_extra_load = max_extra_load  # tolerated queue excess for a cache hit
        self._fallback = LeastLoaded()

    def pick(self, workers: Sequence[WorkerRecord], ctx: PickContext) -> WorkerRecord:
        least = self._fallback.pick(workers, ctx)
        best, best_match = least, 0
        for w in workers:
            match = w.prefix_hit_blocks(ctx.prefix_keys(w.block_size))
            within = load(w, ctx)[0] - load(least, ctx)[0] <= self.max_extra_load
            if match > best_match and within:
                best, best_match = w, match
        return best


def make_policy(name: str) -> Policy:
    policies: dict[str, type[Policy]] = {
        "round_robin": RoundRobin,
        "least_loaded": LeastLoaded,
        "power_of_two": PowerOfTwo,
        "prefix_aware": PrefixAware,
    }
    if name not in policies:
        raise ValueError(f"routing policy must be one of {POLICIES}, got {name!r}")
    return policies[name]()
