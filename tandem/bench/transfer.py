"""`tandem bench transfer`: each KV-transfer channel against its physical reference, and the
transfer time a decode worker is exposed to, with and without layer-wise streaming.

Method
------
Throughput. Two spawned processes: a receiver (`KVReceiver` over a paged KV cache of the model's
layout: its layers, KV heads and head_dim, `dtype`, `block_size`, sized for the longest prompt; on
CPU the cache is a `SharedKVCache`) and a sender (one `KVSender` per channel, forced to it, over a
seeded random source cache of the same layout). Both sides use a seeded permutation of their
blocks, so gathers and scatters are paged as in an engine. Per transfer the receiver reserves
(`expect`) blocks that are zero (zeroed after the previous transfer's check, not right before:
as in an engine, the blocks are not hot in the receiver's cache); the sender times `begin()` to
`wait()` returning on DONE, with every layer ready at once (`set_source`, `all_layers_ready`,
`finish`): header, ACCEPTED, the layers, trailer, DONE. Each transfer's bytes are then checked
on both sides (a checksum weighted by layer, K/V and token position). One untimed warm-up
transfer per channel at the longest prompt comes first; the pair's setup (OpenPair RPC,
rendezvous, group creation) is timed apart.

References on the same bytes in the same run, in every round right after the channels
(channel A, channel B, ..., TCP, memcpy, then the next prompt length):

- raw TCP (of gRPC and the Gloo pair): the sender process `sendall`s the very wire tensors (every
  layer's [2, tokens, heads, dim], gathered beforehand) over one loopback TCP connection to the
  receiver process, which `recv_into`s a preallocated buffer and answers one byte; the sender's
  clock stops at that byte.
- memcpy (of shared memory, which gathers the source blocks and scatters into the receiver's):
  the sender process copies the same number of bytes between two preallocated, touched tensors
  (`Tensor.copy_`, same threads), one way.

CUDA (`--device cuda`): both caches on the GPU (the receiver on the next GPU when there are two);
the shared-memory plane opens the receiver's cache by CUDA IPC and the pair runs over NCCL (which
cannot put both ranks on one GPU, so it needs two); both are measured against a device-to-device
copy of the same bytes (`Tensor.copy_` between two preallocated tensors, sender GPU to receiver
GPU); gRPC stages through host memory and keeps raw TCP as its reference.

Exposed transfer time. The real workers with the real model in two processes: a `DecodeWorker` and,
per channel, two `PrefillWorker`s (layer-wise streaming on and off) forced to that channel. Per
request: the decode worker reserves blocks and issues a ticket, the prefill worker computes a
seeded random prompt of `tokens` tokens and pushes its KV, the decode worker admits the request and
decodes `decode_tokens` more tokens. Exposed = decode admission - the prefill's first token, both
wall clocks of one host (`DecodeWorker.transfer_metrics.exposed_s`). The decode step it is compared
with is the same request's TPOT at batch 1 (context = the prompt), stamped as its chunks leave the
decode worker. Prefill = submit to first token on the prefill worker's clock. Streaming on and off
alternate within each round; one short unmeasured request per prefill worker first (model warm-up,
pair setup).

Statistics: medians (`statistics.median`) with min-max over `reps` rounds; ratios are ratios of
medians; GB/s = 1e9 bytes per second of KV payload. Targets (BENCHMARKS.md), checked per row: Gloo
and gRPC >= 60% of raw TCP, shared memory >= 50% of memcpy, exposed time with streaming below one
decode step (the stated target is for a 2k-token prompt). `--json PATH` writes the config, the
machine, every sample and the summaries, and `PATH.png` beside it.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import random
import socket
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext
from pathlib import Path
from typing import Any

import torch
from rich import box
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kv_transfer.ticket import KVLayout, KVTicket
from tandem.bench.common import passive_omp, progress_bar, write_report
from tandem.bench.engine import BenchError, machine_info, stats
from tandem.config import DEFAULT_MODEL, DTYPES, TransferConfig

CHANNELS = ("pair", "grpc", "shm")

# Targets from BENCHMARKS.md (thresholds, not measurements): channel -> (reference, fraction).
# BENCHMARKS.md's targets; a CUDA IPC shm plane is held to its device copy as the CPU one is to
# memcpy (the NCCL pair has no stated target).
TARGET_OF_REFERENCE = {
    ("pair", "tcp"): 0.60,
    ("grpc", "tcp"): 0.60,
    ("shm", "memcpy"): 0.50,
    ("shm", "device_copy"): 0.50,
}
TARGET_EXPOSED_OF_DECODE_STEP = 1.0  # exposed time with streaming < this many decode steps

REFERENCE_NAMES = {"tcp": "TCP", "memcpy": "memcpy", "device_copy": "device copy"}
_HATCHES = {"tcp": "//", "memcpy": "..", "device_copy": "xx"}  # the references in the chart

_FINGERPRINT = "bench-transfer"  # the throughput part has no model; both sides agree on this
_STARTUP_TIMEOUT_S = 300.0
_CALL_TIMEOUT_S = 600.0
_TRANSFER_TIMEOUT_S = 120.0
_WARMUP_PROMPT_TOKENS = 64


@dataclass(frozen=True)
class BenchConfig:
    model: str = DEFAULT_MODEL  # its KV layout sizes the throughput part; it runs the workers
    device: str = "cpu"  # cpu | cuda | cuda:N
    dtype: str = "float32"
    block_size: int = 16
    channels: tuple[str, ...] = CHANNELS
    prompt_tokens: tuple[int, ...] = (512, 2048, 8192)
    reps: int = 5
    exposed_channels: tuple[str, ...] = CHANNELS
    exposed_tokens: tuple[int, ...] = (2048,)  # () skips the worker part
    exposed_reps: int = 3
    decode_tokens: int = 16  # decoded after admission; their TPOT is the decode step
    threads: int = 2  # torch intra-op threads of every process
    seed: int = 0

    def __post_init__(self) -> None:
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("channels", "exposed_channels"):
            unknown = set(getattr(self, name)) - set(CHANNELS)
            if unknown:
                raise ValueError(f"{name}: unknown {sorted(unknown)}; known: {list(CHANNELS)}")
        if not self.channels:
            raise ValueError("channels is empty")
        if not self.prompt_tokens or min(self.prompt_tokens) < 1:
            raise ValueError(f"prompt_tokens must be >= 1 each, got {self.prompt_tokens}")
        if self.exposed_tokens and min(self.exposed_tokens) < 1:
            raise ValueError(f"exposed_tokens must be >= 1 each, got {self.exposed_tokens}")
        for name in ("block_size", "reps", "exposed_reps", "decode_tokens", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def quick(self) -> BenchConfig:
        """A check that the whole pipeline works (a minute on the default model), not a
        measurement."""
        return replace(
            self,
            prompt_tokens=(512,),
            reps=1,
            exposed_tokens=(512,) if self.exposed_tokens else (),
            exposed_reps=1,
            decode_tokens=4,
        )


@dataclass(frozen=True)
class Devices:
    """Where each side runs and which channels can run there."""

    sender: str  # the prefill side
    receiver: str  # the decode side
    channels: tuple[str, ...]
    exposed_channels: tuple[str, ...]
    skipped: dict[str, str]  # channel -> why it does not run


def plan_devices(config: BenchConfig) -> Devices:
    from kv_transfer.shm import shm_available

    skipped: dict[str, str] = {}
    if config.device == "cpu":
        sender = receiver = "cpu"
        if not shm_available():
            skipped["shm"] = "/dev/shm is not writable here"
    else:
        if not torch.cuda.is_available():
            raise BenchError(f"--device {config.device}: CUDA is not available")
        count = torch.cuda.device_count()
        index = torch.device(config.device).index or 0
        if index >= count:
            raise BenchError(f"--device {config.device}: only {count} CUDA device(s)")
        sender, receiver = f"cuda:{index}", f"cuda:{(index + 1) % count}"
        if sender == receiver:
            skipped["pair"] = "NCCL cannot put both ranks on one GPU (needs a second GPU)"
    channels = tuple(c for c in config.channels if c not in skipped)
    if not channels:
        raise BenchError(f"no channel of {list(config.channels)} can run: {skipped}")
    return Devices(
        sender,
        receiver,
        channels,
        tuple(c for c in config.exposed_channels if c not in skipped),
        {c: why for c, why in skipped.items() if c in config.channels + config.exposed_channels},
    )


def reference_of(channel: str, device_type: str) -> str:
    """The physical reference a channel is measured against."""
    if channel in ("shm", "pair") and device_type == "cuda":
        return "device_copy"
    return "memcpy" if channel == "shm" else "tcp"


def target_of(channel: str, reference: str) -> float | None:
    return TARGET_OF_REFERENCE.get((channel, reference))


def channel_label(channel: str, device_type: str) -> str:
    if channel == "pair":
        return "pair (nccl)" if device_type == "cuda" else "pair (gloo)"
    return channel


# --- shared helpers (both processes) ------------------------------------------------------


def block_order(num_blocks: int, seed: int) -> list[int]:
    """A seeded permutation of a cache's blocks: transfers read and write paged, not linear."""
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    return order


def kv_checksum(
    kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], num_tokens: int
) -> float:
    """A checksum of the first `num_tokens` tokens of a block table in every layer, weighted by
    layer, K/V and token position, so misplaced tokens or layers change it."""
    from kv_transfer.layout import gather_tokens, slot_mapping

    cache0 = kv_caches[0]
    slots = slot_mapping(list(block_ids), cache0.shape[2], num_tokens, cache0.device)
    weights = torch.arange(1, 2 * num_tokens + 1, dtype=torch.float64, device=cache0.device)
    total = 0.0
    for layer, cache in enumerate(kv_caches):
        per_token = gather_tokens(cache, slots).sum(dim=(2, 3), dtype=torch.float64)  # [2, n]
        total += (layer + 1) * float((per_token.reshape(-1) * weights).sum())
    return total


def prompt_ids(num_tokens: int, vocab_size: int, key: str, seed: int) -> list[int]:
    """Seeded random token ids (no low, special ids); distinct prompts share no prefix."""
    rng = random.Random(f"{seed}/{key}")
    return [rng.randrange(vocab_size // 8, vocab_size) for _ in range(num_tokens)]


def _greedy(max_tokens: int) -> Any:
    from tandem.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- child processes ----------------------------------------------------------------------


class ChannelReceiver:
    """Receiver process of the throughput part: a KVReceiver and the TCP reference's sink."""

    def __init__(
        self, config: BenchConfig, device: str, layout: KVLayout, num_blocks: int, shm: bool
    ) -> None:
        from kv_transfer import KVReceiver
        from kv_transfer.shm import create_shared_cache

        self.device = torch.device(device)
        self.layout = layout
        self.shm = create_shared_cache(layout, num_blocks, self.device) if shm else None
        shape = (2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        caches = (
            self.shm.kv_caches
            if self.shm is not None
            else [
                torch.zeros(shape, dtype=layout.torch_dtype, device=self.device)
                for _ in range(layout.num_layers)
            ]
        )
        self.receiver = KVReceiver(caches, _FINGERPRINT, shm=self.shm)
        self.blocks = block_order(num_blocks, config.seed + 1)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.conn: socket.socket | None = None
        self.sink = bytearray()

    def info(self) -> dict[str, Any]:
        pairs = self.receiver.pairs
        return {
            "endpoint": self.receiver.endpoint,
            "pair_store": pairs.address if pairs is not None else "",
            "tcp_port": self.listener.getsockname()[1],
        }

    def expect(self, key: str, num_tokens: int) -> KVTicket:
        """Reserve the blocks (zero: the cache starts zeroed; `checksum_and_zero` zeroes again)."""
        blocks = self.blocks[: math.ceil(num_tokens / self.layout.block_size)]
        return self.receiver.expect(key, blocks, num_tokens, timeout_s=_TRANSFER_TIMEOUT_S)

    def arrived(self, key: str, timeout_s: float) -> dict[str, Any]:
        """Poll until the reservation is reported; its outcome and the received bytes' checksum."""
        deadline = time.monotonic() + timeout_s
        while True:
            arrival = next((a for a in self.receiver.poll() if a.request_key == key), None)
            if arrival is not None:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"reservation {key} not reported within {timeout_s} s")
            time.sleep(0.001)
        return {
            "state": arrival.state.name,
            "error": str(arrival.error) if arrival.error else None,
            "nbytes": arrival.nbytes,
            "data_plane": arrival.data_plane,
            "receiver_s": arrival.seconds,
        }

    def checksum_and_zero(self, num_tokens: int) -> float:
        """The received bytes' checksum; then the blocks are zeroed, so that a later transfer
        that writes nothing cannot pass. Zeroed here, not just before the next transfer: the
        shared-memory sender's stores would then find every line dirty in this process's cache
        (+1 ms at 512 tokens, measured), a handicap no memcpy reference and no engine has."""
        from kv_transfer.layout import slot_mapping

        blocks = self.blocks[: math.ceil(num_tokens / self.layout.block_size)]
        total = kv_checksum(self.receiver.kv_caches, blocks, num_tokens)
        slots = slot_mapping(blocks, self.layout.block_size, num_tokens, self.device)
        for cache in self.receiver.kv_caches:
            cache.view(2, -1, *cache.shape[3:]).index_fill_(1, slots, 0)
        _sync(self.device)
        return total

    def tcp_accept(self) -> None:
        self.conn, _ = self.listener.accept()
        self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def tcp_recv(self, nbytes: int) -> int:
        """Receive `nbytes` into a preallocated, touched buffer; answer one byte."""
        assert self.conn is not None
        if len(self.sink) < nbytes:
            self.sink = bytearray(nbytes)  # zero-filled: its pages are touched once, here
        view = memoryview(self.sink)[:nbytes]
        got = 0
        while got < nbytes:
            n = self.conn.recv_into(view[got:])
            if n == 0:
                raise ConnectionError(f"the sender closed after {got} of {nbytes} bytes")
            got += n
        self.conn.sendall(b"k")
        return got

    def close(self) -> None:
        self.receiver.close()
        if self.conn is not None:
            self.conn.close()
        self.listener.close()
        if self.shm is not None:
            self.shm.close()


class ChannelSender:
    """Sender process of the throughput part: one KVSender per channel over a random source
    cache, and the TCP and memcpy references on the same bytes."""

    def __init__(
        self,
        config: BenchConfig,
        device: str,
        layout: KVLayout,
        num_blocks: int,
        channels: tuple[str, ...],
        copy_device: str,
    ) -> None:
        from kv_transfer import KVSender

        self.device = torch.device(device)
        self.copy_device = torch.device(copy_device)  # the device-copy reference's destination
        self.layout = layout
        shape = (2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        gen = torch.Generator().manual_seed(config.seed)
        self.kv_caches = [
            torch.randn(shape, generator=gen).to(dtype=layout.torch_dtype, device=self.device)
            for _ in range(layout.num_layers)
        ]
        self.blocks = block_order(num_blocks, config.seed)
        self.senders = {c: KVSender(_FINGERPRINT, channel=c) for c in channels}
        self.sock: socket.socket | None = None
        self._wire: dict[int, torch.Tensor] = {}  # num_tokens -> every layer's wire bytes, flat
        self._copies: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self._checksums: dict[int, float] = {}

    def info(self) -> dict[str, Any]:
        return {}

    def _source_blocks(self, num_tokens: int) -> list[int]:
        return self.blocks[: math.ceil(num_tokens / self.layout.block_size)]

    def setup_pair(self, endpoint: str, pair_store: str) -> float:
        """Seconds to set up the pair with the receiver (later transfers reuse it)."""
        from kv_transfer.pairs import backend_for

        sender = self.senders["pair"]
        t0 = time.perf_counter()
        sender.pairs.get(
            endpoint, pair_store, backend_for(self.device), sender.pair_setup_timeout_s
        )
        return time.perf_counter() - t0

    def transfer(self, channel: str, ticket: KVTicket) -> dict[str, Any]:
        """One transfer, every layer ready at once; seconds from begin() to DONE."""
        from kv_transfer import TransferState

        sender = self.senders[channel]
        n = ticket.num_tokens
        blocks = self._source_blocks(n)
        t0 = time.perf_counter()
        transfer = sender.begin(ticket, self.kv_caches)
        transfer.set_source(blocks)
        transfer.all_layers_ready()
        transfer.finish(0)
        state = transfer.wait()
        seconds = time.perf_counter() - t0
        sender.poll()
        if state != TransferState.SUCCESS:
            raise RuntimeError(f"{channel} transfer {ticket.request_key}: {transfer.status.error}")
        if transfer.plane_name != channel:
            raise RuntimeError(f"asked for the {channel} plane, got {transfer.plane_name!r}")
        if n not in self._checksums:
            self._checksums[n] = kv_checksum(self.kv_caches, blocks, n)
        return {
            "seconds": seconds,
            "nbytes": transfer.nbytes,
            "data_plane": transfer.plane_name,
            "checksum": self._checksums[n],
        }

    def wire(self, num_tokens: int) -> torch.Tensor:
        """Every layer's wire tensor [2, tokens, heads, dim] back to back, as flat bytes."""
        from kv_transfer.layout import gather_tokens, slot_mapping

        flat = self._wire.get(num_tokens)
        if flat is None:
            blocks = self._source_blocks(num_tokens)
            slots = slot_mapping(blocks, self.layout.block_size, num_tokens, self.device)
            layers = [gather_tokens(c, slots).reshape(-1) for c in self.kv_caches]
            flat = self._wire[num_tokens] = torch.cat(layers).view(torch.uint8)
        return flat

    def tcp_connect(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def tcp_send(self, num_tokens: int) -> dict[str, Any]:
        """Stream the transfer's bytes, layer by layer, until the receiver's one-byte answer."""
        from kv_transfer.layout import as_bytes

        assert self.sock is not None
        data = as_bytes(self.wire(num_tokens).cpu())
        step = self.layout.layer_nbytes(num_tokens)
        t0 = time.perf_counter()
        for offset in range(0, len(data), step):
            self.sock.sendall(data[offset : offset + step])
        if self.sock.recv(1) != b"k":
            raise ConnectionError("the TCP reference's receiver did not answer")
        return {"seconds": time.perf_counter() - t0, "nbytes": len(data)}

    def copy(self, num_tokens: int, reference: str) -> dict[str, Any]:
        """One-way copy of the transfer's bytes between two preallocated tensors: host memcpy,
        or device to device (`device_copy`)."""
        key = (num_tokens, reference)
        if key not in self._copies:
            src = self.wire(num_tokens)
            if reference == "memcpy":
                src = src.cpu()
            dst = torch.empty_like(src, device=self.copy_device if src.is_cuda else src.device)
            dst.copy_(src)  # touch every page before timing
            self._copies[key] = (src, dst)
        src, dst = self._copies[key]
        _sync(src.device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(src.device)
        _sync(dst.device)
        return {"seconds": time.perf_counter() - t0, "nbytes": src.numel()}

    def close(self) -> None:
        for sender in self.senders.values():
            sender.close()
        if self.sock is not None:
            self.sock.close()


class _StreamClock(threading.Thread):
    """Drains a decode request's OutputStream, stamping each chunk."""

    def __init__(self, stream: Any) -> None:
        super().__init__(daemon=True)
        self.stream = stream
        self.stamps: list[tuple[float, int]] = []  # (perf_counter, tokens in the chunk)
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            for chunk in self.stream:
                self.stamps.append((time.perf_counter(), len(chunk.token_ids)))
        except BaseException as e:
            self.error = e


class DecodeSide:
    """Decode process of the exposed-time part: a DecodeWorker on the real model."""

    def __init__(self, config: BenchConfig, device: str, num_blocks: int) -> None:
        from decode_worker.decode_core import DecodeWorker

        self.worker = DecodeWorker(
            _engine_config(config, device, num_blocks),
            # a failure must not turn into a local prefill here
            transfer=TransferConfig(timeout_s=_TRANSFER_TIMEOUT_S, on_failure="fail"),
        )
        self.worker.start()
        self._pending: dict[str, tuple[_StreamClock, int]] = {}

    def info(self) -> dict[str, Any]:
        engine = self.worker.engine
        return {
            "vocab_size": engine.vocab_size,
            "max_model_len": engine.max_model_len,
            "shm": self.worker.shm is not None,
        }

    def reserve(self, key: str, ids: list[int], max_tokens: int) -> KVTicket:
        future, stream = self.worker.reserve(key, ids, _greedy(max_tokens))
        ticket = future.result(_TRANSFER_TIMEOUT_S)
        if ticket is None:
            raise RuntimeError(f"{key}: no ticket (local prefill)")
        self._pending[key] = (_StreamClock(stream), len(self.worker.transfer_metrics.exposed_s))
        return ticket

    def collect(self, key: str, timeout_s: float) -> dict[str, Any]:
        """The request's exposed time, decode step (TPOT) and output length, once it ended."""
        clock, before = self._pending.pop(key)
        clock.join(timeout_s)
        if clock.is_alive():
            raise TimeoutError(f"{key}: not finished within {timeout_s} s")
        if clock.error is not None:
            raise RuntimeError(f"{key}: {clock.error!r}")
        exposed = self.worker.transfer_metrics.exposed_s
        if len(exposed) != before + 1:
            raise RuntimeError(f"{key}: {len(exposed) - before} exposed-time records, not 1")
        n_out = sum(n for _, n in clock.stamps)
        if n_out < 2 or len(clock.stamps) != n_out:
            raise RuntimeError(f"{key}: {n_out} tokens in {len(clock.stamps)} chunks")
        tpot = (clock.stamps[-1][0] - clock.stamps[0][0]) / (n_out - 1)
        return {"exposed_s": exposed[-1], "tpot_s": tpot, "n_out": n_out}

    def close(self) -> None:
        self.worker.close()


class PrefillSide:
    """Prefill process of the exposed-time part: per channel, PrefillWorkers with layer-wise
    streaming on and off."""

    def __init__(self, config: BenchConfig, device: str, num_blocks: int) -> None:
        self.engine_config = _engine_config(config, device, num_blocks)
        self.workers: dict[bool, Any] = {}  # stream_layers -> PrefillWorker
        self.channel = ""

    def info(self) -> dict[str, Any]:
        return {}

    def open(self, channel: str) -> None:
        from prefill_worker.prefill_core import PrefillWorker

        self.close_workers()
        self.channel = channel
        for stream in (True, False):
            transfer = TransferConfig(channel=channel, stream_layers=stream)
            worker = PrefillWorker(self.engine_config, transfer=transfer)
            worker.start()
            self.workers[stream] = worker

    def prefill(
        self, stream: bool, key: str, ids: list[int], max_tokens: int, ticket: KVTicket
    ) -> dict[str, Any]:
        t0 = time.monotonic()
        future = self.workers[stream].submit(key, ids, _greedy(max_tokens), ticket)
        result = future.result(_CALL_TIMEOUT_S)
        if result.data_plane != self.channel:
            raise RuntimeError(f"asked for the {self.channel} plane, got {result.data_plane!r}")
        return {
            "prefill_s": result.prefill_done - t0,
            "sender_tail_s": result.transfer_done - result.prefill_done,
            "nbytes": result.nbytes,
            "data_plane": result.data_plane,
        }

    def close_workers(self) -> None:
        for worker in self.workers.values():
            worker.close()
        self.workers = {}

    def close(self) -> None:
        self.close_workers()


def _engine_config(config: BenchConfig, device: str, num_blocks: int) -> Any:
    from tandem.config import EngineConfig

    return EngineConfig.create(
        config.model,
        dtype=config.dtype,
        device=device,
        num_threads=config.threads,
        block_size=config.block_size,
        num_blocks=num_blocks,
        enable_prefix_caching=False,
    )


_SIDES: dict[str, Any] = {
    "channel_receiver": ChannelReceiver,
    "channel_sender": ChannelSender,
    "decode": DecodeSide,
    "prefill": PrefillSide,
}


def _child_main(
    conn: Connection, side: str, config: BenchConfig, device: str, args: tuple[Any, ...]
) -> None:
    """A child process: build one side, then run the methods the parent sends, one at a time."""
    torch.set_num_threads(config.threads)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    try:
        obj = _SIDES[side](config, device, *args)
        conn.send(("ok", obj.info()))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            method, margs = conn.recv()
        except EOFError:  # the parent is gone
            obj.close()
            return
        try:
            if method == "close":
                obj.close()
                conn.send(("ok", None))
                return
            conn.send(("ok", getattr(obj, method)(*margs)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class Child:
    """The parent's handle on a spawned side: one call at a time, each with a deadline."""

    def __init__(
        self,
        ctx: SpawnContext,
        name: str,
        side: str,
        config: BenchConfig,
        device: str,
        *args: Any,
    ) -> None:
        self.name = name
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=_child_main,
            args=(child_conn, side, config, device, args),
            name=name,
            daemon=True,
        )
        with passive_omp():
            self.process.start()
        child_conn.close()

    def send(self, method: str, *args: Any) -> None:
        self.conn.send((method, args))

    def result(self, timeout_s: float = _CALL_TIMEOUT_S) -> Any:
        if not self.conn.poll(timeout_s):
            raise BenchError(f"{self.name}: no answer within {timeout_s:.0f} s")
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(5)
            raise BenchError(f"{self.name} died (exit code {self.process.exitcode})") from None
        if status == "error":
            raise BenchError(f"{self.name}: {value}")
        return value

    def call(self, method: str, *args: Any, timeout_s: float = _CALL_TIMEOUT_S) -> Any:
        self.send(method, *args)
        return self.result(timeout_s)

    def close(self) -> None:
        try:
            self.conn.send(("close", ()))
            if self.conn.poll(30):
                self.conn.recv()
        except (OSError, EOFError):
            pass
        self.process.join(10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        self.conn.close()


# --- the run ------------------------------------------------------------------------------


def run_transfer_bench(
    config: BenchConfig,
    json_out: str | Path | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run the whole benchmark, print the tables and target checks, return (and write) the
    report."""
    from tandem import hub
    from tandem.model_config import load_config

    console = console or Console()
    devices = plan_devices(config)
    model_path = hub.resolve(config.model)
    cfg = load_config(model_path)
    layout = KVLayout(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, config.block_size, config.dtype
    )
    device_type = torch.device(config.device).type
    report: dict[str, Any] = {
        "benchmark": "transfer",
        "config": asdict(config),
        "method": __doc__,
        "machine": {**machine_info(), **_device_info(devices), "loadavg_start": os.getloadavg()},
        "model_path": str(model_path),
        "layout": {**asdict(layout), "bytes_per_token": layout.layer_nbytes(1) * cfg.num_layers},
        "devices": asdict(devices),
    }
    for channel, why in devices.skipped.items():
        console.print(f"[yellow]skipping {channel}:[/yellow] {why}")
    ctx = mp.get_context("spawn")
    references = sorted({reference_of(c, device_type) for c in devices.channels})
    exposed = devices.exposed_channels if config.exposed_tokens else ()
    units = (len(devices.channels) + len(references)) * (
        1 + config.reps * len(config.prompt_tokens)
    ) + len(exposed) * 2 * (1 + config.exposed_reps * len(config.exposed_tokens))
    with progress_bar(console) as progress:
        task = progress.add_task("starting", total=units)
        report["throughput"] = _bench_channels(
            ctx, config, devices, layout, references, progress, task
        )
        progress.console.print(_throughput_table(config, report))
        if exposed:
            report["exposed"] = _bench_exposed(ctx, config, devices, cfg.vocab_size, progress, task)
            progress.console.print(_exposed_table(config, report))
    report["machine"]["loadavg_end"] = os.getloadavg()  # other processes on the machine
    report["targets"] = check_targets(report)
    met = sum(t["pass"] for t in report["targets"])
    misses = [t["name"] for t in report["targets"] if not t["pass"]]
    console.print(
        f"targets met: {met}/{len(report['targets'])}"
        + (f"  [red]missed:[/red] {'; '.join(misses)}" if misses else "")
    )
    if json_out is not None:
        write_report(report, json_out, write_chart, console)
    return report


def _device_info(devices: Devices) -> dict[str, Any]:
    if not devices.sender.startswith("cuda"):
        return {}
    names = {
        d: torch.cuda.get_device_name(torch.device(d)) for d in (devices.sender, devices.receiver)
    }
    return {"cuda_devices": names, "cuda": torch.version.cuda}


def _bench_channels(
    ctx: SpawnContext,
    config: BenchConfig,
    devices: Devices,
    layout: KVLayout,
    references: list[str],
    progress: Progress,
    task: Any,
) -> dict[str, Any]:
    longest = max(config.prompt_tokens)
    num_blocks = math.ceil(longest / config.block_size)
    progress.update(task, description="throughput: starting sender and receiver")
    shm = "shm" in devices.channels
    rx = Child(
        ctx, "kv-receiver", "channel_receiver", config, devices.receiver, layout, num_blocks, shm
    )
    tx = Child(
        ctx,
        "kv-sender",
        "channel_sender",
        config,
        devices.sender,
        layout,
        num_blocks,
        devices.channels,
        devices.receiver,
    )
    samples: list[dict[str, Any]] = []
    pair_setup_s: float | None = None
    try:
        rx_info = rx.result(_STARTUP_TIMEOUT_S)
        tx.result(_STARTUP_TIMEOUT_S)
        if "tcp" in references:
            rx.send("tcp_accept")
            tx.call("tcp_connect", rx_info["tcp_port"])
            rx.result()
        if "pair" in devices.channels:
            progress.update(task, description="throughput: pair setup")
            pair_setup_s = tx.call("setup_pair", rx_info["endpoint"], rx_info["pair_store"])
        counter = iter(range(1 << 30))

        def measure(what: str, n: int, rep: int | None) -> None:
            phase = "warm-up" if rep is None else f"round {rep + 1}"
            progress.update(task, description=f"throughput {phase}: {what}, {n} tokens")
            if what in CHANNELS:
                sample = _transfer(rx, tx, what, n, f"{what}-{n}-{next(counter)}")
            elif what == "tcp":
                rx.send("tcp_recv", layout.layer_nbytes(n) * layout.num_layers)
                sample = tx.call("tcp_send", n)
                rx.result()
            else:
                sample = tx.call("copy", n, what)
            if rep is not None:
                samples.append({"what": what, "tokens": n, "round": rep, **sample})
            progress.advance(task)

        for what in (*devices.channels, *references):
            measure(what, longest, None)
        for rep in range(config.reps):
            for n in config.prompt_tokens:
                for what in (*devices.channels, *references):
                    measure(what, n, rep)
    finally:
        rx.close()
        tx.close()
    return summarize_throughput(config, devices, samples, pair_setup_s)


def _transfer(rx: Child, tx: Child, channel: str, n: int, key: str) -> dict[str, Any]:
    ticket = rx.call("expect", key, n)
    sent = tx.call("transfer", channel, ticket)
    arrival = rx.call("arrived", key, 30.0)
    if arrival["state"] != "SUCCESS":
        raise BenchError(f"{key}: the receiver reports {arrival['state']}: {arrival['error']}")
    received = rx.call("checksum_and_zero", n)
    if not math.isclose(received, sent["checksum"], rel_tol=1e-9):
        raise BenchError(f"{key}: the received KV differs from the sent KV (checksum)")
    if arrival["nbytes"] != sent["nbytes"]:
        raise BenchError(f"{key}: sent {sent['nbytes']} bytes, received {arrival['nbytes']}")
    return {k: v for k, v in sent.items() if k != "checksum"} | {
        "receiver_s": arrival["receiver_s"]
    }


def summarize_throughput(
    config: BenchConfig,
    devices: Devices,
    samples: list[dict[str, Any]],
    pair_setup_s: float | None,
) -> dict[str, Any]:
    """Per (channel or reference, prompt length): seconds and GB/s; per channel row its
    reference, the ratio of medians and the target."""
    device_type = torch.device(config.device).type
    cells: dict[str, dict[str, Any]] = {}
    for s in samples:
        s["gb_s"] = s["nbytes"] / s["seconds"] / 1e9
    for what in {s["what"] for s in samples}:
        for n in config.prompt_tokens:
            mine = [s for s in samples if s["what"] == what and s["tokens"] == n]
            if mine:
                cells[f"{what}/{n}"] = {
                    "nbytes": mine[0]["nbytes"],
                    "seconds": stats([s["seconds"] for s in mine]),
                    "gb_s": stats([s["gb_s"] for s in mine]),
                }
    rows = []
    for channel in devices.channels:
        reference = reference_of(channel, device_type)
        target = target_of(channel, reference)
        for n in config.prompt_tokens:
            gb_s = cells[f"{channel}/{n}"]["gb_s"]["median"]
            ref_gb_s = cells[f"{reference}/{n}"]["gb_s"]["median"]
            ratio = gb_s / ref_gb_s
            rows.append(
                {
                    "channel": channel,
                    "label": channel_label(channel, device_type),
                    "tokens": n,
                    "nbytes": cells[f"{channel}/{n}"]["nbytes"],
                    "reference": reference,
                    "gb_s": gb_s,
                    "reference_gb_s": ref_gb_s,
                    "ratio": ratio,
                    "target": target,
                    "pass": None if target is None else ratio >= target,
                }
            )
    return {"pair_setup_s": pair_setup_s, "rows": rows, "cells": cells, "samples": samples}


def _bench_exposed(
    ctx: SpawnContext,
    config: BenchConfig,
    devices: Devices,
    vocab_size: int,
    progress: Progress,
    task: Any,
) -> dict[str, Any]:
    max_tokens = config.decode_tokens + 1  # the prefill's first token, then decode_tokens steps
    longest = max(*config.exposed_tokens, _WARMUP_PROMPT_TOKENS)
    num_blocks = math.ceil((longest + max_tokens) / config.block_size) + 2
    progress.update(task, description="exposed: loading the model in both workers")
    d = Child(ctx, "decode-worker", "decode", config, devices.receiver, num_blocks)
    p = Child(ctx, "prefill-worker", "prefill", config, devices.sender, num_blocks)
    samples: list[dict[str, Any]] = []
    try:
        d.result(_STARTUP_TIMEOUT_S)
        p.result(_STARTUP_TIMEOUT_S)

        def request(channel: str, stream: bool, n: int, key: str) -> dict[str, Any]:
            ids = prompt_ids(n, vocab_size, key, config.seed)
            ticket = d.call("reserve", key, ids, max_tokens)
            prefill = p.call("prefill", stream, key, ids, max_tokens, ticket)
            decode = d.call("collect", key, _CALL_TIMEOUT_S)
            return {"channel": channel, "stream": stream, "tokens": n, **prefill, **decode}

        for channel in devices.exposed_channels:
            progress.update(task, description=f"exposed {channel}: loading prefill workers")
            p.call("open", channel, timeout_s=_STARTUP_TIMEOUT_S)
            for stream in (True, False):
                mode = "streaming" if stream else "whole"
                progress.update(task, description=f"exposed {channel}, {mode}: warm-up")
                request(channel, stream, _WARMUP_PROMPT_TOKENS, f"warmup-{channel}-{mode}")
                progress.advance(task)
            for rep in range(config.exposed_reps):
                for n in config.exposed_tokens:
                    for stream in (True, False):
                        mode = "streaming" if stream else "whole"
                        progress.update(
                            task,
                            description=f"exposed round {rep + 1}: {channel}, {mode}, {n} tokens",
                        )
                        sample = request(channel, stream, n, f"{channel}-{mode}-{n}-{rep}")
                        samples.append({"round": rep, **sample})
                        progress.advance(task)
            p.call("close_workers")
    finally:
        p.close()
        d.close()
    return summarize_exposed(config, devices, samples)


def summarize_exposed(
    config: BenchConfig, devices: Devices, samples: list[dict[str, Any]]
) -> dict[str, Any]:
    """Per (channel, prompt length, streaming): exposed time, decode step, prefill; with
    streaming, the target exposed < one decode step."""
    device_type = torch.device(config.device).type
    rows = []
    for channel in devices.exposed_channels:
        for n in config.exposed_tokens:
            for stream in (True, False):
                mine = [
                    s
                    for s in samples
                    if s["channel"] == channel and s["tokens"] == n and s["stream"] == stream
                ]
                if not mine:
                    continue
                exposed = stats([s["exposed_s"] for s in mine])
                step = stats([s["tpot_s"] for s in mine])
                of_step = exposed["median"] / step["median"]
                rows.append(
                    {
                        "channel": channel,
                        "label": channel_label(channel, device_type),
                        "tokens": n,
                        "stream": stream,
                        "nbytes": mine[0]["nbytes"],
                        "exposed_s": exposed,
                        "decode_step_s": step,
                        "prefill_s": stats([s["prefill_s"] for s in mine]),
                        "sender_tail_s": stats([s["sender_tail_s"] for s in mine]),
                        "exposed_of_step": of_step,
                        "pass": of_step < TARGET_EXPOSED_OF_DECODE_STEP if stream else None,
                    }
                )
    return {"rows": rows, "samples": samples}


def check_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every row that has a BENCHMARKS.md target, with its measured value."""
    targets = []
    for row in report["throughput"]["rows"]:
        if row["target"] is not None:
            targets.append(
                {
                    "name": f"{row['label']} / {REFERENCE_NAMES[row['reference']]}, "
                    f"{row['tokens']} tokens",
                    "value": row["ratio"],
                    "at_least": row["target"],
                    "pass": row["pass"],
                }
            )
    for row in report.get("exposed", {}).get("rows", []):
        if row["pass"] is not None:
            targets.append(
                {
                    "name": f"{row['label']} exposed / decode step, {row['tokens']} tokens, "
                    "streaming",
                    "value": row["exposed_of_step"],
                    "below": TARGET_EXPOSED_OF_DECODE_STEP,
                    "pass": row["pass"],
                }
            )
    return targets


# --- output -------------------------------------------------------------------------------


def _fmt(s: dict[str, float], scale: float = 1.0, spread: bool = True) -> str:
    """median (min-max) of a stats dict, times `scale`; 3 significant digits or so, to keep the
    tables within 80 columns."""
    values = [s[k] * scale for k in ("median", "min", "max")]
    d = 2 if values[0] < 10 else 1 if values[0] < 100 else 0
    med, lo, hi = (f"{v:.{d}f}" for v in values)
    return f"{med} [dim]({lo}-{hi})[/dim]" if spread else med


def _verdict(ok: bool | None) -> str:
    if ok is None:
        return ""
    return "[green]PASS[/green]" if ok else "[red]MISS[/red]"


def _table(title: str, columns: Sequence[str]) -> Table:
    table = Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 0, 0, 1),
        pad_edge=False,
        show_edge=False,
    )
    for name in columns:
        table.add_column(name, justify="left" if name == "channel" else "right", no_wrap=True)
    table.add_column("")
    return table


def _throughput_table(config: BenchConfig, report: dict[str, Any]) -> Table:
    layout, res = report["layout"], report["throughput"]
    table = _table(
        f"KV transfer throughput ({config.device}): {layout['num_layers']} layers x "
        f"{layout['num_kv_heads']} KV heads x {layout['head_dim']}, {layout['dtype']}, "
        f"{layout['bytes_per_token'] / 1e3:.1f} KB/token; median (min-max) of {config.reps}",
        ("channel", "tokens", "MB", "GB/s", "ref GB/s", "ratio", "target"),
    )
    cells = res["cells"]
    for row in res["rows"]:
        mine = cells[f"{row['channel']}/{row['tokens']}"]
        ref = cells[f"{row['reference']}/{row['tokens']}"]
        table.add_row(
            row["label"],
            str(row["tokens"]),
            f"{row['nbytes'] / 1e6:.1f}",
            _fmt(mine["gb_s"]),
            f"{REFERENCE_NAMES[row['reference']]} {_fmt(ref['gb_s'], spread=False)}",
            f"{row['ratio']:.0%}",
            "" if row["target"] is None else f">={row['target']:.0%}",
            _verdict(row["pass"]),
        )
    if res["pair_setup_s"] is not None:
        table.caption = (
            f"pair setup (OpenPair, rendezvous, group), once: {res['pair_setup_s'] * 1e3:.0f} ms"
        )
        table.caption_justify = "left"
    return table


def _exposed_table(config: BenchConfig, report: dict[str, Any]) -> Table:
    table = _table(
        f"exposed transfer time = decode admission - prefill's first token, real workers "
        f"({config.model}); median (min-max) of {config.exposed_reps}",
        ("channel", "tokens", "stream", "prefill s", "exposed ms", "step ms", "/ step"),
    )
    for row in report["exposed"]["rows"]:
        table.add_row(
            row["label"],
            str(row["tokens"]),
            "on" if row["stream"] else "off",
            _fmt(row["prefill_s"], spread=False),
            _fmt(row["exposed_s"], 1e3),
            _fmt(row["decode_step_s"], 1e3, spread=False),
            f"{row['exposed_of_step']:.2f}",
            _verdict(row["pass"]),
        )
    table.caption = (
        "step = one decode step (TPOT at batch 1 after the prompt); target with streaming: "
        "exposed < 1 step"
    )
    table.caption_justify = "left"
    return table


def write_chart(report: dict[str, Any], path: Path) -> None:
    """Left: GB/s by prompt length, channels beside their references (median, min-max; log
    scale). Right: exposed time with and without streaming per channel, and the decode step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    config, res = report["config"], report["throughput"]
    exposed = report.get("exposed")
    fig, axes = plt.subplots(1, 2 if exposed else 1, figsize=(12 if exposed else 7, 4.8))
    ax_gb = axes[0] if exposed else axes
    tokens = config["prompt_tokens"]
    whats = [r["channel"] for r in res["rows"] if r["tokens"] == tokens[0]]
    whats += sorted({r["reference"] for r in res["rows"]})
    labels = {r["channel"]: r["label"] for r in res["rows"]} | {
        k: f"{v} (reference)" for k, v in REFERENCE_NAMES.items()
    }
    colors = {"pair": "tab:blue", "grpc": "tab:orange", "shm": "tab:green"}
    width = 0.8 / len(whats)
    for j, what in enumerate(whats):
        for i, n in enumerate(tokens):
            s = res["cells"][f"{what}/{n}"]["gb_s"]
            ax_gb.bar(
                i + (j - (len(whats) - 1) / 2) * width,
                s["median"],
                width,
                yerr=[[s["median"] - s["min"]], [s["max"] - s["median"]]],
                capsize=2,
                color=colors.get(what, "lightgray"),
                hatch=_HATCHES.get(what, ""),
                edgecolor="black" if what not in colors else None,
                label=labels[what] if i == 0 else None,
            )
    ax_gb.set_yscale("log")
    top = max(c["gb_s"]["max"] for c in res["cells"].values())
    ax_gb.set_ylim(top=top * 12)  # room for the legend above the bars
    ax_gb.set_xticks(range(len(tokens)), [f"{n} tokens" for n in tokens])
    ax_gb.set_ylabel("GB/s")
    ax_gb.set_title(f"throughput ({config['device']}), median of {config['reps']}")
    ax_gb.legend(fontsize=8, ncols=2, loc="upper left")
    if exposed:
        ax_ex = axes[1]
        groups = [(r["label"], r["tokens"]) for r in exposed["rows"] if r["stream"]]
        for i, (label, n) in enumerate(groups):
            for j, stream in enumerate((True, False)):
                row = next(
                    r
                    for r in exposed["rows"]
                    if (r["label"], r["tokens"], r["stream"]) == (label, n, stream)
                )
                s = row["exposed_s"]
                ax_ex.bar(
                    i + (j - 0.5) * 0.38,
                    s["median"] * 1e3,
                    0.38,
                    yerr=[[(s["median"] - s["min"]) * 1e3], [(s["max"] - s["median"]) * 1e3]],
                    capsize=3,
                    color="tab:blue" if stream else "tab:gray",
                    label=("layer-wise streaming" if stream else "after the prefill")
                    if i == 0
                    else None,
                )
                ax_ex.annotate(
                    f"{s['median'] * 1e3:.1f}",
                    (i + (j - 0.5) * 0.38, s["median"] * 1e3),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                    xytext=(0, 2),
                    textcoords="offset points",
                )
            step = next(r for r in exposed["rows"] if (r["label"], r["tokens"]) == (label, n))
            ax_ex.hlines(
                step["decode_step_s"]["median"] * 1e3,
                i - 0.45,
                i + 0.45,
                colors="tab:red",
                linestyles="--",
                label="one decode step" if i == 0 else None,
            )
        ax_ex.set_xticks(range(len(groups)), [f"{label}\n{n} tokens" for label, n in groups])
        ax_ex.set_ylabel("exposed transfer time, ms")
        ax_ex.set_title(f"exposed time, real workers, median of {config['exposed_reps']}")
        ax_ex.legend(fontsize=8)
    fig.suptitle(f"tandem bench transfer: {config['model']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
