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
decodes `decode_tokens` more tokens. The workers run at each (prefill TP, decode TP) of
`exposed_tp` in turn (default TP 1 -> 1, 3 -> 1 and 1 -> 3: the prefill side's ranks' heads
assembled into one decode cache, or one cache's heads split over three decode ranks; a TP
worker's ranks share the side's `threads`; on shm the sender writes each decode rank's heads into
that rank's shared cache).
Exposed = decode admission - the prefill's first token, both
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

import contextlib
import math
import multiprocessing as mp
import os
from dataclasses import asdict
from multiprocessing.context import SpawnContext
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress

from kv_transfer.ticket import KVLayout
from tandem import hub
from tandem.bench.common import BenchError, write_report
from tandem.bench.machine import machine_info
from tandem.bench.transfer_child import Child
from tandem.bench.transfer_config import (
    CALL_TIMEOUT_S,
    CHANNELS,
    STARTUP_TIMEOUT_S,
    Devices,
    TransferBenchConfig,
    plan_devices,
    reference_of,
)
from tandem.bench.transfer_report import exposed_table, throughput_table, write_chart
from tandem.bench.transfer_stats import check_targets, summarize_exposed, summarize_throughput
from tandem.bench.transfer_workers import prompt_ids
from tandem.engine.tp.shard import check_tensor_parallel
from tandem.model_config import load_config
from tandem.progress import progress_bar

_WARMUP_PROMPT_TOKENS = 64


# --- the run ------------------------------------------------------------------------------


def run_transfer_bench(
    config: TransferBenchConfig,
    json_out: str | Path | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run the whole benchmark, print the tables and target checks, return (and write) the
    report."""
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
    try:  # a split the model cannot take, before any process starts
        for size in {n for tp in devices.exposed_tp for n in tp}:
            check_tensor_parallel(cfg, size)
    except ValueError as e:
        raise BenchError(f"exposed_tp {list(devices.exposed_tp)}: {e}") from None
    ctx = mp.get_context("spawn")
    references = sorted({reference_of(c, device_type) for c in devices.channels})
    exposed = [
        (tp, channel)
        for tp in (devices.exposed_tp if config.exposed_tokens else ())
        for channel in devices.exposed_channels
    ]
    units = (len(devices.channels) + len(references)) * (
        1 + config.reps * len(config.prompt_tokens)
    ) + len(exposed) * 2 * (1 + config.exposed_reps * len(config.exposed_tokens))
    with progress_bar(console) as progress:
        task = progress.add_task("starting", total=units)
        report["throughput"] = _bench_channels(
            ctx, config, devices, layout, references, progress, task
        )
        progress.console.print(throughput_table(config, report))
        if exposed:
            report["exposed"] = _bench_exposed(ctx, config, devices, cfg.vocab_size, progress, task)
            progress.console.print(exposed_table(config, report))
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
    config: TransferBenchConfig,
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
    samples: list[dict[str, Any]] = []
    pair_setup_s: float | None = None
    with contextlib.ExitStack() as children:
        rx = _start(
            children,
            ctx,
            "kv-receiver",
            "channel_receiver",
            config,
            devices.receiver,
            layout,
            num_blocks,
            shm,
        )
        tx = _start(
            children,
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
        rx_info = rx.result(STARTUP_TIMEOUT_S)
        tx.result(STARTUP_TIMEOUT_S)
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
    return summarize_throughput(config, devices, samples, pair_setup_s)


def _start(
    children: contextlib.ExitStack, ctx: SpawnContext, name: str, side: str, *args: Any
) -> Child:
    """A side in its child process (`Child`), closed when `children` closes."""
    return children.enter_context(contextlib.closing(Child(ctx, name, side, *args)))


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


def _bench_exposed(
    ctx: SpawnContext,
    config: TransferBenchConfig,
    devices: Devices,
    vocab_size: int,
    progress: Progress,
    task: Any,
) -> dict[str, Any]:
    samples: list[dict[str, Any]] = []
    for tp in devices.exposed_tp:
        samples += _exposed_samples(ctx, config, devices, tp, vocab_size, progress, task)
    return summarize_exposed(config, devices, samples)


def _exposed_samples(
    ctx: SpawnContext,
    config: TransferBenchConfig,
    devices: Devices,
    tp: tuple[int, int],
    vocab_size: int,
    progress: Progress,
    task: Any,
) -> list[dict[str, Any]]:
    """The exposed-time samples of workers of (prefill TP, decode TP) `tp`, every channel."""
    max_tokens = config.decode_tokens + 1  # the prefill's first token, then decode_tokens steps
    longest = max(*config.exposed_tokens, _WARMUP_PROMPT_TOKENS)
    num_blocks = math.ceil((longest + max_tokens) / config.block_size) + 2
    sizes = f"P TP {tp[0]} -> D TP {tp[1]}"
    progress.update(task, description=f"exposed {sizes}: loading the model in both workers")
    samples: list[dict[str, Any]] = []
    with contextlib.ExitStack() as children:
        d = _start(
            children, ctx, "decode-worker", "decode", config, devices.receiver, num_blocks, tp[1]
        )
        p = _start(
            children, ctx, "prefill-worker", "prefill", config, devices.sender, num_blocks, tp[0]
        )
        d.result(STARTUP_TIMEOUT_S)
        p.result(STARTUP_TIMEOUT_S)

        def request(channel: str, stream: bool, n: int, key: str) -> dict[str, Any]:
            ids = prompt_ids(n, vocab_size, key, config.seed)
            ticket = d.call("reserve", key, ids, max_tokens)
            prefill = p.call("prefill", stream, key, ids, max_tokens, ticket)
            decode = d.call("collect", key, CALL_TIMEOUT_S)
            sample = {"tp": list(tp), "channel": channel, "stream": stream, "tokens": n}
            return sample | prefill | decode

        for channel in devices.exposed_channels:
            progress.update(task, description=f"exposed {sizes}, {channel}: loading prefill")
            p.call("open", channel, timeout_s=STARTUP_TIMEOUT_S)
            for stream in (True, False):
                mode = "streaming" if stream else "whole"
                progress.update(task, description=f"exposed {sizes}, {channel}, {mode}: warm-up")
                request(channel, stream, _WARMUP_PROMPT_TOKENS, f"warmup-{channel}-{mode}")
                progress.advance(task)
            for rep in range(config.exposed_reps):
                for n in config.exposed_tokens:
                    for stream in (True, False):
                        mode = "streaming" if stream else "whole"
                        progress.update(
                            task,
                            description=f"exposed round {rep + 1}: {sizes}, {channel}, {mode}, "
                            f"{n} tokens",
                        )
                        sample = request(channel, stream, n, f"{channel}-{mode}-{n}-{rep}")
                        samples.append({"round": rep, **sample})
                        progress.advance(task)
            p.call("close_workers")
    return samples
