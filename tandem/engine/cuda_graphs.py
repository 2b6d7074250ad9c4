"""CUDA graphs for decode and verify steps: buckets, padding, capture, replay.

A decode step of a small model on a GPU is bound by launching its kernels (hundreds per step),
not by running them; a CUDA graph launches the whole step at once. A graph is fixed in its
shapes and buffers, so one is captured per `GraphKey` (a bucket of requests x a query length:
1 for decodes, k + 1 for verifications of k drafts) over static input buffers, and a step is
padded up to the smallest key that holds it: padding tokens write their KV nowhere (slot -1) and
padding requests have no tokens and no context. Steps with a longer query (prefill chunks) or
more requests than the largest bucket run eagerly.

Lifecycle: built by the executor for a CUDA engine on the Triton backend (`ModelSettings.
cuda_graphs`); every key is captured at the first step that fits one (warm-up; a capture step
neither writes nor reads the cache), and again if the runner's KV tensors were swapped since
(`ModelRunner.use_kv_caches`); `run` replays, or returns None for the eager path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tandem.engine.attention import (
    PagedLists,
    PagedMetadata,
    SeqSpec,
    TritonPagedBackend,
    paged_lists,
)
from tandem.engine.models.llama import LlamaForCausalLM

PAD_SLOT = -1  # a padding token's slot: the KV store skips it


@dataclass(frozen=True, order=True)
class GraphKey:
    num_reqs: int  # the batch bucket
    query_len: int  # every request's query is at most this long

    @property
    def num_tokens(self) -> int:
        return self.num_reqs * self.query_len


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, then every multiple of 8 up to `max_num_seqs` (which is always a bucket)."""
    small = [b for b in (1, 2, 4) if b < max_num_seqs]
    return (*small, *range(8, max_num_seqs, 8), max_num_seqs)


def graph_keys(buckets: tuple[int, ...], query_lens: tuple[int, ...]) -> list[GraphKey]:
    return sorted(GraphKey(b, q) for b in buckets for q in set(query_lens))


def choose_key(keys: list[GraphKey], num_reqs: int, max_query_len: int) -> GraphKey | None:
    """The smallest key that holds `num_reqs` requests of queries up to `max_query_len`, or None
    (the step runs eagerly). Keys are sorted: the query length comes second, so the fewest
    padding tokens win among keys of the same bucket."""
    fits = [k for k in keys if k.num_reqs >= num_reqs and k.query_len >= max_query_len]
    return min(fits, key=lambda k: (k.num_tokens, k), default=None)


def pad_lists(lists: PagedLists, key: GraphKey) -> PagedLists:
    """The step's attention inputs padded to `key`: padding tokens take `PAD_SLOT`, padding
    requests no token, no context and an empty block table (the real rows keep their width)."""
    num_tokens, num_reqs = lists.query_starts[-1], len(lists.context_lens)
    if num_tokens > key.num_tokens or num_reqs > key.num_reqs:
        raise ValueError(f"a step of {num_reqs} requests, {num_tokens} tokens exceeds {key}")
    extra = key.num_reqs - num_reqs
    width = len(lists.block_tables[0]) if lists.block_tables else 0
    return PagedLists(
        lists.slot_mapping + [PAD_SLOT] * (key.num_tokens - num_tokens),
        lists.block_tables + [[0] * width for _ in range(extra)],
        lists.query_starts + [num_tokens] * extra,
        lists.context_lens + [0] * extra,
    )


def packed_size(key: GraphKey, max_blocks: int) -> int:
    return key.num_tokens + 2 * key.num_reqs + 1 + key.num_reqs * max_blocks


def packed_metadata(
    buffer: torch.Tensor, key: GraphKey, max_blocks: int, num_splits: int
) -> PagedMetadata:
    """The metadata a graph reads, as views of one int32 buffer of `packed_size`: slot mapping,
    query starts, context lengths, block tables `[num_reqs, max_blocks]`."""
    n, b = key.num_tokens, key.num_reqs
    slots, starts, lens, tables = buffer.split([n, b + 1, b, b * max_blocks])
    return PagedMetadata(
        slots, None, [], tables.view(b, max_blocks), starts, lens, key.query_len, num_splits
    )


def pack(lists: PagedLists, buffer: np.ndarray, key: GraphKey) -> None:
    """Write `lists` (padded to `key`) into `buffer` as `packed_metadata` reads it; a table's
    columns beyond its request's blocks keep what they held (never read)."""
    ints = lists.slot_mapping + lists.query_starts + lists.context_lens
    buffer[: len(ints)] = ints
    width = len(lists.block_tables[0])
    buffer[len(ints) :].reshape(key.num_reqs, -1)[:, :width] = lists.block_tables


class _Graph:
    """One captured step: its static inputs, its metadata (views of them), its output."""

    def __init__(
        self, key: GraphKey, max_blocks: int, num_splits: int, device: torch.device
    ) -> None:
        self.key = key
        n = key.num_tokens
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        # the metadata in one buffer, filled in pinned host memory and copied without waiting
        # (the step's one wait is for its sampled tokens)
        size = packed_size(key, max_blocks)
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=True)
        self.ints = torch.zeros(size, dtype=torch.int32, device=device)
        self.copied = torch.cuda.Event()  # the last copy out of `host`
        self.meta = packed_metadata(self.ints, key, max_blocks, num_splits)
        self.graph = torch.cuda.CUDAGraph()
        self.hidden: torch.Tensor | None = None  # [n, hidden], the graph's output

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, lists: PagedLists) -> None:
        """Copy a step (`lists` padded to this graph's key) into the static inputs."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:].zero_()
        self.load_lists(lists)

    def load_lists(self, lists: PagedLists) -> None:
        self.copied.synchronize()  # done long ago: the previous step waited for its tokens
        pack(lists, self.host.numpy(), self.key)
        self.ints.copy_(self.host, non_blocking=True)
        self.copied.record()


class CudaGraphs:
    """The decode / verify graphs of one model and its KV caches."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        buckets: tuple[int, ...],
        query_lens: tuple[int, ...],
        max_model_len: int,
    ) -> None:
        self.model = model
        self.keys = graph_keys(buckets, query_lens)
        self.block_size = model.backend.block_size
        self.max_blocks = -(-max_model_len // self.block_size)
        self._graphs: dict[GraphKey, _Graph] = {}
        self._kv_caches: list[torch.Tensor] | None = None  # the caches the graphs were captured on

    def run(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        seqs: list[SeqSpec],
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor | None:  # [num_tokens, hidden] as the model returns it; None: run eagerly
        key = choose_key(self.keys, len(seqs), max(s.query_len for s in seqs))
        if key is None:
            return None
        if kv_caches is not self._kv_caches:
            self.capture(kv_caches)
        graph = self._graphs[key]
        graph.load(input_ids, positions, pad_lists(paged_lists(seqs, self.block_size), key))
        graph.graph.replay()
        assert graph.hidden is not None
        # a copy: the next replay overwrites the graph's output
        return graph.hidden[: input_ids.shape[0]].clone()

    @torch.inference_mode()
    def capture(self, kv_caches: list[torch.Tensor]) -> None:
        """Capture every key's graph over `kv_caches`, largest first (they share one pool)."""
        self._graphs.clear()
        device = kv_caches[0].device
        backend = self.model.backend
        assert isinstance(backend, TritonPagedBackend), "CUDA graphs run on the Triton backend"
        pool = torch.cuda.graph_pool_handle()
        for key in sorted(self.keys, reverse=True):
            splits = backend.num_splits(key.num_reqs, key.query_len, device)
            graph = _Graph(key, self.max_blocks, splits, device)
            # Nothing to attend: every slot is padding, every request empty.
            graph.load_lists(pad_lists(PagedLists([], [], [0], []), key))
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):  # warm-up: compiles the kernels, fills caches
                self.model(graph.input_ids, graph.positions, kv_caches, graph.meta)
            torch.cuda.current_stream(device).wait_stream(stream)
            with torch.cuda.graph(graph.graph, pool=pool):
                graph.hidden = self.model(graph.input_ids, graph.positions, kv_caches, graph.meta)
            self._graphs[key] = graph
        self._kv_caches = kv_caches
