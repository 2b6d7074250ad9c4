"""What `tandem bench transfer` measures: the channels, their physical references and
BENCHMARKS.md's targets, the run's config (`TransferBenchConfig`) and where each side runs
(`Devices`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kv_transfer.shm import shm_available
from tandem.bench.common import BenchError
from tandem.config import DEFAULT_MODEL, DTYPES

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

# Deadlines of the parent's calls into its child processes and of one transfer.
STARTUP_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 600.0
TRANSFER_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class TransferBenchConfig:
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
    # (prefill TP, decode TP) of the exposed-time part's workers (the default model's heads
    # split over 3 ranks; the transfer assembles or splits them, docs/kv_transfer.md)
    exposed_tp: tuple[tuple[int, int], ...] = ((1, 1), (3, 1), (1, 3))
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
        if not self.exposed_tp or any(len(tp) != 2 or min(tp) < 1 for tp in self.exposed_tp):
            raise ValueError(
                f"exposed_tp must name (prefill, decode) TP sizes >= 1, got {self.exposed_tp}"
            )
        for name in ("block_size", "reps", "exposed_reps", "decode_tokens", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def quick(self) -> TransferBenchConfig:
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
    exposed_tp: tuple[tuple[int, int], ...]  # (prefill TP, decode TP) of the exposed part
    skipped: dict[str, str]  # channel (or "tensor parallel") -> why it does not run


def plan_devices(config: TransferBenchConfig) -> Devices:
    """The sender's and receiver's devices, and the channels that cannot run there (with why)."""
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
    skipped = {
        c: why for c, why in skipped.items() if c in config.channels + config.exposed_channels
    }
    exposed_tp = config.exposed_tp
    if config.device != "cpu" and any(tp != (1, 1) for tp in exposed_tp):
        exposed_tp = tuple(tp for tp in exposed_tp if tp == (1, 1))
        skipped["tensor parallel"] = (
            "a worker's ranks take GPUs 0..N-1, which the sender and receiver share: the TP "
            "rows run on the CPU"
        )
    return Devices(
        sender,
        receiver,
        channels,
        tuple(c for c in config.exposed_channels if c not in skipped),
        exposed_tp,
        skipped,
    )


def reference_of(channel: str, device_type: str) -> str:
    """The physical reference a channel is measured against."""
    if channel in ("shm", "pair") and device_type == "cuda":
        return "device_copy"
    return "memcpy" if channel == "shm" else "tcp"


def target_of(channel: str, reference: str) -> float | None:
    """The BENCHMARKS.md target of a channel against its reference, if it has one."""
    return TARGET_OF_REFERENCE.get((channel, reference))


def channel_label(channel: str, device_type: str, tp: tuple[int, int] = (1, 1)) -> str:
    """A channel as the tables name it: the pair says its backend; workers of other TP sizes
    than 1 say theirs."""
    label = channel
    if channel == "pair":
        label = "pair (nccl)" if device_type == "cuda" else "pair (gloo)"
    return label if tp == (1, 1) else f"{label}, P TP {tp[0]} -> D TP {tp[1]}"
