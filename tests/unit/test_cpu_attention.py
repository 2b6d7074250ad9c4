"""The compiled CPU attention kernel equals the SDPA path over the same paged cache, for every
cache format, block size and query shape it takes (split contexts and causal queries included),
at every instruction-set level the CPU runs."""

from __future__ import annotations

import random
from pathlib import Path
from unittest import mock

import pytest
import torch

from tandem.engine import attention, cpu_attention, native
from tandem.engine.attention import SeqSpec, TorchSDPABackend
from tandem.engine.kv_quant import encode

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 16

# (cache dtype, compute dtype, tolerance): the kernel computes in float32, SDPA in the compute dtype
FORMATS = [
    (torch.float32, torch.float32, 1e-5),
    (torch.bfloat16, torch.bfloat16, 2e-2),
    (torch.float16, torch.float16, 2e-3),
    (torch.int8, torch.float32, 1e-5),
    (torch.float8_e4m3fn, torch.float32, 1e-5),
]


pytestmark = pytest.mark.usefixtures("at_each_level")  # every level the CPU runs


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    library = native.library()
    assert library is not None, "the CPU kernel did not build (see the log)"
    # imported from its own build folder, keyed by the sources, torch and flags
    assert Path(library.__file__ or "").parent == native.build_dir()


def _run(
    shapes: list[tuple[int, int]],
    cache_dtype: torch.dtype,
    dtype: torch.dtype,
    block_size: int,
    head_dim: int = HEAD_DIM,
    sdpa_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batched group's output from the kernel and from SDPA (seeded inputs; SDPA in
    `sdpa_dtype`, default the queries' dtype)."""
    torch.manual_seed(0)
    num_blocks = sum(-(-(c + q) // block_size) for c, q in shapes) + 4
    free = list(range(num_blocks))
    random.Random(0).shuffle(free)
    seqs = []
    for computed, query_len in shapes:
        ctx = computed + query_len
        seqs.append(
            SeqSpec(computed, query_len, [free.pop() for _ in range(-(-ctx // block_size))])
        )
    cache = encode(torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, head_dim), cache_dtype)
    q = torch.randn(sum(n for _, n in shapes), NUM_HEADS * head_dim).to(dtype)
    backend = TorchSDPABackend(NUM_HEADS, NUM_KV_HEADS, head_dim, block_size)
    g = backend._batched_group(seqs, torch.device("cpu"))
    kernel = cpu_attention.paged_attention(
        q, cache, g.block_tables, g.context_lens, g.query_starts, head_dim, backend.scale
    )
    with mock.patch.object(cpu_attention, "runs_on", return_value=False):
        sdpa_group = backend._batched_group(seqs, torch.device("cpu"))
    sdpa = backend._batched(q.to(sdpa_dtype or dtype), cache, sdpa_group, NUM_HEADS // NUM_KV_HEADS)
    return kernel, sdpa


@pytest.mark.parametrize(("cache_dtype", "dtype", "tol"), FORMATS)
@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_kernel_matches_sdpa(
    cache_dtype: torch.dtype, dtype: torch.dtype, tol: float, block_size: int
) -> None:
    # decodes of different lengths, causal multi-token queries (verification), a fresh token
    shapes = [(37, 1), (5, 4), (0, 1), (70, 6), (16, 16)]
    kernel, sdpa = _run(shapes, cache_dtype, dtype, block_size)
    torch.testing.assert_close(kernel.float(), sdpa.float(), atol=tol, rtol=0)


@pytest.mark.parametrize("block_size", [4, 5, 16, 32])
def test_bfloat16_dot_products_of_wide_heads(block_size: int) -> None:
    """bfloat16 queries over a bfloat16 cache with heads 32, 64, 96 or 128 wide (SmolLM2's 64)
    take the bfloat16 dot products, where the CPU has them: exact products summed in float32 for
    the scores, the values widened to float32 and weighted by float32 softmax numerators. The
    output equals float64 attention over the same bfloat16 values up to its own rounding to
    bfloat16 (block size 5: a block's odd last token)."""
    shapes = [(37, 1), (5, 4), (0, 1), (70, 6), (16, 16), (3, 1)]
    kernel, exact = _run(shapes, torch.bfloat16, torch.bfloat16, block_size, 64, torch.float64)
    assert kernel.dtype == torch.bfloat16
    torch.testing.assert_close(kernel.double(), exact, atol=2e-3, rtol=2**-8)


@pytest.mark.parametrize("query_len", [1, 5])
def test_split_context_of_a_lone_request(query_len: int) -> None:
    """One request: its context is split into pieces (256 tokens) and the parts merged."""
    kernel, sdpa = _run([(300, query_len)], torch.float32, torch.float32, 16)
    torch.testing.assert_close(kernel, sdpa, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64])  # 64: bfloat16 takes its dot-product path
def test_a_verified_row_scores_as_a_decoded_one(
    dtype: torch.dtype, block_size: int, num_threads: int, head_dim: int
) -> None:
    """A query row verified among drafts (and beside other requests) gets, bit for bit, the output
    it gets decoded alone: contexts across the split points, any batch, any thread count."""
    torch.manual_seed(1)
    num_blocks = 1200 // block_size
    cache = torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, head_dim).to(dtype)
    table = torch.randperm(num_blocks).view(1, -1)
    scale = head_dim**-0.5
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        for context in (3, 250, 258, 513, 1000):
            query_len = min(6, context)
            q = torch.randn(query_len, NUM_HEADS * head_dim).to(dtype)
            other = torch.randn(1, NUM_HEADS * head_dim).to(dtype)
            # the verify step: this request's rows after another request's decode
            tables = torch.cat([table.roll(7, dims=1), table])
            verified = cpu_attention.paged_attention(
                torch.cat([other, q]),
                cache,
                tables,
                torch.tensor([900, context]),
                torch.tensor([0, 1, 1 + query_len]),
                head_dim,
                scale,
            )[1:]
            for i in range(query_len):
                decoded = cpu_attention.paged_attention(
                    q[i : i + 1],
                    cache,
                    table,
                    torch.tensor([context - query_len + 1 + i]),
                    torch.tensor([0, 1]),
                    head_dim,
                    scale,
                )
                assert torch.equal(decoded[0], verified[i]), (context, i)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("num_seqs", "query_len", "kernel"),
    [(2, 1, True), (2, attention.KERNEL_WORK_RATIO + 1, False), (1, 6, True)],
)
def test_backend_routes_steps(num_seqs: int, query_len: int, kernel: bool) -> None:
    """Decodes and a lone request take the kernel; a batch of long queries takes SDPA."""
    backend = TorchSDPABackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, 16)
    # equal contexts: rows x context over the padded context is the query length
    seqs = [SeqSpec(40, query_len, [0, 1, 2, 3]), SeqSpec(40, query_len, [4, 5, 6, 7])]
    seqs = seqs[:num_seqs]
    group = backend._batched_group(seqs, torch.device("cpu"))
    cache = torch.randn(2, 8, 16, NUM_KV_HEADS, HEAD_DIM)
    q = torch.randn(num_seqs * query_len, NUM_HEADS * HEAD_DIM)
    with mock.patch.object(
        cpu_attention, "paged_attention", wraps=cpu_attention.paged_attention
    ) as call:
        backend._batched(q, cache, group, NUM_HEADS // NUM_KV_HEADS)
    assert call.called == kernel


def test_blocks_larger_than_the_kernel_takes_go_to_sdpa() -> None:
    assert not cpu_attention.runs_on(torch.device("cpu"), cpu_attention.MAX_BLOCK_SIZE + 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_strided_queries_in_their_own_dtype(dtype: torch.dtype) -> None:
    """q as the attention layer hands it over: a view of the fused qkv rows, in the model dtype;
    the output comes in that dtype and equals the float32 queries' output, rounded."""
    torch.manual_seed(0)
    block_size, shapes = 16, [(37, 1), (70, 6), (0, 1)]
    tables = [[3, 4, 5], [6, 7, 8, 9, 10], [11]]
    seqs = [SeqSpec(c, n, t) for (c, n), t in zip(shapes, tables, strict=True)]
    cache = torch.randn(2, 12, block_size, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    qkv = torch.randn(8, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM).to(dtype)
    q = qkv[:, : NUM_HEADS * HEAD_DIM]
    g = TorchSDPABackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, block_size)._batched_group(
        seqs, torch.device("cpu")
    )
    args = (cache, g.block_tables, g.context_lens, g.query_starts, HEAD_DIM, HEAD_DIM**-0.5)
    got = cpu_attention.paged_attention(q, *args)
    want = cpu_attention.paged_attention(q.float().contiguous(), *args)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want.to(dtype), atol=0, rtol=0)
