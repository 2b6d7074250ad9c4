"""How the engine benchmarks drive and bound a decode step: greedy requests of exactly N tokens,
the kernel floor (a model's linear layers alone at batch 1, back to back) and the machine's read
bandwidth (over the bytes a step reads, the memory roofline)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import torch

from tandem.engine import SamplingParams

_BANDWIDTH_TRIALS = 5
_KERNEL_WARMUP_STEPS = 2


def greedy_params(new_tokens: int) -> SamplingParams:
    """Greedy decoding of exactly `new_tokens` tokens (EOS ignored)."""
    return SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)


class LinearLayer(Protocol):
    """What the kernel floor runs: `nn.Linear`, the quantized layers, an LM head."""

    @property
    def in_features(self) -> int: ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


def kernel_steps_per_s(
    layers: Sequence[LinearLayer], steps: int, dtype: torch.dtype, device: torch.device
) -> float:
    """Batch-1 steps per second of `layers` alone, run back to back, on inputs in `dtype`."""
    features = {layer.in_features for layer in layers}
    inputs = {f: torch.randn(1, f, dtype=dtype, device=device) for f in features}
    pairs = [(layer, inputs[layer.in_features]) for layer in layers]  # x: [1, in_features]
    with torch.inference_mode():
        for _ in range(_KERNEL_WARMUP_STEPS):
            for layer, x in pairs:
                layer(x)
        t0 = time.perf_counter()
        for _ in range(steps):
            for layer, x in pairs:
                layer(x)
        return steps / (time.perf_counter() - t0)


def read_bandwidth(nbytes: int, trials: int = _BANDWIDTH_TRIALS) -> tuple[float, list[float]]:
    """(bytes/s of the best trial, seconds of every trial) for `t.sum()` over `nbytes` float32."""
    t = torch.ones(nbytes // 4, dtype=torch.float32)
    t.sum()  # warm: pages touched, kernels loaded
    seconds = []
    for _ in range(trials):
        t0 = time.perf_counter()
        t.sum()
        seconds.append(time.perf_counter() - t0)
    return t.numel() * t.element_size() / min(seconds), seconds
