"""Quantized KV caches between two processes: int8 slots arrive byte for byte, scales included,
on every plane; a float receiver dequantizes what an int8 sender sends and an int8 receiver
quantizes what a float sender sends; int8 prefill and decode workers decode the colocated int8
engine's greedy tokens. fp8 tensors do not pickle in torch 2.13 (the harness's pipe), so fp8
slots are checked with both ends in the test process: the planes are the same."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import WorkerProcess, gather_kv
from test_transfer_planes import wait_until
from test_transfer_workers import MAX_TOKENS, disaggregated, prompts_of

from kv_transfer import KVLayout, KVReceiver, KVSender, TransferState
from kv_transfer.receiver import Arrival
from kv_transfer.shm import SharedKVCache
from tandem.engine.kv_quant import SCALE_BYTES, decode, encode

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.timeout(120)]

CHANNELS = ["grpc", "pair", "shm"]


def transfer(
    prefill: WorkerProcess, decode_: WorkerProcess, src: KVLayout, dst: KVLayout, channel: str
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """27 tokens from random source blocks into other blocks of a zeroed receiver (block sizes
    differ); the token-major KV per layer as sent and as arrived."""
    decode_.call("kv_receiver", "rx", dst, num_blocks=16, shm=channel == "shm")
    prefill.call("kv_sender", "tx", src, num_blocks=32, seed=0, channel=channel)
    n, src_blocks, dst_blocks = 27, [9, 2, 30, 17, 4, 21, 8], [5, 0, 11, 3, 7]
    (ticket,) = decode_.call("expect", "rx", [("r", dst_blocks, n)])
    prefill.call("send", "tx", [ticket], [src_blocks])
    assert prefill.call("outcomes", "tx", 1) == {"r": ("success", None, channel)}
    assert decode_.call("outcomes", "rx", 1) == {"r": ("success", None, 0)}
    (sent,) = prefill.call("gather", "tx", [(src_blocks, n)])
    (got,) = decode_.call("gather", "rx", [(dst_blocks, n)])
    return sent, got


def assert_same_slots(sent: list[torch.Tensor], got: list[torch.Tensor], dtype: str) -> None:
    for layer, (a, b) in enumerate(zip(sent, got, strict=True)):
        assert a.dtype == b.dtype and a.shape[-1] == 16 + SCALE_BYTES, dtype
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"layer {layer}"
        scales = b[..., 16:].contiguous().view(torch.float32)
        assert bool((scales > 0).all()), f"layer {layer}: a slot arrived without its scale"


@pytest.mark.parametrize("channel", CHANNELS)
def test_int8_kv_arrives_byte_exact_with_its_scales(
    prefill_proc: WorkerProcess, decode_proc: WorkerProcess, channel: str
) -> None:
    src = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, block_size=4, dtype="int8")
    dst = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, block_size=8, dtype="int8")
    sent, got = transfer(prefill_proc, decode_proc, src, dst, channel)
    assert_same_slots(sent, got, "int8")


@pytest.mark.parametrize("channel", CHANNELS)
def test_fp8_kv_arrives_byte_exact_with_its_scales(channel: str) -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="fp8")
    g = torch.Generator().manual_seed(0)
    src = [encode(torch.randn(2, 8, 4, 2, 16, generator=g), layout.torch_dtype) for _ in range(2)]
    shm = SharedKVCache.create(layout, 8) if channel == "shm" else None
    dst = shm.kv_caches if shm is not None else [torch.zeros_like(c) for c in src]
    receiver = KVReceiver(dst, "fp", shared_cache=shm.locator if shm is not None else "")
    sender = KVSender("fp", channel=channel)
    arrivals: list[Arrival] = []
    try:
        transfer = sender.begin(receiver.expect("r", [3, 1, 6], 11), src)
        transfer.set_source([0, 5, 2])
        transfer.all_layers_ready()
        transfer.finish(0)
        assert transfer.wait(10.0) == TransferState.SUCCESS, transfer.status.error
        assert transfer.plane_name == channel

        def arrived() -> bool:
            arrivals.extend(receiver.poll())
            return bool(arrivals)

        wait_until(arrived)
        assert arrivals[0].state == TransferState.SUCCESS, arrivals[0].error
        assert_same_slots(gather_kv(src, [0, 5, 2], 11), gather_kv(dst, [3, 1, 6], 11), "fp8")
    finally:
        sender.close()
        receiver.close()
        if shm is not None:
            shm.close()


@pytest.mark.parametrize("channel", CHANNELS)
@pytest.mark.parametrize("src_dtype, dst_dtype", [("int8", "float32"), ("bfloat16", "int8")])
def test_receiver_converts_between_float_and_int8(
    prefill_proc: WorkerProcess,
    decode_proc: WorkerProcess,
    channel: str,
    src_dtype: str,
    dst_dtype: str,
) -> None:
    src = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype=src_dtype)
    dst = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=8, dtype=dst_dtype)
    sent, got = transfer(prefill_proc, decode_proc, src, dst, channel)
    for layer, (a, b) in enumerate(zip(sent, got, strict=True)):
        assert b.dtype == dst.torch_dtype
        want = encode(decode(a, torch.float32), dst.torch_dtype)
        assert torch.equal(b, want), f"layer {layer}"


@pytest.mark.parametrize("channel", CHANNELS)
def test_int8_workers_decode_the_colocated_int8_tokens(
    tiny_llama_path: Path, prefill_proc: WorkerProcess, decode_proc: WorkerProcess, channel: str
) -> None:
    model = str(tiny_llama_path)
    prefill_proc.call(
        "prefill_worker", "p", model, channel, num_blocks=64, block_size=16, kv_cache_dtype="int8"
    )
    decode_proc.call(
        "decode_worker", "d", model, num_blocks=64, block_size=8, kv_cache_dtype="int8"
    )
    prompts = prompts_of([5, 16, 37], vocab=256)
    got = disaggregated(prefill_proc, decode_proc, prompts, channel)  # KV byte-exact, checked
    want = decode_proc.call("colocated", model, prompts, MAX_TOKENS, kv_cache_dtype="int8")
    assert got == want
