"""A tensor-parallel engine's KV cache as a worker's KV transfer sees it.

Each rank moves its own KV heads (docs/kv_transfer.md): `rank_heads` says which of the model's
KV heads each rank holds (`shard.py`), and a `HeadWindow` is some of those heads of one rank's
cache, which one stream of a per-rank transfer reads (a prefill rank) or writes (a decode rank)
in place.
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
class HeadWindow:
    """Heads [first, first + count) of one rank's cache layer, shaped like a cache of `count`
    heads: what one stream of a per-rank transfer reads or writes (the heads one prefill rank
    sends one decode rank)."""

    cache: torch.Tensor  # [2, num_blocks, block_size, heads, slot_dim]
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
KVLayer = torch.Tensor | HeadWindow


def head_window(layers: Sequence[torch.Tensor], first: int, count: int) -> list[KVLayer]:
    """Heads [first, first + count) of each of a rank's cache layers: the tensors themselves
    when that is all of their heads (the transfer's in-place row paths then apply)."""
    if first == 0 and count == layers[0].shape[3]:
        return list(layers)
    return [HeadWindow(layer, first, count) for layer in layers]
