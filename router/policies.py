"""Worker selection policies. Each picks one worker from the live ones of a pool.

- `round_robin`: in turn.
- `least_loaded`: fewest requests (this router's in-flight ones plus the worker's published
  queue), ties by free KV blocks.
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
from dataclasses import dataclass

from tandem.registry import WorkerRecord

POLICIES = ("round_robin", "least_loaded", "power_of_two", "prefix_aware")


@dataclass(frozen=True)
class PickContext:
    prefix_keys: Sequence[int]  # the prompt's chained block hashes (kv_cache.prefix_key)
    inflight: Counter[str]  # this router's requests in flight per worker id


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
    def pick(self, workers: Sequence[WorkerRecord], ctx: PickContext) -> WorkerRecord:
        return min(workers, key=lambda w: (load(w, ctx), w.worker_id))


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
            match = matched_blocks(ctx.prefix_keys, set(w.prefix_hashes))
            within = load(w, ctx)[0] - load(least, ctx)[0] <= self.max_extra_load
            if match > best_match and within:
                best, best_match = w, match
        return best


def matched_blocks(prefix_keys: Sequence[int], cached: set[int]) -> int:
    """How many leading blocks of the prompt the worker has cached."""
    n = 0
    for key in prefix_keys:
        if key not in cached:
            break
        n += 1
    return n


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
