"""`tandem bench calibrate`: measure the real engine's step times and fit a `SimProfile`.

Steps measured on the real EngineCore (colocated role, greedy, ignore_eos): a whole prompt of
each length in one step (prefill samples), and decode steps of a batch of requests at each batch
size and context (decode samples, averaged over `decode_steps` steps after the prompts are in).
KV bytes per token come from the model's layout; transfer bandwidth and latency are given (they
are the network's, not the engine's). The fit is least squares (tandem/engine/sim.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console

from tandem import hub
from tandem.config import EngineConfig
from tandem.engine.dtypes import kv_dtype
from tandem.engine.engine_core import EngineCore
from tandem.engine.kv_quant import kv_bytes_per_token
from tandem.engine.sim import SimProfile, fit_profile
from tandem.model_config import load_config
from tandem.sampling_params import SamplingParams


@dataclass(frozen=True)
class CalibrateConfig:
    model: str = "smollm2-135m"
    dtype: str = "float32"
    threads: int | None = 2
    prefill_lengths: tuple[int, ...] = (64, 256, 512)
    batches: tuple[int, ...] = (1, 4, 16)
    contexts: tuple[int, ...] = (64, 512)
    decode_steps: int = 6
    transfer_bytes_per_s: float = 10e9
    transfer_latency_s: float = 0.0005


def _prompt(i: int, n: int, vocab: int) -> list[int]:
    return [(7 + 31 * i + 17 * j) % (vocab - 3) + 3 for j in range(n)]


def measure(config: CalibrateConfig, console: Console | None = None) -> list[dict[str, float]]:
    longest = max((*config.prefill_lengths, *config.contexts)) + config.decode_steps + 8
    engine_cfg = EngineConfig.create(
        config.model,
        dtype=config.dtype,
        num_threads=config.threads,
        max_num_seqs=max(config.batches),
        max_num_batched_tokens=max(longest, 2048),
        enable_prefix_caching=False,
        num_blocks=max(config.batches) * (longest // 16 + 2) + 64,
    )
    engine = EngineCore(engine_cfg)
    vocab = engine.vocab_size
    samples: list[dict[str, float]] = []
    ids = iter(range(1 << 30))

    def say(text: str) -> None:
        if console is not None:
            console.print(f"[dim]{text}[/dim]")

    def run_prefill(n: int) -> float:
        rid = f"p{next(ids)}"
        engine.add_request(rid, _prompt(hash(rid) % 1000, n, vocab), SamplingParams(max_tokens=1))
        t0 = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - t0
        while engine.has_unfinished():
            engine.step()
        return seconds

    run_prefill(min(config.prefill_lengths))  # warm-up
    for n in config.prefill_lengths:
        seconds = min(run_prefill(n) for _ in range(2))
        samples.append(
            {"prefill_tokens": n, "decode_batch": 0, "decode_context": 0, "step_s": seconds}
        )
        say(f"prefill {n} tokens: {seconds * 1e3:.1f} ms")
    for ctx in config.contexts:
        for batch in config.batches:
            params = SamplingParams(
                max_tokens=config.decode_steps + 2, temperature=0.0, ignore_eos=True
            )
            rids = [f"d{next(ids)}" for _ in range(batch)]
            for i, rid in enumerate(rids):
                engine.add_request(rid, _prompt(i, ctx, vocab), params)
            reqs = [engine.scheduler.requests[r] for r in rids]
            while any(r.num_computed_tokens < ctx for r in reqs):
                engine.step()  # the prompts (and the first tokens)
            times: list[float] = []
            contexts: list[int] = []
            for _ in range(config.decode_steps):
                contexts.append(sum(r.num_tokens for r in reqs))
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
            while engine.has_unfinished():
                engine.step()
            seconds = sorted(times)[len(times) // 2]
            context = sum(contexts) / len(contexts)
            samples.append(
                {
                    "prefill_tokens": 0,
                    "decode_batch": batch,
                    "decode_context": context,
                    "step_s": seconds,
                }
            )
            say(f"decode batch {batch} at context {ctx}: {seconds * 1e3:.1f} ms/step")
    return samples


def calibrate(config: CalibrateConfig, console: Console | None = None) -> SimProfile:
    samples = measure(config, console)
    engine_cfg = EngineConfig.create(config.model, dtype=config.dtype)
    cfg = load_config(hub.resolve(config.model))
    source: dict[str, Any] = {
        "model": config.model,
        "dtype": config.dtype,
        "threads": config.threads,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "transfer": "assumed, not measured",
    }
    return fit_profile(
        samples,
        kv_bytes_per_token=kv_bytes_per_token(cfg, kv_dtype(engine_cfg)),
        transfer_bytes_per_s=config.transfer_bytes_per_s,
        transfer_latency_s=config.transfer_latency_s,
        source=source,
    )


def fit_error(profile: SimProfile, samples: Sequence[dict[str, float]]) -> float:
    """The largest relative error of the fitted model over the samples."""
    worst = 0.0
    for s in samples:
        predicted = profile.time_of(s["prefill_tokens"], s["decode_batch"], s["decode_context"])
        worst = max(worst, abs(predicted - s["step_s"]) / max(s["step_s"], 1e-9))
    return worst
