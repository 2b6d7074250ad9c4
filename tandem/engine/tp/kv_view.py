"""A tensor-parallel engine's KV cache as a worker's KV transfer sees it.

Per rank (the default transfer): `rank_heads` says which of the model's KV heads each rank
holds, and a `HeadWindow` is some of those heads of one rank's cache, which one stream of a
per-rank transfer reads (a prefill rank) or writes (a decode rank) in place.

The rank-0 path (`TransferConfig.per_rank=False`), below:

Each rank's cache holds its KV heads (`shard.py`). Rank 0 asks the ranks for their cache tensors
once (`Ranks.kv_caches`): torch.multiprocessing hands them over as shared memory on the
CPU, CUDA IPC openings on GPUs, so rank 0 reads and writes every rank's blocks in place. A layer
of the whole cache is then a `HeadShards`: the ranks' tensors of that layer and the whole model's
heads each holds. The KV transfer (`kv_transfer/layout.py`) gathers whole heads from it and
scatters whole heads into it, so the wire carries the whole model's heads in order whatever the
TP sizes of the two sides: fewer ranks to more splits heads, more to fewer assembles them, a
replicated head is read from one rank and written to all that hold it.

Ordering: rank 0 reads a layer once its own forward passed that layer, whose all-reduces every
rank joined after writing the layer's KV; it writes a request's blocks before the step that
reads them is broadcast.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.model_config import ModelConfig


def first_kv_heads(cfg: ModelConfig, size: int) -> list[int]:
    """Rank r's first KV head of the model of `cfg` split over `size` ranks (shard.py)."""
    heads = max(cfg.num_kv_heads // size, 1)
    if size <= cfg.num_kv_heads:
        return [r * heads for r in range(size)]
    return [r // (size // cfg.num_kv_heads) for r in range(size)]


def rank_heads(cfg: ModelConfig, size: int) -> list[range]:
    """The model's KV heads rank r holds, at [r], over `size` ranks (shard.py)."""
    count = max(cfg.num_kv_heads // size, 1)
    return [range(first, first + count) for first in first_kv_heads(cfg, size)]


@dataclass(frozen=True)
class HeadShards:
    """One layer of the whole KV cache as the ranks' tensors; shaped like one device's cache
    layer ([2, num_blocks, block_size, num_kv_heads, slot_dim]) where the transfer asks."""

    caches: tuple[torch.Tensor, ...]  # rank r's [2, num_blocks, block_size, heads_r, slot_dim]
    first_heads: tuple[int, ...]  # rank r's first head of the whole model's
    num_kv_heads: int  # the whole model's

    @property
    def shape(self) -> torch.Size:
        c = self.caches[0]
        return torch.Size((*c.shape[:3], self.num_kv_heads, c.shape[4]))

    @property
    def dtype(self) -> torch.dtype:
        return self.caches[0].dtype

    @property
    def device(self) -> torch.device:
        return self.caches[0].device  # rank 0's: where the transfer stages whole heads

    def element_size(self) -> int:
        return self.caches[0].element_size()

    def distinct(self) -> list[torch.Tensor]:
        """One rank's tensor per head range, in head order: each head once."""
        seen: dict[int, torch.Tensor] = {}
        for first, cache in zip(self.first_heads, self.caches, strict=True):
            seen.setdefault(first, cache)
        return [seen[first] for first in sorted(seen)]


@dataclass(frozen=True)
class HeadWindow:
    """Heads [first, first + count) of one rank's cache layer, shaped like a cache of `count`
    heads: what one stream of a per-rank transfer reads or writes (the heads one prefill rank
    sends one decode rank)."""

    # [2, num_blocks, block_size, heads, slot_dim]; read only where it is rank 0's view of
    # every rank (a prefill worker on the rank-0 path sending to a per-rank decode worker)
    cache: torch.Tensor | HeadShards
    first: int  # of the cache's own heads
    count: int

    @property
    def shape(self) -> torch.Size:
        c = self.cache
        return torch.Size((*c.shape[:3], self.count, c.shape[4]))

    @property
    def dtype(self) -> torch.dtype:
        return self.cache.dtype

    @property
    def device(self) -> torch.device:
        return self.cache.device

    def element_size(self) -> int:
        return self.cache.element_size()


# a layer of a worker's KV cache, as its transfer sees it
KVLayer = torch.Tensor | HeadShards | HeadWindow


def head_window(
    layers: Sequence[torch.Tensor | HeadShards], first: int, count: int
) -> list[KVLayer]:
    """Heads [first, first + count) of each of a rank's cache layers: the tensors themselves
    when that is all of their heads (the transfer's in-place row paths then apply)."""
    if first == 0 and count == layers[0].shape[3]:
        return list(layers)
    return [HeadWindow(layer, first, count) for layer in layers]


def whole_cache(rank_caches: list[list[torch.Tensor]], cfg: ModelConfig) -> list[HeadShards]:
    """Per layer, the ranks' tensors (`rank_caches[r][layer]`) of the model of `cfg`."""
    first = tuple(first_kv_heads(cfg, len(rank_caches)))
    return [
        HeadShards(tuple(layers), first, cfg.num_kv_heads)
        for layers in zip(*rank_caches, strict=True)
    ]
