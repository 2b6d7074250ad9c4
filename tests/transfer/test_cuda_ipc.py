"""The shared-memory plane's CUDA side: a decode worker's GPU cache opened by CUDA IPC.

Everywhere: a locator that this process cannot open (no such GPU here) sends an "auto" sender to
another plane and fails a forced "shm" transfer at setup. With a GPU: another process opens the
cache, reads what its owner wrote and writes what its owner then reads. The whole transfer suite
runs over CUDA IPC with `TANDEM_TEST_DEVICE=cuda` (tests/transfer/harness.py).
"""

from __future__ import annotations

import base64
import dataclasses
import multiprocessing
from multiprocessing.connection import Connection

import pytest
import torch

from kv_transfer import FailureCause, KVLayout, KVReceiver, KVSender, TransferState, shm
from kv_transfer.cuda_ipc import LOCATOR_PREFIX, CudaSharedKVCache, is_cuda_locator
from tandem.v1 import kv_transfer_pb2 as pb

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")
NO_GPU = (
    LOCATOR_PREFIX
    + base64.urlsafe_b64encode(
        pb.CudaIpcCache(device_uuid="GPU-00000000-no-such-gpu", size_bytes=4096).SerializeToString()
    ).decode()
)


def test_an_unopenable_cuda_cache_falls_back_or_fails_setup() -> None:
    assert is_cuda_locator(NO_GPU) and not is_cuda_locator("/dev/shm/tandem-kv-1")
    with pytest.raises(ValueError, match="not visible"):
        CudaSharedKVCache.attach(NO_GPU, LAYOUT)
    shape = (2, 8, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    src = [torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    src = [s.to(torch.bfloat16) for s in src]
    caches = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(2)]
    receiver = KVReceiver(caches, "fp", enable_pairs=False)  # "auto" falls back to gRPC
    senders = {channel: KVSender("fp", channel=channel) for channel in ("auto", "shm")}
    try:
        outcomes = {}
        for channel, sender in senders.items():
            ticket = receiver.expect(channel, [0, 1], 8, timeout_s=30.0)
            transfer = sender.begin(dataclasses.replace(ticket, shared_cache=NO_GPU), src)
            transfer.set_source([4, 5])
            transfer.all_layers_ready()
            transfer.finish(1)
            transfer.wait(30.0)
            outcomes[channel] = transfer
        auto, forced = outcomes["auto"], outcomes["shm"]
        assert auto.status.state == TransferState.SUCCESS, auto.status.error
        assert auto.plane_name == "grpc" and senders["auto"].fallbacks == 1
        assert forced.status.state == TransferState.FAILED
        assert forced.status.error is not None
        assert forced.status.error.cause == FailureCause.SETUP
        assert "shared cache" in str(forced.status.error)
    finally:
        for sender in senders.values():
            sender.close()
        receiver.close()


def test_a_failed_open_is_not_retried_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def attach(locator: str, layout: KVLayout) -> shm.SharedCache:
        calls.append(locator)
        return CudaSharedKVCache.attach(locator, layout)

    monkeypatch.setattr(shm, "attach", attach)
    attachments = shm.SharedCacheAttachments(retry_s=60.0)
    for _ in range(3):
        with pytest.raises(ValueError, match="not visible"):
            attachments.get(NO_GPU, LAYOUT)
    assert calls == [NO_GPU]
    with pytest.raises(ValueError, match="not a CUDA IPC locator"):
        attachments.get(LOCATOR_PREFIX + "!!not base64!!", LAYOUT)


def _open_and_write(locator: str, conn: Connection) -> None:
    cache = CudaSharedKVCache.attach(locator, LAYOUT)
    conn.send([c.float().sum().item() for c in cache.kv_caches])  # what the owner wrote
    for layer, c in enumerate(cache.kv_caches):
        c.fill_(layer + 1)
    torch.cuda.synchronize()
    conn.send(cache.num_blocks)
    conn.recv()  # the owner has read it: the opening may go


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_another_process_reads_and_writes_the_cache() -> None:
    owner = CudaSharedKVCache.create(LAYOUT, num_blocks=6, device=torch.device("cuda"))
    for c in owner.kv_caches:
        c.copy_(torch.randn(c.shape, device=c.device))
    want = [c.float().sum().item() for c in owner.kv_caches]
    torch.cuda.synchronize()
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_open_and_write, args=(owner.locator, there), daemon=True)
    child.start()
    try:
        assert here.poll(60), "the child did not open the cache"
        assert here.recv() == want
        assert here.poll(30) and here.recv() == 6
        for layer, c in enumerate(owner.kv_caches):
            assert bool((c == layer + 1).all()), layer
        here.send("done")
    finally:
        child.join(30)
        child.kill()
