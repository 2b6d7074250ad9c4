"""Faults in the middle of a transfer between a prefill and a decode worker in two processes.

Each fault must end the transfer promptly, with a typed cause on every side that survives, and
leave the survivors with consistent block managers and nothing held: no block, no reservation,
no transfer. The sender pauses before its last layer (the tiny model has two), so "mid-transfer"
is exact: layer 0 is out, layer 1 is not.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from harness import WorkerProcess, ticket_bytes, ticket_of, unlink_shm

from kv_transfer import FailureCause, KVTicket, TransferError

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.timeout(60)]

PROMPT = list(range(40, 53))  # 13 tokens: 4 blocks of 4, the last one partial
MAX_TOKENS = 8
LAST_LAYER = 1
DETECTION_S = 5.0  # a lost peer is noticed within this, far below the ticket timeout
TICKET_TIMEOUT_S = 30.0
STALL_TIMEOUT_S = 1.5  # the stalled sender's ticket: the prefill must reach its pause in time
BAD_METADATA = FailureCause.BAD_METADATA


def start_decode(proc: WorkerProcess, model: Path, **options: Any) -> None:
    defaults: dict[str, Any] = {
        "on_transfer_failure": "fail",
        "transfer_timeout_s": TICKET_TIMEOUT_S,
    }
    proc.call("decode_worker", "d", str(model), num_blocks=32, block_size=4, **defaults | options)


def start_prefill(proc: WorkerProcess, model: Path, channel: str, **options: Any) -> None:
    proc.call("prefill_worker", "p", str(model), channel, num_blocks=32, block_size=4, **options)


def begin(
    prefill: WorkerProcess,
    decode: WorkerProcess,
    edit: Callable[[KVTicket], KVTicket] | None = None,
) -> bytes:
    """Reserve on D and submit to P; the ticket as sent to P."""
    ticket = decode.call("reserve", "d", "r", PROMPT, MAX_TOKENS)
    if edit is not None:
        ticket = ticket_bytes(edit(ticket_of(ticket)))
    prefill.call("submit", "p", "r", PROMPT, MAX_TOKENS, ticket)
    return ticket


def paused_on(prefill: WorkerProcess, channel: str) -> None:
    """Until the sender holds before its last layer, on the plane the test meant."""
    prefill.wait_paused()
    assert prefill.call("plane", "p", "r") == channel  # not a fallback to another plane


def transfer_error(proc: WorkerProcess, command: str, within: float) -> TransferError:
    with pytest.raises(TransferError) as failure:
        proc.call(command, "r", within=within)
    return failure.value


@pytest.mark.parametrize("channel", ["grpc", "pair", "shm"])
def test_sender_killed_mid_transfer(
    tiny_llama_path: Path,
    spawn: Callable[[str], WorkerProcess],
    decode_proc: WorkerProcess,
    channel: str,
) -> None:
    prefill = spawn("doomed-prefill")
    start_decode(decode_proc, tiny_llama_path)
    start_prefill(prefill, tiny_llama_path, channel, pause_at=LAST_LAYER)
    begin(prefill, decode_proc)
    paused_on(prefill, channel)
    prefill.kill()
    killed = time.monotonic()

    error = transfer_error(decode_proc, "tokens", within=DETECTION_S)
    assert error.cause == FailureCause.PEER_LOST
    assert time.monotonic() - killed < DETECTION_S
    decode_proc.call("wait_idle", "d")


@pytest.mark.parametrize("channel", ["grpc", "pair", "shm"])
def test_receiver_killed_mid_transfer(
    tiny_llama_path: Path,
    spawn: Callable[[str], WorkerProcess],
    prefill_proc: WorkerProcess,
    channel: str,
) -> None:
    decode = spawn("doomed-decode")
    start_decode(decode, tiny_llama_path)
    start_prefill(prefill_proc, tiny_llama_path, channel, pause_at=LAST_LAYER)
    ticket = begin(prefill_proc, decode)
    paused_on(prefill_proc, channel)
    decode.kill()
    unlink_shm(ticket_of(ticket).shared_cache)  # a killed decode worker leaves its cache file
    killed = time.monotonic()
    prefill_proc.resume()

    error = transfer_error(prefill_proc, "prefill_result", within=DETECTION_S)
    assert error.cause == FailureCause.PEER_LOST
    assert time.monotonic() - killed < DETECTION_S
    prefill_proc.call("wait_idle", "p")


@pytest.mark.parametrize("channel", ["grpc", "pair", "shm"])
def test_stalled_sender_times_out_on_both_sides(
    tiny_llama_path: Path, prefill_proc: WorkerProcess, decode_proc: WorkerProcess, channel: str
) -> None:
    start_decode(decode_proc, tiny_llama_path, transfer_timeout_s=STALL_TIMEOUT_S)
    start_prefill(prefill_proc, tiny_llama_path, channel, pause_at=LAST_LAYER)
    begin(prefill_proc, decode_proc)
    paused_on(prefill_proc, channel)
    # The sender stays stalled until the receiver has given up on it.
    error = transfer_error(decode_proc, "tokens", within=3.0)
    assert error.cause == FailureCause.TIMEOUT
    prefill_proc.resume()
    error = transfer_error(prefill_proc, "prefill_result", within=3.0)
    assert error.cause == FailureCause.TIMEOUT
    decode_proc.call("wait_idle", "d")
    prefill_proc.call("wait_idle", "p")


def test_a_timed_out_transfer_is_recomputed_locally(
    tiny_llama_path: Path, prefill_proc: WorkerProcess, decode_proc: WorkerProcess
) -> None:
    start_decode(
        decode_proc,
        tiny_llama_path,
        transfer_timeout_s=STALL_TIMEOUT_S,
        on_transfer_failure="local",
    )
    start_prefill(prefill_proc, tiny_llama_path, "grpc", pause_at=LAST_LAYER)
    begin(prefill_proc, decode_proc)
    paused_on(prefill_proc, "grpc")
    tokens, reason = decode_proc.call("tokens", "r", within=5.0)
    assert reason == "length"
    assert [tokens] == decode_proc.call("colocated", str(tiny_llama_path), [PROMPT], MAX_TOKENS)
    assert decode_proc.call("failures", "d") == {"timeout": 1}
    prefill_proc.resume()
    assert transfer_error(prefill_proc, "prefill_result", 3.0).cause == FailureCause.TIMEOUT
    decode_proc.call("wait_idle", "d")
    prefill_proc.call("wait_idle", "p")


def test_a_stalled_shm_sender_does_not_write_into_released_blocks(
    tiny_llama_path: Path, prefill_proc: WorkerProcess, decode_proc: WorkerProcess
) -> None:
    start_decode(decode_proc, tiny_llama_path, transfer_timeout_s=STALL_TIMEOUT_S)
    start_prefill(prefill_proc, tiny_llama_path, "shm", pause_at=LAST_LAYER)
    begin(prefill_proc, decode_proc)
    paused_on(prefill_proc, "shm")
    assert transfer_error(decode_proc, "tokens", 3.0).cause == FailureCause.TIMEOUT
    decode_proc.call("wait_idle", "d")  # the blocks are free: D may hand them to anyone now
    released = decode_proc.call("kv_nonzero", "d")
    prefill_proc.resume()
    assert transfer_error(prefill_proc, "prefill_result", 3.0).cause == FailureCause.TIMEOUT
    assert decode_proc.call("kv_nonzero", "d") == released


@pytest.mark.parametrize("channel", ["grpc", "pair", "shm"])
@pytest.mark.parametrize("fault", ["fingerprint", "num_tokens", "layout"])
def test_bad_metadata_is_refused_before_any_write(
    tiny_llama_path: Path,
    prefill_proc: WorkerProcess,
    decode_proc: WorkerProcess,
    channel: str,
    fault: str,
) -> None:
    start_decode(decode_proc, tiny_llama_path)
    if fault == "fingerprint":  # a prefill worker serving another model
        start_prefill(prefill_proc, tiny_llama_path, channel, fingerprint="another-model")
        begin(prefill_proc, decode_proc)
        assert transfer_error(prefill_proc, "prefill_result", 5.0).cause == BAD_METADATA
        assert prefill_proc.call("plane", "p", "r") == channel
        prefill_proc.call("wait_idle", "p")
    else:
        # A prefill worker checks its tickets against its prompts, so a header that disagrees
        # with the reservation comes from a bare sender of the right model.
        ticket = ticket_of(decode_proc.call("reserve", "d", "r", PROMPT, MAX_TOKENS))
        layout = ticket.layout
        if fault == "num_tokens":
            ticket = dataclasses.replace(ticket, num_tokens=ticket.num_tokens - 1)
        else:
            layout = dataclasses.replace(layout, num_kv_heads=layout.num_kv_heads * 2)
        fingerprint = ticket.model_fingerprint
        prefill_proc.call("kv_sender", "tx", layout, 32, 0, channel, fingerprint=fingerprint)
        prefill_proc.call("send", "tx", [ticket_bytes(ticket)], [[8, 9, 10, 11]])
        assert prefill_proc.call("outcomes", "tx", 1) == {"r": ("failed", "bad_metadata", channel)}

    assert transfer_error(decode_proc, "tokens", 5.0).cause == BAD_METADATA
    assert decode_proc.call("kv_nonzero", "d") == [0, 0]  # not one value written, on any plane
    decode_proc.call("wait_idle", "d")


@pytest.mark.parametrize("channel", ["grpc", "pair", "shm"])
def test_receiver_cancels_mid_transfer(
    tiny_llama_path: Path, prefill_proc: WorkerProcess, decode_proc: WorkerProcess, channel: str
) -> None:
    start_decode(decode_proc, tiny_llama_path)
    start_prefill(prefill_proc, tiny_llama_path, channel, pause_at=LAST_LAYER)
    begin(prefill_proc, decode_proc)
    paused_on(prefill_proc, channel)
    decode_proc.call("cancel", "d", "r")
    prefill_proc.resume()

    assert transfer_error(prefill_proc, "prefill_result", 5.0).cause == FailureCause.CANCELLED
    assert decode_proc.call("tokens", "r", within=5.0) == ([], "abort")
    decode_proc.call("wait_idle", "d")
    prefill_proc.call("wait_idle", "p")


def test_a_ticket_for_another_prompt_is_refused_by_the_prefill_worker(
    tiny_llama_path: Path, prefill_proc: WorkerProcess, decode_proc: WorkerProcess
) -> None:
    start_decode(decode_proc, tiny_llama_path)
    start_prefill(prefill_proc, tiny_llama_path, "grpc")
    # More tokens than the prompt: the sender's slots would run past the prompt's blocks.
    begin(prefill_proc, decode_proc, lambda t: dataclasses.replace(t, num_tokens=t.num_tokens + 4))
    with pytest.raises(ValueError, match="ticket is for 17 prompt tokens"):
        prefill_proc.call("prefill_result", "r", within=5.0)
    decode_proc.call("cancel", "d", "r")  # as the router does when the prefill fails for good
    assert decode_proc.call("tokens", "r", within=5.0) == ([], "abort")
    decode_proc.call("wait_idle", "d")
    prefill_proc.call("wait_idle", "p")  # its loop still runs
