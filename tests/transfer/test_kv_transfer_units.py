"""kv_transfer's pure parts: slot mappings and layout conversion, the transfer state machine,
tickets on the wire, and the fault-injecting plane."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kv_transfer import FailureCause, KVLayout, KVTicket, TransferError, TransferState, layout
from kv_transfer.fake import FaultyPlane, at_layer
from kv_transfer.fanout import RankStream, rank_streams
from kv_transfer.layout import (
    as_bytes,
    from_bytes,
    gather_tokens,
    plan_copy,
    plan_layer_copy,
    scatter_tokens,
    slot_mapping,
)
from kv_transfer.planes import DataPlane
from kv_transfer.state import TransferStatus
from kv_transfer.ticket import DecodeRank
from kv_transfer.wire import layer_message, parse_chunk
from tandem.engine.tp.kv_view import HeadWindow, head_window
from tandem.v1 import kv_transfer_pb2 as pb

CPU = torch.device("cpu")
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")


def paged(num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One layer's zeroed cache [2, num_blocks, block_size, heads, dim]."""
    return torch.zeros(2, num_blocks, block_size, 2, 8, dtype=dtype)


# -- layout ------------------------------------------------------------------------------------


def test_slot_mapping_follows_the_block_table() -> None:
    slots = slot_mapping([7, 2, 5], block_size=4, num_tokens=10, device=CPU)
    assert slots.tolist() == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21]
    assert slot_mapping([3], block_size=4, num_tokens=0, device=CPU).tolist() == []


def test_gather_then_scatter_across_block_sizes_round_trips() -> None:
    n = 11
    g = torch.Generator().manual_seed(0)
    src = torch.randn(2, 8, 4, 2, 8, generator=g)  # block size 4
    src_slots = slot_mapping([6, 1, 3], 4, n, CPU)
    wire = gather_tokens(src, src_slots)
    assert wire.shape == (2, n, 2, 8) and wire.is_contiguous()
    assert torch.equal(wire[:, 4], src[:, 1, 0])  # token 4 is the first of the second block

    dst = paged(5, block_size=16)  # one bigger block holds them all
    dst_slots = slot_mapping([2], 16, n, CPU)
    scatter_tokens(dst, dst_slots, wire)
    assert torch.equal(gather_tokens(dst, dst_slots), wire)
    assert int(dst[:, 2, n:].count_nonzero()) == 0  # the block's tail stays untouched
    assert int(dst[:, [0, 1, 3, 4]].count_nonzero()) == 0


@pytest.mark.parametrize("copier", ["native", "numpy"])  # csrc/copy_rows.cpp, or NumPy's
@pytest.mark.parametrize("max_runs", [0, 64])  # NumPy: 0, indexed copies; 64, slices of runs
@pytest.mark.parametrize(
    ("src_blocks", "dst_blocks", "dst_block_size"),
    [
        ([0, 1, 2, 3], [4, 5, 6, 7], 4),  # consecutive on both sides
        ([6, 1, 3, 0], [2, 7, 4, 5], 4),  # scattered, blocks line up
        ([6, 1, 3, 0], [3, 1], 8),  # scattered, another block size
    ],
)
def test_copy_and_gather_scatter_paths_agree(
    monkeypatch: pytest.MonkeyPatch,
    copier: str,
    max_runs: int,
    src_blocks: list[int],
    dst_blocks: list[int],
    dst_block_size: int,
) -> None:
    if copier == "native":
        assert layout._native() is not None, "the native extension did not build (see the log)"
    else:
        monkeypatch.setattr(layout, "_native", lambda: None)
    monkeypatch.setattr(layout, "MAX_SLICE_RUNS", max_runs)
    n = 14  # the last source block is partial
    src = torch.randn(2, 8, 4, 2, 8, generator=torch.Generator().manual_seed(2))
    src_slots = slot_mapping(src_blocks, 4, n, CPU)
    expected = src.view(2, -1, 2, 8)[:, src_slots]  # [2, n, heads, dim]
    wire = gather_tokens(src, src_slots)
    assert torch.equal(wire, expected) and wire.is_contiguous()  # a pair sends it as it is
    staging = torch.full_like(expected, -1.0)  # a pair's reused staging tensor
    assert gather_tokens(src, src_slots, out=staging) is staging
    assert torch.equal(staging, expected)

    num_dst_blocks = 32 // dst_block_size
    dst_slots = slot_mapping(dst_blocks, dst_block_size, n, CPU)
    copied, scattered = paged(num_dst_blocks, dst_block_size), paged(num_dst_blocks, dst_block_size)
    plan_copy(src, src_slots, copied, dst_slots)(src, copied)
    scatter_tokens(scattered, dst_slots, expected)
    for dst in (copied, scattered):
        assert torch.equal(gather_tokens(dst, dst_slots), expected)
        others = [b for b in range(num_dst_blocks) if b not in dst_blocks]
        assert int(dst[:, others].count_nonzero()) == 0  # nothing outside the reservation


@pytest.mark.parametrize("copier", ["native", "numpy"])
@pytest.mark.parametrize("layers", [range(0, 5), range(2, 3), range(1, 4)])
def test_layer_copy_writes_the_layers_asked_and_stops_at_its_time(
    monkeypatch: pytest.MonkeyPatch, copier: str, layers: range
) -> None:
    """Runs of layers split over the copy threads (native) or copied one by one (NumPy) land
    exactly where plan_copy puts one layer; none starts at or past `until`."""
    if copier == "numpy":
        monkeypatch.setattr(layout, "_native", lambda: None)
    monkeypatch.setattr(layout, "PARALLEL_BYTES", 0)
    monkeypatch.setattr(layout, "COPY_THREADS", 2)
    n, gen = 14, torch.Generator().manual_seed(4)
    src = [torch.randn(2, 8, 4, 2, 8, generator=gen) for _ in range(5)]
    src_slots = slot_mapping([6, 1, 3, 0], 4, n, CPU)
    dst_slots = slot_mapping([2, 7, 4, 5], 4, n, CPU)
    dst = list(torch.zeros(5, 2, 8, 4, 2, 8).unbind(0))  # one storage, as a shared cache
    copy = plan_layer_copy(src, src_slots, dst, dst_slots)
    assert not copy(layers, time.monotonic() - 1.0)
    assert all(int(d.count_nonzero()) == 0 for d in dst)  # past its time: nothing written
    assert copy(layers, time.monotonic() + 60.0)
    for i in range(5):
        expected = gather_tokens(src[i], src_slots) if i in layers else torch.zeros(2, n, 2, 8)
        assert torch.equal(gather_tokens(dst[i], dst_slots), expected), f"layer {i}"
    others = [b for b in range(8) if b not in (2, 7, 4, 5)]
    assert all(int(d[:, others].count_nonzero()) == 0 for d in dst)


@pytest.mark.usefixtures("one_thread")  # torch's own OpenMP team does not survive a fork
def test_parallel_copies_run_in_a_forked_child_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Copy threads belong to a process: a child forked after a parallel copy makes its own
    (the parent's pool would take its work and never run it)."""
    monkeypatch.setattr(layout, "MAX_SLICE_RUNS", 0)
    monkeypatch.setattr(layout, "PARALLEL_BYTES", 0)
    monkeypatch.setattr(layout, "COPY_THREADS", 2)
    n = 4096  # long enough that the parent's copy starts both threads
    wire = torch.randn(2, n, 2, 8, generator=torch.Generator().manual_seed(3))
    slots = slot_mapping(list(range(n // 4 - 1, -1, -1)), 4, n, CPU)

    def copy() -> None:
        cache = paged(n // 4, 4)
        scatter_tokens(cache, slots, wire)
        assert torch.equal(gather_tokens(cache, slots), wire)

    copy()
    child = multiprocessing.get_context("fork").Process(target=copy)
    child.start()
    child.join(20)
    assert child.exitcode == 0


@pytest.mark.parametrize(
    "src, dst", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)]
)
def test_scatter_casts_to_the_cache_dtype(src: torch.dtype, dst: torch.dtype) -> None:
    wire = torch.randn(2, 5, 2, 8, generator=torch.Generator().manual_seed(1)).to(src)
    cache = paged(2, block_size=4, dtype=dst)
    slots = slot_mapping([1, 0], 4, 5, CPU)
    scatter_tokens(cache, slots, wire)
    assert torch.equal(gather_tokens(cache, slots), wire.to(dst))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bytes_round_trip(dtype: torch.dtype) -> None:
    t = torch.randn(2, 3, 2, 8, generator=torch.Generator().manual_seed(2)).to(dtype)
    data = as_bytes(t)
    assert len(data) == t.numel() * t.element_size()
    back = from_bytes(bytearray(data), dtype, tuple(t.shape))
    assert back.dtype == dtype and torch.equal(back, t)
    assert from_bytes(b"", dtype, (2, 0, 2, 8)).shape == (2, 0, 2, 8)


def test_as_bytes_of_a_non_contiguous_tensor_is_its_values_in_order() -> None:
    t = torch.arange(12, dtype=torch.float32).view(3, 4).t()
    assert torch.equal(from_bytes(bytearray(as_bytes(t)), torch.float32, (4, 3)), t)


# -- tickets and layouts -----------------------------------------------------------------------


def test_layout_of_caches_and_its_wire_size() -> None:
    caches = [paged(3, block_size=4, dtype=torch.bfloat16) for _ in range(2)]
    layout = KVLayout.of(caches)
    assert layout == KVLayout(2, 2, 8, 4, "bfloat16")
    assert layout.layer_nbytes(5) == 2 * 5 * 2 * 8 * 2


def test_layout_mismatch_allows_block_size_and_dtype_only() -> None:
    assert LAYOUT.mismatch(KVLayout(2, 2, 8, 16, "bfloat16")) is None
    assert (
        LAYOUT.mismatch(KVLayout(3, 2, 8, 4, "float32")) == "num_layers: receiver has 2, sender 3"
    )
    assert "num_kv_heads" in (LAYOUT.mismatch(KVLayout(2, 4, 8, 4, "float32")) or "")
    assert "head_dim" in (LAYOUT.mismatch(KVLayout(2, 2, 16, 4, "float32")) or "")


def test_ticket_proto_round_trip() -> None:
    ticket = KVTicket(
        request_key="req-1",
        endpoint="10.0.0.2:5555",
        block_ids=(9, 0, 4),
        layout=LAYOUT,
        model_fingerprint="abc123",
        num_tokens=11,
        host_id="host/boot",
        shared_cache="/dev/shm/tandem-kv-x",
        pair_store="10.0.0.2:6000",
        timeout_s=2.5,
        ranks=(DecodeRank(0, 1, "h:1", "h:2", "sock", "/dev/shm/a"), DecodeRank(1, 1, "h:3")),
    )
    wire = ticket.to_proto().SerializeToString()
    assert KVTicket.from_proto(pb.KVTicket.FromString(wire)) == ticket
    minimal = KVTicket("r", "h:1", (), LAYOUT, "fp", 0)
    assert KVTicket.from_proto(pb.KVTicket.FromString(minimal.to_proto().SerializeToString())) == (
        minimal
    )


def test_a_ticket_seen_by_one_decode_rank() -> None:
    """A per-rank stream's ticket: that rank's endpoints and shared cache, listing that rank
    alone (its heads); a ticket without ranks is one rank holding every head."""
    ranks = (DecodeRank(0, 1, "h:1", "h:2", "s0", "/a"), DecodeRank(1, 1, "h:3", "h:4", "s1"))
    ticket = KVTicket("r", "h:1", (3,), LAYOUT, "fp", 4, shared_cache="/a", ranks=ranks)
    one = ticket.for_rank(1)
    assert (one.endpoint, one.pair_store, one.local_control) == ("h:3", "h:4", "s1")
    assert (one.shared_cache, one.decode_ranks(), one.block_ids) == ("", ranks[1:], (3,))
    assert ticket.for_rank(0).shared_cache == "/a"
    plain = KVTicket("r", "h:9", (3,), LAYOUT, "fp", 4, shared_cache="/z")
    assert plain.decode_ranks() == (DecodeRank(0, 2, "h:9", "", "", "/z"),)


def test_rank_streams_send_each_head_once_to_every_holder() -> None:
    """Fan-out (P TP 1 -> D TP 3), fan-in (3 -> 1), replicated heads both ways (the tiny
    model's 2 KV heads at TP 2 <-> 4); another model's heads are refused."""
    r = range
    assert rank_streams([r(0, 3)], [r(0, 1), r(1, 2), r(2, 3)]) == [
        RankStream(0, d, r(d, d + 1)) for d in range(3)
    ]
    assert rank_streams([r(0, 1), r(1, 2), r(2, 3)], [r(0, 3)]) == [
        RankStream(p, 0, r(p, p + 1)) for p in range(3)
    ]
    assert rank_streams([r(0, 1), r(1, 2)], [r(0, 1), r(0, 1), r(1, 2), r(1, 2)]) == [
        RankStream(0, 0, r(0, 1)),
        RankStream(0, 1, r(0, 1)),
        RankStream(1, 2, r(1, 2)),
        RankStream(1, 3, r(1, 2)),
    ]
    assert rank_streams([r(0, 1), r(0, 1), r(1, 2), r(1, 2)], [r(0, 1), r(1, 2)]) == [
        RankStream(0, 0, r(0, 1)),
        RankStream(2, 1, r(1, 2)),
    ]
    with pytest.raises(ValueError, match="prefill ranks hold KV heads"):
        rank_streams([r(0, 2)], [r(0, 1), r(1, 2), r(2, 3)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_a_head_window_gathers_and_scatters_its_heads_only(dtype: torch.dtype) -> None:
    """Head 1 of a 3-head cache into head 0 of a 2-head cache, through the wire tensor; every
    other head stays untouched."""
    src = torch.arange(2 * 3 * 4 * 3 * 8).view(2, 3, 4, 3, 8).to(dtype)
    dst = torch.full((2, 2, 4, 2, 8), 7, dtype=dtype)
    slots_src = slot_mapping([2, 0], 4, 6, CPU)
    slots_dst = slot_mapping([1, 0], 4, 6, CPU)
    wire = gather_tokens(HeadWindow(src, 1, 1), slots_src)
    assert wire.shape == (2, 6, 1, 8)
    assert torch.equal(wire, src.view(2, -1, 3, 8)[:, slots_src, 1:2])
    scatter_tokens(HeadWindow(dst, 0, 1), slots_dst, wire)
    flat = dst.view(2, -1, 2, 8)
    assert torch.equal(flat[:, slots_dst, 0:1], wire)
    assert (flat[:, :, 1] == 7).all()
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots_dst] = False
    assert (flat[:, untouched] == 7).all()
    assert head_window([src], 0, 3) == [src]  # every head: the tensor itself


def test_a_ticket_with_an_unknown_dtype_is_refused() -> None:
    msg = KVTicket("r", "h:1", (1,), LAYOUT, "fp", 1).to_proto()
    msg.layout.dtype = "float8"
    with pytest.raises(ValueError, match="float8"):
        KVTicket.from_proto(msg)


# -- the state machine -------------------------------------------------------------------------


def far() -> TransferStatus:
    return TransferStatus(deadline=float("inf"))


def test_states_move_forward_to_success() -> None:
    status = far()
    assert status.state == TransferState.BOOTSTRAPPING
    for state in (TransferState.WAITING_FOR_INPUT, TransferState.TRANSFERRING):
        assert status.advance(state) and status.state == state
        assert status.advance(state)  # staying put is allowed (every layer says Transferring)
    assert status.advance(TransferState.SUCCESS)
    assert status.state.final and status.error is None
    assert status.wait(0) == TransferState.SUCCESS


def test_bootstrapping_may_skip_waiting() -> None:
    status = far()
    assert status.advance(TransferState.TRANSFERRING)


@pytest.mark.parametrize(
    "path, bad",
    [
        ([TransferState.WAITING_FOR_INPUT], TransferState.BOOTSTRAPPING),
        ([TransferState.TRANSFERRING], TransferState.WAITING_FOR_INPUT),
        ([], TransferState.SUCCESS),  # success only after transferring
        ([TransferState.WAITING_FOR_INPUT], TransferState.SUCCESS),
    ],
)
def test_no_backwards_or_skipping_moves(path: list[TransferState], bad: TransferState) -> None:
    status = far()
    for state in path:
        status.advance(state)
    with pytest.raises(RuntimeError, match="cannot go"):
        status.advance(bad)


def test_fail_once_and_final_states_stay() -> None:
    status = far()
    status.advance(TransferState.TRANSFERRING)
    first = TransferError(FailureCause.TIMEOUT, "late")
    assert status.fail(first)
    assert not status.fail(TransferError(FailureCause.PEER_LOST, "gone"))
    assert status.state == TransferState.FAILED and status.error is first
    assert not status.advance(TransferState.SUCCESS)  # final: no change, no error
    assert status.state == TransferState.FAILED

    done = far()
    done.advance(TransferState.TRANSFERRING)
    done.advance(TransferState.SUCCESS)
    assert not done.fail(first)
    assert done.state == TransferState.SUCCESS and done.error is None


def test_wait_returns_when_another_thread_fails_it() -> None:
    status = far()
    threading.Timer(0.01, status.fail, [TransferError(FailureCause.CANCELLED, "x")]).start()
    assert status.wait(5.0) == TransferState.FAILED


def test_wait_defaults_to_the_deadline() -> None:
    status = TransferStatus(deadline=0.0)  # long past
    assert status.expired() and status.remaining() < 0
    assert status.wait() == TransferState.BOOTSTRAPPING  # returns at once, still not final


def test_retryable_causes() -> None:
    retry = {c for c in FailureCause if TransferError(c, "").retryable}
    assert retry == set(FailureCause) - {FailureCause.CANCELLED, FailureCause.BAD_METADATA}
    assert "(timeout)" in str(TransferError(FailureCause.TIMEOUT, "slow"))


# -- the fake ----------------------------------------------------------------------------------


class ListPlane(DataPlane):
    kind = pb.DATA_PLANE_GRPC

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.flushed = False

    def fill_header(self, header: pb.TransferHeader) -> None:
        header.pair_id = "from-inner"

    def send_layers(
        self, layers: range, kv_caches: list[torch.Tensor], slots: torch.Tensor, deadline: float
    ) -> Iterator[bytes]:
        self.sent.extend(layers)
        yield layer_message(layers.start, num_layers=len(layers))

    def flush(self, timeout_s: float) -> None:
        self.flushed = True


def test_faulty_plane_runs_its_hook_before_the_inner_plane() -> None:
    inner = ListPlane()
    seen: list[tuple[int, list[int]]] = []
    plane = FaultyPlane.around(lambda layer: seen.append((layer, list(inner.sent))))(inner)
    assert plane.kind == inner.kind
    header = pb.TransferHeader()
    plane.fill_header(header)
    assert header.pair_id == "from-inner"
    caches, slots = [paged(1, 4)] * 3, torch.arange(2)
    chunks = [parse_chunk(m)[0].layer for m in plane.send_layers(range(3), caches, slots, 1e9)]
    assert [(c.layer, c.num_layers) for c in chunks] == [(0, 1), (1, 1), (2, 1)]
    assert seen == [(0, []), (1, [0]), (2, [0, 1])]
    plane.flush(1.0)
    assert inner.flushed


def test_at_layer_fires_on_its_layer_only() -> None:
    fired: list[int] = []
    hook = at_layer(1, lambda: fired.append(1))
    for layer in range(3):
        hook(layer)
    assert fired == [1]
