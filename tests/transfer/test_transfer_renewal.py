"""A reservation renewed by keep-alives (kv_transfer: OutboundTransfer.renew, the KeepAlive
message): a request that waits on its prefill worker longer than the ticket's timeout still
arrives, a sender that stops renewing still times out on both sides, and the stream's own
deadline (the request's) bounds the renewals. Sender and receiver share one process, over gRPC
and over the host-local socket of the shared-memory plane."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from kv_transfer import FailureCause, KVLayout, KVReceiver, KVSender, TransferState
from kv_transfer.layout import gather_tokens, slot_mapping
from kv_transfer.receiver import Arrival
from kv_transfer.sender import OutboundTransfer
from kv_transfer.shm import SharedKVCache

pytestmark = pytest.mark.timeout(60)

CPU = torch.device("cpu")
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
SRC_BLOCKS, DST_BLOCKS, N = [5, 1, 7], [3, 0, 6], 10
TIMEOUT_S = 0.4  # the ticket's: each wait below is several of these


@pytest.fixture(params=["grpc", "shm"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[KVSender, KVReceiver]]:
    cache = SharedKVCache.create(LAYOUT, num_blocks=8)
    receiver = KVReceiver(cache.kv_caches, "model", shared_cache=cache.locator, enable_pairs=False)
    sender = KVSender("model", channel=request.param)
    yield sender, receiver
    sender.close()
    receiver.close()
    cache.close()


@pytest.fixture
def source() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (2, 8, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return [torch.randn(shape, generator=g) for _ in range(LAYOUT.num_layers)]


def queued(transfer: OutboundTransfer, seconds: float) -> None:
    """The request waits `seconds` on its prefill worker, whose loop renews it meanwhile."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        transfer.renew()
        time.sleep(0.01)


def reported(receiver: KVReceiver, within: float) -> Arrival:
    deadline = time.monotonic() + within
    while not (done := receiver.poll()):
        assert time.monotonic() < deadline, "the reservation was never reported"
        time.sleep(0.01)
    (arrival,) = done
    return arrival


def test_a_renewed_transfer_outlives_its_ticket_timeout(
    pair: tuple[KVSender, KVReceiver], source: list[torch.Tensor]
) -> None:
    sender, receiver = pair
    t = sender.begin(receiver.expect("r", DST_BLOCKS, N, TIMEOUT_S), source, call_timeout_s=30.0)
    queued(t, 4 * TIMEOUT_S)
    t.set_source(SRC_BLOCKS)
    t.all_layers_ready()
    t.finish(first_token=7)
    assert t.wait(10.0) == TransferState.SUCCESS
    arrival = reported(receiver, 5.0)
    assert arrival.state == TransferState.SUCCESS and arrival.first_token == 7
    src, dst = slot_mapping(SRC_BLOCKS, 4, N, CPU), slot_mapping(DST_BLOCKS, 4, N, CPU)
    for a, b in zip(source, receiver.kv_caches, strict=True):
        assert torch.equal(gather_tokens(b, dst), gather_tokens(a, src))


def test_a_sender_that_stops_renewing_times_out_on_both_sides(
    pair: tuple[KVSender, KVReceiver], source: list[torch.Tensor]
) -> None:
    sender, receiver = pair
    t = sender.begin(receiver.expect("r", DST_BLOCKS, N, TIMEOUT_S), source, call_timeout_s=30.0)
    queued(t, 2 * TIMEOUT_S)
    stalled = time.monotonic()  # its engine loop stops here: no more renewals
    assert t.wait(10.0) == TransferState.FAILED
    assert t.status.error is not None and t.status.error.cause == FailureCause.TIMEOUT
    assert time.monotonic() - stalled < TIMEOUT_S + 2.0
    arrival = reported(receiver, 5.0)
    assert arrival.error is not None and arrival.error.cause == FailureCause.TIMEOUT
    assert len(receiver) == 0 and sender.poll() == [t]


def test_the_requests_deadline_bounds_the_renewals(
    pair: tuple[KVSender, KVReceiver], source: list[torch.Tensor]
) -> None:
    sender, receiver = pair
    start = time.monotonic()
    t = sender.begin(receiver.expect("r", DST_BLOCKS, N, TIMEOUT_S), source, call_timeout_s=1.0)
    end = time.monotonic() + 10.0
    while t.status.state != TransferState.FAILED and time.monotonic() < end:
        t.renew()
        time.sleep(0.01)
    assert t.status.state == TransferState.FAILED
    assert 1.0 <= time.monotonic() - start < 3.5
    assert reported(receiver, 5.0).state == TransferState.FAILED
