"""Idle pairs (kv_transfer/pairs.py): the sender's poll, which the prefill loop makes every
iteration, closes a pair unused for longer than `pair_idle_s` on both sides and keeps a busy one;
the next transfer to that receiver opens a new pair.

Sender and receivers share one process (Gloo does not care); on CUDA the pair would be NCCL,
which cannot put both ranks on one GPU, so the caches stay on the CPU."""

from __future__ import annotations

import time

import pytest
import torch

from kv_transfer import KVLayout, KVReceiver, KVSender, TransferState

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.timeout(60)]

IDLE_S = 1.0
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
SHAPE = (2, 4, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)


def transfer(sender: KVSender, receiver: KVReceiver, request_key: str) -> None:
    """One request's KV over a pair, to success."""
    src = [torch.randn(SHAPE) for _ in range(LAYOUT.num_layers)]
    t = sender.begin(receiver.expect(request_key, [0, 1], 8), src)
    t.set_source([2, 3])
    t.all_layers_ready()
    t.finish(7)
    assert t.wait(10.0) == TransferState.SUCCESS, t.status.error
    assert t.plane_name == "pair"


def test_a_pair_idle_past_pair_idle_s_is_closed_and_a_busy_one_is_not() -> None:
    idle_rx, busy_rx = (KVReceiver([torch.zeros(SHAPE), torch.zeros(SHAPE)], "fp") for _ in "ab")
    sender = KVSender("fp", channel="pair", pair_idle_s=IDLE_S)
    try:
        transfer(sender, idle_rx, "early")
        time.sleep(IDLE_S)  # the time without transfers is what is under test
        transfer(sender, busy_rx, "late")
        assert len(sender.pairs) == 2 and len(idle_rx.pairs) == len(busy_rx.pairs) == 1
        sender.poll()
        assert len(sender.pairs) == 1 and len(busy_rx.pairs) == 1
        deadline = time.monotonic() + 5.0
        while len(idle_rx.pairs) and time.monotonic() < deadline:  # ClosePair is asynchronous
            time.sleep(0.01)
        assert len(idle_rx.pairs) == 0
        transfer(sender, idle_rx, "again")  # a new pair
        assert len(sender.pairs) == 2 and len(idle_rx.pairs) == 1
    finally:
        sender.close()
        idle_rx.close()
        busy_rx.close()
