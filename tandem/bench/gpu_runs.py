"""The measurements of the GPU check (`gpu.py`), on one CUDA device.

Each builds its model on the GPU with random weights (a decode step's speed does not depend on
their values; nothing is downloaded) and frees it before it returns. Imports torch, transformers
and the engine core only: the GPU machine has no more of Tandem's dependencies.
"""

from __future__ import annotations

import functools
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import torch

from tandem.engine.attention import SeqSpec, TorchSDPABackend, TritonPagedBackend
from tandem.engine.cuda_graphs import CudaGraphs
from tandem.engine.kv_quant import kv_bytes_per_token
from tandem.engine.models.llama import LlamaForCausalLM
from tandem.engine.request import Request
from tandem.engine.runner import ModelRunner
from tandem.engine.scheduler import ScheduledRequest, SchedulerOutput
from tandem.engine.spec.heads import hf_config
from tandem.model_config import ModelConfig
from tandem.sampling_params import SamplingParams

BLOCK_SIZE = 16
P = ParamSpec("P")
R = TypeVar("R")


def frees(measure: Callable[P, R]) -> Callable[P, R]:
    """`measure`, with whatever it allocated on the GPU given back once it returns."""

    @functools.wraps(measure)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return measure(*args, **kwargs)
        finally:  # its frame, and the model in it, is gone
            gc.collect()
            torch.cuda.empty_cache()

    return run


def cuda_time(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of `fn`, by CUDA events."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


@frees
def copy_bandwidth(device: torch.device, gib: float = 4.0, repeats: int = 10) -> float:
    """Bytes per second of a device-to-device `copy_` of `gib` GiB, counting bytes read and
    written, median of `repeats`: the HBM bandwidth a decode step can hope for."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    return 2 * n / statistics.median(cuda_time(lambda: dst.copy_(src), repeats))


@dataclass(frozen=True)
class DecodeTiming:
    step_s: float  # median seconds of one decode step (the engine step, or generate's)
    weight_bytes: int  # a step reads (0 where not counted)
    kv_bytes_per_token: int


@frees
@torch.inference_mode()
def engine_decode(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    batch: int,
    context: int,
    steps: int,
    graphs: bool,
) -> DecodeTiming:
    """The engine's decode step (`ModelRunner.execute`: inputs, attention metadata, forward,
    logits, greedy sampling) for `batch` requests of `context` tokens each, whose KV the cache
    already holds; Triton attention, with CUDA graphs or eager. Every step decodes the same
    position: its work is that of a step at this context."""
    backend = TritonPagedBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, BLOCK_SIZE)
    model = LlamaForCausalLM(cfg, backend, dtype, device).eval()
    blocks_per_req = -(-(context + 1) // BLOCK_SIZE)
    runner = ModelRunner(model, batch * blocks_per_req, BLOCK_SIZE, dtype, device)
    if graphs:
        runner.graphs = CudaGraphs(model, (batch,), (1,), context + 1)
    params = SamplingParams(max_tokens=steps, temperature=0.0)
    requests = [
        Request(f"r{i}", [i % cfg.vocab_size] * (context + 1), params) for i in range(batch)
    ]
    for r in requests:
        r.num_computed_tokens = context
    out = SchedulerOutput([ScheduledRequest(r, 1) for r in requests], [])
    tables = {
        r.request_id: list(range(i * blocks_per_req, (i + 1) * blocks_per_req))
        for i, r in enumerate(requests)
    }
    for _ in range(3):  # warm-up: compiles the kernels, captures the graph
        runner.execute(out, tables)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        runner.execute(out, tables)  # returns the sampled tokens: synchronised
        times.append(time.perf_counter() - start)
    weight_bytes = model.decode_weight_bytes(batch)
    return DecodeTiming(statistics.median(times), weight_bytes, kv_bytes_per_token(cfg, dtype))


@frees
@torch.inference_mode()
def logits_agree(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> float:
    """Largest difference between the logits of one decode step run eagerly on the SDPA backend
    and on the Triton backend with a CUDA graph, on the same weights and KV, relative to the
    largest logit."""
    logits = []
    for backend_cls, graphs in ((TorchSDPABackend, False), (TritonPagedBackend, True)):
        torch.manual_seed(0)
        backend = backend_cls(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, BLOCK_SIZE)
        model = LlamaForCausalLM(cfg, backend, dtype, device).eval()
        runner = ModelRunner(model, 8, BLOCK_SIZE, dtype, device)
        for cache in runner.kv_caches:
            cache.normal_()
        ids = torch.tensor([1, 2], device=device)
        positions = torch.tensor([40, 70], device=device)
        seqs = [SeqSpec(40, 1, [0, 1, 2]), SeqSpec(70, 1, [4, 5, 6, 7, 3])]
        hidden = None
        if graphs:
            hidden = CudaGraphs(model, (2,), (1,), 128).run(ids, positions, seqs, runner.kv_caches)
        if hidden is None:
            meta = backend.build_metadata(seqs, device)
            hidden = model(ids, positions, runner.kv_caches, meta)
        logits.append(model.compute_logits(hidden))
    return ((logits[0] - logits[1]).abs().max() / logits[0].abs().max()).item()


@frees
@torch.inference_mode()
def hf_decode(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    batch: int,
    context: int,
    steps: int,
) -> DecodeTiming:
    """transformers' `generate` on the same model shape: SDPA attention, a static cache, no
    compilation; a decode step is (time of 1 + steps new tokens - time of 1) / steps."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_dict(hf_config(cfg))
    config._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    ids = torch.randint(0, cfg.vocab_size, (batch, context), device=device)
    options: dict[str, Any] = dict(
        do_sample=False, cache_implementation="static", pad_token_id=0, eos_token_id=None
    )
    if "disable_compile" in GenerationConfig().to_dict():
        options["disable_compile"] = True

    def generate(new: int) -> float:
        config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, **options)
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    generate(2)  # warm-up
    step = (generate(1 + steps) - generate(1)) / steps
    # the bytes a step reads: every weight but the embedding table (a gather), unless tied
    weight_bytes = sum(p.nbytes for p in model.parameters())
    if not cfg.tie_word_embeddings:
        weight_bytes -= model.get_input_embeddings().weight.nbytes
    return DecodeTiming(step, weight_bytes, kv_bytes_per_token(cfg, dtype))
