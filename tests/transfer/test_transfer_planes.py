"""A bare KVSender and KVReceiver in two processes, over small random caches: layout and dtype
conversion on every plane, and many transfers at once; and, in one process, a failure on a shared
pair does not spread to the other transfers on it, and the trailer carries the first token with
its logprobs."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
from harness import WorkerProcess

from kv_transfer import Arrival, KVLayout, KVReceiver, KVSender, TransferState
from kv_transfer.layout import slot_mapping
from tandem.outputs import TokenLogprobs

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.timeout(60)]

CHANNELS = ["grpc", "pair", "shm"]
TRANSFERRING = TransferState.TRANSFERRING


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def assert_untouched_outside(
    decode: WorkerProcess, layout: KVLayout, num_blocks: int, tables: list[tuple[list[int], int]]
) -> None:
    """The receiver's cache is zero in every slot no reservation names."""
    all_slots = num_blocks * layout.block_size
    (everything,) = decode.call("gather", "rx", [(list(range(num_blocks)), all_slots)])
    written = torch.zeros(all_slots, dtype=torch.bool)
    for blocks, n in tables:
        written[slot_mapping(blocks, layout.block_size, n, torch.device("cpu"))] = True
    for layer in everything:  # [2, all_slots, heads, dim]
        assert int(layer[:, ~written].count_nonzero()) == 0


@pytest.mark.parametrize("channel", CHANNELS)
@pytest.mark.parametrize("src_dtype, dst_dtype", [("bfloat16", "float32"), ("float32", "bfloat16")])
def test_block_sizes_and_dtypes_convert(
    prefill_proc: WorkerProcess,
    decode_proc: WorkerProcess,
    channel: str,
    src_dtype: str,
    dst_dtype: str,
) -> None:
    src = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, block_size=4, dtype=src_dtype)
    dst = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, block_size=8, dtype=dst_dtype)
    decode_proc.call("kv_receiver", "rx", dst, num_blocks=16, shm=channel == "shm")
    prefill_proc.call("kv_sender", "tx", src, num_blocks=32, seed=0, channel=channel)
    n = 27  # a partial last block on both sides
    src_blocks, dst_blocks = [9, 2, 30, 17, 4, 21, 8], [5, 0, 11, 3]
    (ticket,) = decode_proc.call("expect", "rx", [("r", dst_blocks, n)])
    prefill_proc.call("send", "tx", [ticket], [src_blocks])
    assert prefill_proc.call("outcomes", "tx", 1) == {"r": ("success", None, channel)}
    assert decode_proc.call("outcomes", "rx", 1) == {"r": ("success", None, 0)}

    (sent,) = prefill_proc.call("gather", "tx", [(src_blocks, n)])
    (got,) = decode_proc.call("gather", "rx", [(dst_blocks, n)])
    for layer, (a, b) in enumerate(zip(sent, got, strict=True)):
        assert a.dtype == src.torch_dtype and b.dtype == dst.torch_dtype
        assert torch.equal(b, a.to(b.dtype)), f"layer {layer}"
    assert_untouched_outside(decode_proc, dst, 16, [(dst_blocks, n)])


@pytest.mark.parametrize("channel", CHANNELS)
def test_64_concurrent_transfers_arrive_intact(
    prefill_proc: WorkerProcess, decode_proc: WorkerProcess, channel: str
) -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="float32")
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 49, (64,), generator=g).tolist()
    need = [-(-n // layout.block_size) for n in lengths]
    # Receiver: disjoint blocks in a shuffled order. Sender: any blocks of its pool, shared
    # between requests as a prefix cache shares them (reads only).
    dst_pool = torch.randperm(sum(need) + 8, generator=g).tolist()
    starts = [sum(need[:i]) for i in range(64)]
    dst_tables = [(dst_pool[s : s + k], n) for s, k, n in zip(starts, need, lengths, strict=True)]
    src_tables = [
        (torch.randperm(64, generator=g)[:k].tolist(), n)
        for k, n in zip(need, lengths, strict=True)
    ]
    decode_proc.call("kv_receiver", "rx", layout, num_blocks=len(dst_pool), shm=channel == "shm")
    prefill_proc.call("kv_sender", "tx", layout, num_blocks=64, seed=1, channel=channel)

    rids = [f"r{i}" for i in range(64)]
    requests = [(rid, blocks, n) for rid, (blocks, n) in zip(rids, dst_tables, strict=True)]
    tickets = decode_proc.call("expect", "rx", requests)
    prefill_proc.call("send", "tx", tickets, [blocks for blocks, _ in src_tables])
    sent_outcomes = prefill_proc.call("outcomes", "tx", 64, within=30.0)
    arrivals = decode_proc.call("outcomes", "rx", 64, within=30.0)
    assert sent_outcomes == {r: ("success", None, channel) for r in rids}
    assert arrivals == {r: ("success", None, i) for i, r in enumerate(rids)}

    sent = prefill_proc.call("gather", "tx", src_tables)
    got = decode_proc.call("gather", "rx", dst_tables)
    for rid, a, b in zip(rids, sent, got, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), rid
    assert_untouched_outside(decode_proc, layout, len(dst_pool), dst_tables)


def test_a_failed_transfer_leaves_its_neighbours_on_the_pair_alone() -> None:
    # One process is enough to show it: the pair is shared by design, the drop is the sender's.
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
    shape = (2, 8, layout.block_size, layout.num_kv_heads, layout.head_dim)
    src = [torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    receiver = KVReceiver([torch.zeros(shape) for _ in range(2)], "fp")
    sender = KVSender("fp", channel="pair")
    try:
        doomed = sender.begin(receiver.expect("doomed", [0, 1], 8), src)
        neighbour = sender.begin(receiver.expect("neighbour", [2, 3], 8), src)
        for transfer, blocks in ((doomed, [4, 5]), (neighbour, [6, 7])):
            transfer.set_source(blocks)
            transfer.layer_ready(0)
        wait_until(lambda: doomed.status.state == neighbour.status.state == TRANSFERRING)
        assert doomed.plane_name == neighbour.plane_name == "pair"
        receiver.cancel("doomed")
        assert doomed.wait(5.0) == TransferState.FAILED
        neighbour.layer_ready(1)
        neighbour.finish(7)
        assert neighbour.wait(5.0) == TransferState.SUCCESS, neighbour.status.error
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize(
    "logprobs", [None, TokenLogprobs(7, -0.25, 2, (3, 7), (-0.125, -0.25))], ids=["none", "top2"]
)
def test_the_trailer_carries_the_first_token_and_its_logprobs_and_the_prompt_s(
    logprobs: TokenLogprobs | None,
) -> None:
    shape = (2, 4, 4, 2, 8)  # [2, num_blocks, block_size, heads, dim]
    receiver = KVReceiver([torch.zeros(shape)], "fp")
    sender = KVSender("fp", channel="grpc")
    try:
        transfer = sender.begin(receiver.expect("r", [0], 4), [torch.randn(shape)])
        transfer.set_source([1])
        transfer.all_layers_ready()
        prompt = [TokenLogprobs(t, -1.5, 3, (), ()) for t in (5, 6, 9)]
        transfer.finish(7, logprobs, prompt_logprobs=prompt)
        assert transfer.wait(5.0) == TransferState.SUCCESS, transfer.status.error
        arrivals: list[Arrival] = []

        def arrived() -> bool:
            arrivals.extend(receiver.poll())
            return bool(arrivals)

        wait_until(arrived)
        (arrival,) = arrivals
        assert (arrival.first_token, arrival.logprobs) == (7, logprobs)
        assert arrival.prompt_logprobs == prompt  # the prompt's, with the first token
    finally:
        sender.close()
        receiver.close()
