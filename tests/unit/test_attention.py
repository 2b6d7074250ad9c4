"""The SDPA backend over paged KV equals plain causal attention over contiguous K/V."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.engine.attention import MAX_BATCHED_QUERY_LEN, SeqSpec, TorchSDPABackend

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 8, 4, 64


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_computed: int) -> torch.Tensor:
    """q: [n, H, D] for positions num_computed.. ; k, v: [ctx, Hkv, D] for positions 0..ctx-1."""
    group = NUM_HEADS // NUM_KV_HEADS
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * HEAD_DIM**-0.5
    q_pos = torch.arange(q.shape[0])[:, None] + num_computed
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize(
    "shapes",
    [
        [(0, 1)],  # one fresh token
        [(7, 1), (12, 1), (3, 1)],  # decodes of different context lengths
        [(8, 1), (8, 1)],  # equal-length decodes (the unmasked path)
        [(5, 4), (0, 3), (9, 1)],  # short queries of different lengths (padded)
        [(10, 1), (0, 40), (23, 30)],  # decodes plus long prefill chunks, fresh and continued
    ],
)
def test_paged_attention_matches_reference(shapes: list[tuple[int, int]]) -> None:
    torch.manual_seed(0)
    rng = random.Random(0)
    backend = TorchSDPABackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE)
    kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)  # block tables are not contiguous
    seqs, full_k, full_v = [], [], []
    for num_computed, query_len in shapes:
        ctx = num_computed + query_len
        table = [free.pop() for _ in range(-(-ctx // BLOCK_SIZE))]
        k = torch.randn(ctx, NUM_KV_HEADS, HEAD_DIM)
        v = torch.randn(ctx, NUM_KV_HEADS, HEAD_DIM)
        for pos in range(num_computed):  # the context already in the cache
            block, offset = table[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            kv_cache[0, block, offset], kv_cache[1, block, offset] = k[pos], v[pos]
        seqs.append(SeqSpec(num_computed, query_len, table))
        full_k.append(k)
        full_v.append(v)
    # The runner puts short queries first.
    order = sorted(range(len(seqs)), key=lambda i: seqs[i].query_len > MAX_BATCHED_QUERY_LEN)
    seqs = [seqs[i] for i in order]
    full_k = [full_k[i] for i in order]
    full_v = [full_v[i] for i in order]
    qs = [torch.randn(s.query_len, NUM_HEADS, HEAD_DIM) for s in seqs]
    new_k = torch.cat([k[s.num_computed_tokens :] for s, k in zip(seqs, full_k, strict=True)])
    new_v = torch.cat([v[s.num_computed_tokens :] for s, v in zip(seqs, full_v, strict=True)])

    meta = backend.build_metadata(seqs, torch.device("cpu"))
    out = backend.forward(
        torch.cat(qs).flatten(1), new_k.flatten(1), new_v.flatten(1), kv_cache, meta
    )

    start = 0
    for s, q, k, v in zip(seqs, qs, full_k, full_v, strict=True):
        expected = reference(q, k, v, s.num_computed_tokens).flatten(1)
        torch.testing.assert_close(out[start : start + s.query_len], expected, atol=1e-5, rtol=0)
        start += s.query_len
