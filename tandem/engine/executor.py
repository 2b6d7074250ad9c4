"""What runs an engine's steps, built from its config: the model, its runner, the KV blocks.

`ModelSettings.engine` picks the kind here (`EXECUTORS`) and nowhere else: "real" loads the
weights onto a `ModelRunner`; "sim" (sim.py) stands the real model's config, without weights, on
a `SimRunner` that sleeps the modelled step times, and has a decode worker see each KV arrival
once its modelled transfer would be done. `EngineCore` and the workers use what is built here
without knowing which kind it is. A real engine of `tensor_parallel_size` > 1 is rank 0 of that
many ranks (`TPExecutor`, tandem/engine/tp/): the others start here, as local processes or where
the caller's `RankLauncher` runs them (Ray actors: tandem/cluster/rank_actors.py). A worker
asks its executor for the KV cache its transfer reads and writes (`kv_view`: the whole model's
heads, over every rank), keeps it alive between steps (`keep_alive`) and heartbeats only while it
is `healthy`.
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
from tandem.engine.spec.factory import TARGET_VOCAB_METHODS
from tandem.engine.tp.group import TPGroup
from tandem.engine.tp.kv_view import first_kv_heads
from tandem.engine.tp.ranks import (
    LOAD_TIMEOUT,
    RankLauncher,
    RankLink,
    Ranks,
    RankService,
    RunService,
    TPModelRunner,
)
from tandem.engine.tp.shard import check_tensor_parallel
from tandem.engine.tp.vocab import gather_whole_vocab
from tandem.model_config import ModelConfig, load_config

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

    @property
    def model_config(self) -> ModelConfig:
        """The whole model's config (a rank's model holds its shard)."""
        return self.model.cfg

    @property
    def healthy(self) -> bool:
        """Whether steps can run (every rank alive)."""
        return True

    def keep_alive(self) -> None:
        """Between steps: prove what runs them alive (nothing to do here)."""

    def check_ranks(self, live: list[int]) -> None:
        """Between steps: raise AssertionError if a rank beside this process disagrees with
        its block bookkeeping (`live`: the blocks its block tables hold; no rank here)."""

    def start_rank_service(self, service: RankService) -> list[RankLink]:
        """Run a worker's `service` in each rank 1.. over the rank's own KV cache (ranks.py);
        none here: one device."""
        return []

    def close(self) -> None:
        """Release what runs the steps beside this process (nothing here)."""


@dataclass(frozen=True)
class TPExecutor(Executor):
    """Rank 0 of a tensor-parallel engine, with the other ranks (processes or Ray actors)."""

    ranks: Ranks
    whole_config: ModelConfig

    @property
    def model_config(self) -> ModelConfig:
        return self.whole_config

    @property
    def healthy(self) -> bool:
        return self.ranks.healthy

    def keep_alive(self) -> None:
        self.ranks.keep_alive()

    def check_ranks(self, live: list[int]) -> None:
        """Every rank ran the steps rank 0 sent, on a cache of rank 0's layout, and the ranks
        that hold a replicated KV head hold the same KV in the `live` blocks (a collective:
        tp/integrity.py)."""
        assert isinstance(self.runner, TPModelRunner)
        first_heads = first_kv_heads(self.whole_config, self.ranks.group.size)
        self.runner.check_ranks(live, first_heads)

    def start_rank_service(self, service: RankService) -> list[RankLink]:
        return self.ranks.start_service(service)

    def close(self) -> None:
        self.ranks.stop()


@dataclass(frozen=True)
class SimExecutor(Executor):
    profile: SimProfile

    def arrivals(self, source: ArrivalSource[A], scheduler: Scheduler) -> ArrivalSource[A]:
        """Each once its modelled transfer would be done."""
        return HeldArrivals(source, self.profile, scheduler)


def num_kv_blocks(cache: CacheConfig, bytes_per_block: int) -> int:
    """The blocks `cache` names, else as many as its memory holds."""
    return cache.num_blocks or max(1, int(cache.memory_gib * 2**30) // bytes_per_block)


def load_real(
    config: EngineConfig, model_path: Path, launcher: RankLauncher | None = None
) -> Executor:
    """The model's weights on a `ModelRunner`, or rank 0's shard of them on a `TPModelRunner`
    once the other ranks have started (where `launcher` runs them: local processes by default)
    and loaded theirs."""
    mc = config.model
    if mc.tensor_parallel_size == 1:
        return load_rank(config, model_path, None)
    whole = load_config(model_path)
    # Refused before any process starts.
    check_tensor_parallel(whole, mc.tensor_parallel_size, mc.quantization, mc.quant_group_size)
    ranks = Ranks.start(config, model_path, serve_rank, launcher)
    try:
        executor = load_rank(config, model_path, ranks.group)
        ranks.group.barrier(LOAD_TIMEOUT)  # every rank has loaded its shard
        assert isinstance(executor.runner, TPModelRunner)
        gather_drafter_vocab(config, executor.runner)
    except BaseException:
        ranks.kill()
        raise
    return TPExecutor(executor.model, executor.runner, executor.num_blocks, ranks, whole)


def load_rank(config: EngineConfig, model_path: Path, tp: TPGroup | None) -> Executor:
    """The model's weights (with `tp`, the rank's shard) on a runner; each KV block's bytes
    (the rank's heads) count a draft model's too."""
    mc, block_size, cache_dtype = config.model, config.cache.block_size, kv_dtype(config)
    device = model_device(mc) if tp is None else tp.device
    model = load_model(
        model_path,
        backend_class(mc.attention_backend, device, cache_dtype),
        block_size,
        model_dtype(mc),
        device,
        mc.quantization,
        mc.quant_group_size,
        mc.kernel_routes,
        tp,
    )
    bytes_per_block = kv_bytes_per_token(model.cfg, cache_dtype) * block_size
    bytes_per_block += draft_kv_bytes_per_block(
        config.spec, block_size, cache_dtype, model_dtype(mc)
    )
    num_blocks = num_kv_blocks(config.cache, bytes_per_block)
    args = (model, num_blocks, block_size, cache_dtype, device, model.cfg.eos_token_ids)
    runner = ModelRunner(*args) if tp is None else TPModelRunner(*args, group=tp)
    # Graphs for one device only: a tensor-parallel step's collectives run eagerly.
    cuda = device.type == "cuda" and tp is None
    if mc.cuda_graphs and cuda and isinstance(model.backend, TritonPagedBackend):
        spec = config.spec
        query_lens = (1,) if spec.method is None else (1, spec.num_speculative_tokens + 1)
        max_model_len = mc.max_model_len or model.cfg.max_position_embeddings
        buckets = batch_buckets(config.scheduler.max_num_seqs)
        runner.graphs = CudaGraphs(model, buckets, query_lens, max_model_len)
    return Executor(model, runner, num_blocks)


def serve_rank(
    config: EngineConfig,
    model_path: Path,
    tp: TPGroup,
    run_service: RunService,
) -> None:
    """A rank other than 0: load its shard, meet the others, run rank 0's steps until stopped."""
    runner = load_rank(config, model_path, tp).runner
    assert isinstance(runner, TPModelRunner)
    tp.barrier(LOAD_TIMEOUT)
    gather_drafter_vocab(config, runner)
    runner.serve(run_service)


def gather_drafter_vocab(config: EngineConfig, runner: TPModelRunner) -> None:
    """Every rank, once all have loaded: for a Medusa or EAGLE drafter, which runs on rank 0
    alone, rank 0 gathers the whole LM head (and embedding) it drafts with (tp/vocab.py)."""
    embedding = TARGET_VOCAB_METHODS.get(config.spec.method or "")
    if embedding is not None:
        runner.whole_vocab = gather_whole_vocab(runner.model, runner.group, embedding)


def load_sim(
    config: EngineConfig, model_path: Path, launcher: RankLauncher | None = None
) -> Executor:
    """The real model's config and no weights, on a `SimRunner` timed by the config's profile;
    as many KV blocks as the real model's KV layout (or the profile's bytes per token) fits.
    One rank (the config refuses more): `launcher` has nothing to start."""
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


EXECUTORS: dict[str, Callable[[EngineConfig, Path, RankLauncher | None], Executor]] = {
    "real": load_real,
    "sim": load_sim,
}


def load_executor(
    config: EngineConfig, model_path: Path, launcher: RankLauncher | None = None
) -> Executor:
    """What runs the steps of an engine of `config`, for the model at `model_path`; its ranks
    1.. (tensor parallelism) where `launcher` runs them, local processes by default."""
    return EXECUTORS[config.model.engine](config, model_path, launcher)
