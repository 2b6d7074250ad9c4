"""The host-local control stream (kv_transfer/local_control.py): frames, a same-host transfer on
the Unix socket and the reuse of its connection, the fallback to gRPC, failures that close the
connection, and the gRPC control that a sender or receiver without the socket keeps using.

Sender and receiver share one process here (the socket does not care); the two-process cases,
killed and stalled peers included, run in test_transfer_planes.py and test_transfer_faults.py,
where the shm plane takes this socket by default."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from kv_transfer import FailureCause, KVLayout, KVReceiver, KVSender, KVTicket, TransferState
from kv_transfer.fake import FaultyPlane
from kv_transfer.layout import gather_tokens, slot_mapping
from kv_transfer.local_control import (
    END,
    MESSAGE,
    READY,
    REPLY,
    STATUS,
    LocalCallError,
    LocalConnection,
    LocalControlPool,
    recv_frame,
    send_frame,
)
from kv_transfer.receiver import SHM_GRACE_S
from kv_transfer.shm import SharedKVCache
from tandem.v1 import kv_transfer_pb2 as pb

pytestmark = pytest.mark.timeout(60)

CPU = torch.device("cpu")
LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, block_size=4, dtype="float32")
SRC_BLOCKS, DST_BLOCKS, N = [5, 1, 7, 2], [3, 0, 6, 4], 14


@pytest.fixture
def receiver() -> Iterator[KVReceiver]:
    cache = SharedKVCache.create(LAYOUT, num_blocks=8)
    rx = KVReceiver(cache.kv_caches, "model", shared_cache=cache.locator)
    yield rx
    rx.close()
    cache.close()


@pytest.fixture
def source() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (2, 8, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return [torch.randn(shape, generator=g) for _ in range(LAYOUT.num_layers)]


def transfer(sender: KVSender, ticket: KVTicket, source: list[torch.Tensor]) -> str:
    """Push every layer; the sender's outcome: "success" or its failure cause."""
    t = sender.begin(ticket, source)
    t.set_source(SRC_BLOCKS)
    t.all_layers_ready()
    t.finish(first_token=7)
    state = t.wait(10.0)
    assert sender.poll() == [t]
    if state == TransferState.SUCCESS:
        return f"success over {t.control}"
    assert t.status.error is not None
    return t.status.error.cause.value


def arrived(rx: KVReceiver, source: list[torch.Tensor]) -> None:
    """The reservation is reported a success and its blocks hold the sender's KV."""
    deadline = time.monotonic() + 10.0
    while not (done := rx.poll()) and time.monotonic() < deadline:
        time.sleep(0.005)
    (arrival,) = done
    assert arrival.state == TransferState.SUCCESS and arrival.first_token == 7
    src, dst = slot_mapping(SRC_BLOCKS, 4, N, CPU), slot_mapping(DST_BLOCKS, 4, N, CPU)
    for a, b in zip(source, rx.kv_caches, strict=True):
        assert torch.equal(gather_tokens(b, dst), gather_tokens(a, src))


def idle(sender: KVSender) -> list[LocalConnection]:
    assert sender.local is not None
    return [c for conns in sender.local._idle.values() for c in conns]


def test_frames_round_trip_whatever_their_size() -> None:
    a, b = socket.socketpair()
    big = bytes(range(256)) * 4096  # past the one-send size and the socket's buffer

    def send() -> None:
        send_frame(a, MESSAGE, b"header")
        send_frame(a, MESSAGE, big)
        send_frame(a, END)
        send_frame(a, STATUS, b"NOT_FOUND\nno reservation")
        a.sendall(b"\x03\x10\x00\x00\x00short")  # a REPLY frame cut off by the peer's close
        a.close()

    writer = threading.Thread(target=send)
    writer.start()
    with b:
        assert recv_frame(b) == (MESSAGE, b"header")
        assert recv_frame(b) == (MESSAGE, big)
        assert recv_frame(b) == (END, b"")
        assert recv_frame(b) == (STATUS, b"NOT_FOUND\nno reservation")
        with pytest.raises(EOFError):
            recv_frame(b)
    writer.join()
    assert REPLY not in (MESSAGE, END, STATUS)
    error = LocalCallError(grpc.StatusCode.NOT_FOUND, "gone")
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.NOT_FOUND


def test_same_host_transfers_take_the_socket_and_reuse_its_connection(
    receiver: KVReceiver, source: list[torch.Tensor]
) -> None:
    sender = KVSender("model")  # auto: the shm plane, the receiver being on this host
    try:
        ticket = receiver.expect("a", DST_BLOCKS, N)
        assert ticket.local_control
        assert transfer(sender, ticket, source) == "success over local"
        arrived(receiver, source)
        (conn,) = idle(sender)  # kept for the next transfer
        assert transfer(sender, receiver.expect("b", DST_BLOCKS, N), source) == "success over local"
        arrived(receiver, source)
        assert idle(sender) == [conn]
        assert sender.fallbacks == 0
    finally:
        sender.close()


def test_an_unreachable_socket_falls_back_to_grpc(
    receiver: KVReceiver, source: list[torch.Tensor]
) -> None:
    sender = KVSender("model")
    try:
        ticket = dataclasses.replace(receiver.expect("a", DST_BLOCKS, N), local_control="nobody")
        assert transfer(sender, ticket, source) == "success over grpc"
        arrived(receiver, source)
        assert sender.fallbacks == 1
    finally:
        sender.close()


def test_an_unreachable_address_is_not_retried_until_its_entry_expires() -> None:
    pool = LocalControlPool(retry_s=0.2)
    with pytest.raises(OSError):
        pool.call("nobody", iter(()), timeout=1.0)
    assert not pool.reachable("nobody")
    time.sleep(0.25)
    assert pool.reachable("nobody")
    assert pool._unreachable == {}  # a receiver gone for good leaves nothing behind
    pool.close()


def test_a_receiver_at_its_bound_of_connections_sends_senders_to_grpc(
    receiver: KVReceiver, source: list[torch.Tensor]
) -> None:
    assert receiver._local is not None
    receiver._local.max_connections = 1
    holder, sender = KVSender("model"), KVSender("model")
    try:
        assert transfer(holder, receiver.expect("a", DST_BLOCKS, N), source) == "success over local"
        arrived(receiver, source)
        assert len(idle(holder)) == 1  # the one connection the receiver takes, kept open
        assert transfer(sender, receiver.expect("b", DST_BLOCKS, N), source) == "success over grpc"
        arrived(receiver, source)
        assert sender.fallbacks == 1
    finally:
        holder.close()
        sender.close()


def test_a_refused_transfer_closes_its_connection(
    receiver: KVReceiver, source: list[torch.Tensor]
) -> None:
    stranger = KVSender("another model")
    sender = KVSender("model")
    try:
        ticket = receiver.expect("a", DST_BLOCKS, N)
        assert transfer(stranger, ticket, source) == FailureCause.BAD_METADATA.value
        assert idle(stranger) == []
        (failed,) = receiver.poll()
        assert failed.error is not None and failed.error.cause == FailureCause.BAD_METADATA
        assert transfer(sender, receiver.expect("b", DST_BLOCKS, N), source) == "success over local"
        arrived(receiver, source)
    finally:
        stranger.close()
        sender.close()


def test_a_connection_its_receiver_closed_is_not_reused(
    receiver: KVReceiver, source: list[torch.Tensor]
) -> None:
    sender = KVSender("model")
    try:
        ticket = receiver.expect("a", DST_BLOCKS, N)
        assert transfer(sender, ticket, source) == "success over local"
        (conn,) = idle(sender)
        assert sender.local is not None
        assert receiver._local is not None
        receiver._local.close()  # as when its process ends
        for _ in range(200):
            if conn.stale():
                break
            time.sleep(0.005)
        assert sender.local._take(ticket.local_control) is None and idle(sender) == []
    finally:
        sender.close()


@pytest.mark.parametrize("control", ["local", "grpc"])
def test_a_sender_gone_right_after_its_header_fails_the_reservation(
    receiver: KVReceiver, source: list[torch.Tensor], control: str
) -> None:
    """The receiver answers ACCEPTED before its reader runs; a stream that ends in between (the
    answer cannot be sent, or the call is cancelled) still frees the reservation."""
    sender = KVSender("model", local_control=control == "local")
    try:
        for i in range(20):
            t = sender.begin(receiver.expect(f"r{i}", DST_BLOCKS, N, timeout_s=0.5), source)
            res = receiver._reservations[f"r{i}"]
            deadline = time.monotonic() + 2.0
            while not res.stream_open and time.monotonic() < deadline:
                time.sleep(0.0002)
            t.abort()
            assert t.wait(5.0) == TransferState.FAILED
            assert sender.poll() == [t]
        deadline = time.monotonic() + 5.0  # the ticket's 0.5 s and the shm plane's grace
        reported = []
        while len(reported) < 20 and time.monotonic() < deadline:
            reported += receiver.poll()
            time.sleep(0.01)
        assert len(reported) == 20 and len(receiver) == 0
        assert all(a.state == TransferState.FAILED for a in reported)
    finally:
        sender.close()


def test_an_abort_breaks_the_stream_once_the_layer_being_copied_has_landed(
    receiver: KVReceiver, source: list[torch.Tensor]
) -> None:
    """The prefill side aborts while its thread copies a layer into the receiver's shared cache
    (stalled there longer than the receiver's grace, as a descheduled thread on a busy host):
    the receiver reports the failed reservation, whose blocks its worker then frees, only after
    that copy."""
    stalled = threading.Event()
    copying: list[float] = []

    def stall(layer: int) -> None:  # runs on the stream's thread right before the layer's copy
        if layer == 1:
            stalled.set()
            time.sleep(2 * SHM_GRACE_S)
            copying.append(time.monotonic())

    sender = KVSender("model", wrap_plane=FaultyPlane.around(stall))
    try:
        t = sender.begin(receiver.expect("a", DST_BLOCKS, N), source)
        t.set_source(SRC_BLOCKS)
        t.all_layers_ready()
        assert stalled.wait(5.0)
        abort = threading.Thread(target=t.abort)
        abort.start()
        deadline = time.monotonic() + 10.0
        while not (done := receiver.poll()) and time.monotonic() < deadline:
            time.sleep(0.005)
        reported = time.monotonic()
        abort.join(5.0)
        (arrival,) = done
        assert arrival.state == TransferState.FAILED
        assert copying and reported > copying[0]
    finally:
        sender.close()


def test_a_header_alone_on_the_socket_fails_the_reservation(receiver: KVReceiver) -> None:
    ticket = receiver.expect("a", DST_BLOCKS, N, timeout_s=1.0)
    header = pb.TransferHeader(
        request_key="a",
        layout=LAYOUT.to_proto(),
        model_fingerprint="model",
        num_tokens=N,
        data_plane=pb.DATA_PLANE_SHM,
    )
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.connect("\0" + ticket.local_control)
        assert recv_frame(raw)[0] == READY
        send_frame(raw, MESSAGE, pb.KVChunk(header=header).SerializeToString())
    deadline = time.monotonic() + 3.0  # the shm plane's grace after the failure
    while not (done := receiver.poll()) and time.monotonic() < deadline:
        time.sleep(0.01)
    (arrival,) = done
    assert arrival.error is not None and arrival.error.cause == FailureCause.PEER_LOST


def test_aborting_a_finished_transfer_leaves_its_connection_to_the_next(
    receiver: KVReceiver, source: list[torch.Tensor]
) -> None:
    sender = KVSender("model")
    try:
        a = sender.begin(receiver.expect("a", DST_BLOCKS, N), source)
        a.set_source(SRC_BLOCKS)
        a.all_layers_ready()
        a.finish(7)
        assert a.wait(5.0) == TransferState.SUCCESS
        arrived(receiver, source)
        b = sender.begin(receiver.expect("b", DST_BLOCKS, N), source)
        deadline = time.monotonic() + 5.0
        while idle(sender) and time.monotonic() < deadline:  # until b has taken a's connection
            time.sleep(0.001)
        assert idle(sender) == []
        a.abort()  # the request was aborted on the prefill side after its transfer ended
        assert a.status.state == TransferState.SUCCESS
        b.set_source(SRC_BLOCKS)
        b.all_layers_ready()
        b.finish(7)
        assert b.wait(5.0) == TransferState.SUCCESS and b.control == "local"
        arrived(receiver, source)
    finally:
        sender.close()


@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_without_the_socket_the_push_runs_on_grpc(side: str, source: list[torch.Tensor]) -> None:
    cache = SharedKVCache.create(LAYOUT, num_blocks=8)
    rx = KVReceiver(
        cache.kv_caches, "model", shared_cache=cache.locator, local_control=side != "receiver"
    )
    sender = KVSender("model", local_control=side != "sender")
    try:
        ticket = rx.expect("a", DST_BLOCKS, N)
        assert bool(ticket.local_control) == (side != "receiver")
        assert transfer(sender, ticket, source) == "success over grpc"
        arrived(rx, source)
    finally:
        sender.close()
        rx.close()
        cache.close()
