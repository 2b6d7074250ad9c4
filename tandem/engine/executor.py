"""What runs an engine's steps, built from its config: the model, its runner, the KV blocks.

`ModelSettings.engine` picks the kind here (`EXECUTORS`) and nowhere else: "real" loads the
weights onto a `ModelRunner`; "sim" (sim.py) stands the real model's config, without weights, on
a `SimRunner` that sleeps the modelled step times, and has a decode worker see each KV arrival
once its modelled transfer would be done. `EngineCore` and the workers use what is built here
without knowing which kind it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from tandem.config import CacheConfig, EngineConfig
from tandem.engine.attention import TritonPagedBackend, backend_class
from tandem.engine.cuda_graphs import CudaGraphs, batch_buckets
from tandem.engine.dtypes import kv_dtype, model_device, model_dtype
from tandem.engine.kv_quant import kv_bytes_per_token
from tandem.engine.models import load_model
from tandem.engine.models.llama import LlamaForCausalLM
from tandem.engine.runner import ModelRunner
from tandem.engine.scheduler import Scheduler
from tandem.engine.sim import (
    ArrivalSource,
    HeldArrivals,
    SimModel,
    SimProfile,
    SimRunner,
    TimedArrival,
)
from tandem.engine.spec.draft import draft_kv_bytes_per_block
from tandem.model_config import load_config

Model = LlamaForCausalLM | SimModel
Runner = ModelRunner | SimRunner

A = TypeVar("A", bound=TimedArrival)


@dataclass(frozen=True)
class Executor:
    model: Model
    runner: Runner
    num_blocks: int  # of the KV cache, sized for the model's KV layout

    def arrivals(self, source: ArrivalSource[A], scheduler: Scheduler) -> ArrivalSource[A]:
        """The KV arrivals a decode worker admits of those its receiver (`source`) reports:
        each as it lands."""
        return source


@dataclass(frozen=True)
class SimExecutor(Executor):
    profile: SimProfile

    def arrivals(self, source: ArrivalSource[A], scheduler: Scheduler) -> ArrivalSource[A]:
        """Each once its modelled transfer would be done."""
        return HeldArrivals(source, self.profile, scheduler)


def num_kv_blocks(cache: CacheConfig, bytes_per_block: int) -> int:
    """The blocks `cache` names, else as many as its memory holds."""
    return cache.num_blocks or max(1, int(cache.memory_gib * 2**30) // bytes_per_block)


def load_real(config: EngineConfig, model_path: Path) -> Executor:
    """The model's weights on a `ModelRunner`; each KV block's bytes count a draft model's too."""
    mc, block_size, cache_dtype = config.model, config.cache.block_size, kv_dtype(config)
    model = load_model(
        model_path,
        backend_class(mc.attention_backend, model_device(mc), cache_dtype),
        block_size,
        model_dtype(mc),
        model_device(mc),
        mc.quantization,
        mc.quant_group_size,
        mc.kernel_routes,
    )
    bytes_per_block = kv_bytes_per_token(model.cfg, cache_dtype) * block_size
    bytes_per_block += draft_kv_bytes_per_block(
        config.spec, block_size, cache_dtype, model_dtype(mc)
    )
    num_blocks = num_kv_blocks(config.cache, bytes_per_block)
    runner = ModelRunner(
        model, num_blocks, block_size, cache_dtype, model_device(mc), model.cfg.eos_token_ids
    )
    cuda = model_device(mc).type == "cuda"
    if mc.cuda_graphs and cuda and isinstance(model.backend, TritonPagedBackend):
        spec = config.spec
        query_lens = (1,) if spec.method is None else (1, spec.num_speculative_tokens + 1)
        max_model_len = mc.max_model_len or model.cfg.max_position_embeddings
        buckets = batch_buckets(config.scheduler.max_num_seqs)
        runner.graphs = CudaGraphs(model, buckets, query_lens, max_model_len)
    return Executor(model, runner, num_blocks)


def load_sim(config: EngineConfig, model_path: Path) -> Executor:
    """The real model's config and no weights, on a `SimRunner` timed by the config's profile;
    as many KV blocks as the real model's KV layout (or the profile's bytes per token) fits."""
    profile = SimProfile.load(config.model.sim_profile)
    real = load_config(model_path)
    if not profile.kv_bytes_per_token:
        profile = replace(profile, kv_bytes_per_token=kv_bytes_per_token(real, kv_dtype(config)))
    model = SimModel.of(real, profile.sim_layers)
    block_size = config.cache.block_size
    num_blocks = num_kv_blocks(config.cache, profile.kv_bytes_per_token * block_size)
    cfg = model.cfg
    runner = SimRunner(profile, num_blocks, block_size, cfg.vocab_size, cfg.eos_token_ids)
    return SimExecutor(model, runner, num_blocks, profile)


EXECUTORS: dict[str, Callable[[EngineConfig, Path], Executor]] = {
    "real": load_real,
    "sim": load_sim,
}


def load_executor(config: EngineConfig, model_path: Path) -> Executor:
    """What runs the steps of an engine of `config`, for the model at `model_path`."""
    return EXECUTORS[config.model.engine](config, model_path)
