"""The exposed-time part of `tandem bench transfer`, one side per child process: a
`DecodeWorker` that reserves blocks, issues tickets and times each request's exposed transfer and
decode step, and per channel two `PrefillWorker`s (layer-wise streaming on and off) that push
the prompt's KV; both on the real model."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

from decode_worker.decode_core import DecodeWorker
from kv_transfer.ticket import KVTicket
from prefill_worker.prefill_core import PrefillWorker
from tandem.bench.engine_probes import greedy_params
from tandem.bench.transfer_config import CALL_TIMEOUT_S, TRANSFER_TIMEOUT_S, TransferBenchConfig
from tandem.config import EngineConfig, TransferConfig


def prompt_ids(num_tokens: int, vocab_size: int, key: str, seed: int) -> list[int]:
    """Seeded random token ids (no low, special ids); distinct prompts share no prefix."""
    rng = random.Random(f"{seed}/{key}")
    return [rng.randrange(vocab_size // 8, vocab_size) for _ in range(num_tokens)]


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

    def __init__(
        self, config: TransferBenchConfig, device: str, num_blocks: int, tp: int = 1
    ) -> None:
        self.worker = DecodeWorker(
            _engine_config(config, device, num_blocks, tp),
            # a failure must not turn into a local prefill here
            transfer=TransferConfig(timeout_s=TRANSFER_TIMEOUT_S, on_failure="fail"),
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
        future, stream = self.worker.reserve(key, ids, greedy_params(max_tokens))
        ticket = future.result(TRANSFER_TIMEOUT_S)
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

    def __init__(
        self, config: TransferBenchConfig, device: str, num_blocks: int, tp: int = 1
    ) -> None:
        self.engine_config = _engine_config(config, device, num_blocks, tp)
        self.workers: dict[bool, Any] = {}  # stream_layers -> PrefillWorker
        self.channel = ""

    def info(self) -> dict[str, Any]:
        return {}

    def open(self, channel: str) -> None:
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
        future = self.workers[stream].submit(key, ids, greedy_params(max_tokens), ticket)
        result = future.result(CALL_TIMEOUT_S)
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


def _engine_config(
    config: TransferBenchConfig, device: str, num_blocks: int, tp: int
) -> EngineConfig:
    """A worker's engine of `tp` ranks, which share the side's threads."""
    return EngineConfig.create(
        config.model,
        dtype=config.dtype,
        device=device,
        tensor_parallel_size=tp,
        num_threads=max(1, config.threads // tp),
        block_size=config.block_size,
        num_blocks=num_blocks,
        enable_prefix_caching=False,
    )
