"""Tensor parallelism (Gloo, local processes) gives the single-device engine's logits and tokens.

float32 throughout. An all-reduce adds the row-parallel layers' partial products in another order
than one matmul does, so the logits of TP 2 and TP 4 equal TP 1's to rounding, not bit for bit:
within ATOL = 1e-5 (absolute; the largest difference measured on these models is ~1e-7, logits
of magnitude ~1), and QUANT_ATOL with int8 / int4 weights, whose kernels round to bfloat16.
The scripted steps cover prefill, chunked prefill, a prefix-cache hit, preemption and decode.
Each engine's ranks start once per module (fixtures), one thread each.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from tandem.config import EngineConfig, WorkerConfig
from tandem.engine.attention import TorchSDPABackend
from tandem.engine.engine_core import EngineCore
from tandem.engine.executor import TPExecutor
from tandem.engine.models import load_model
from tandem.engine.quant.layer import QuantizedLinear
from tandem.engine.quant.model import quantize_weight
from tandem.engine.tp.group import TPGroup
from tandem.engine.tp.ranks import (
    KEEPALIVE_S,
    Ranks,
    TensorParallelError,
    TPModelRunner,
    rank_device,
)
from tandem.engine.tp.shard import Shard, check_tensor_parallel
from tandem.model_config import ModelConfig
from tandem.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-5
# Quantized layers pinned to the native kernel (routes.py), which TP 1's layers and TP N's
# row-parallel ones both have: "auto" could measure torch's packed kernel faster for a TP 1
# shape, and TP N would run other kernels.
QUANT_ROUTES = {"kernel_routes": "quant_gemm"}
# The int8 and int4 kernels round their float32 sums to bfloat16 once, under TP after the
# all-reduce (quant/layer.py); the sums' other order flips a rounding now and then, which the
# layers after it spread.
QUANT_ATOL = 0.02
# name -> (HF config of the tiny shape, ranks, engine options)
CONFIGS: dict[str, tuple[Callable[[dict[str, int]], object], int, dict[str, str]]] = {
    "llama": (lambda tiny: LlamaConfig(**tiny), 2, {}),
    "qwen2": (lambda tiny: Qwen2Config(**tiny), 2, {}),
    "qwen3": (lambda tiny: Qwen3Config(**tiny, head_dim=16), 2, {}),
    # 4 ranks over 2 KV heads: each replicated on two
    "qwen2-tp4": (lambda tiny: Qwen2Config(**tiny), 4, {}),
    "qwen3-tp4": (lambda tiny: Qwen3Config(**tiny, head_dim=16), 4, {}),
    # tied embeddings; 2 KV heads on 4 ranks (each replicated on two); a vocabulary of 250 that
    # 4 ranks hold as 63 rows each, the last two padded
    "tied-replicated-kv": (
        lambda tiny: LlamaConfig(**{**tiny, "vocab_size": 250}, tie_word_embeddings=True),
        4,
        {},
    ),
    # an int8 KV cache: a scale per token and head, so each rank's heads keep theirs
    "llama-kv-int8": (lambda tiny: LlamaConfig(**tiny), 2, {"kv_cache_dtype": "int8"}),
    # quantized whole, then split (o_proj's 64 inputs: one int4 group of 32 per rank), on the
    # native kernel at both sizes (QUANT_ROUTES)
    "llama-int8": (lambda tiny: LlamaConfig(**tiny), 2, {"quantization": "int8", **QUANT_ROUTES}),
    "llama-int4": (lambda tiny: LlamaConfig(**tiny), 2, {"quantization": "int4", **QUANT_ROUTES}),
}
OPTIONS = dict(num_blocks=12, block_size=4, max_num_batched_tokens=8, num_threads=1)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def engines(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_llama_kwargs: dict[str, int],
) -> Iterator[tuple[EngineCore, EngineCore]]:
    """(TP 1 engine, TP N engine) of one tiny random model."""
    make_config, size, options = CONFIGS[request.param]
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(request.param)
    AutoModelForCausalLM.from_config(make_config(tiny_llama_kwargs)).save_pretrained(path)
    single = EngineCore(EngineConfig.create(str(path), **OPTIONS, **options))
    parallel = EngineCore(
        EngineConfig.create(str(path), tensor_parallel_size=size, **OPTIONS, **options)
    )
    yield single, parallel
    parallel.close()


def scripted(
    engine: EngineCore, preempt: bool = True
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """The logits of every step and the tokens of a fixed script of greedy requests (the first
    with n = 2 choices: the fork's copy of the partial prompt block runs on every rank);
    `preempt` ends it with a batch that outgrows the cache, decoding 16 tokens each."""
    rows: list[torch.Tensor] = []
    compute_logits = engine.model.compute_logits

    def recorded(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(logits := compute_logits(hidden))
        return logits

    engine.model.compute_logits = recorded  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 250, (21,), generator=g).tolist()
    others = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (13, 30)]
    later = [[*prompt, 5, 6, 7], *others]
    # three requests that grow to 5 blocks each on 12 blocks: one is preempted and recomputes
    growing = [torch.randint(0, 250, (4,), generator=g).tolist() for _ in range(3)]
    outputs = []
    phases = [([prompt], 3, 2), (later, 5, 1), (growing, 16, 1)]
    for batch, max_tokens, n in phases if preempt else phases[:2]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n)
        reqs = [engine.add_request(f"{len(outputs)}-{i}", p, params) for i, p in enumerate(batch)]
        while engine.has_unfinished():
            engine.step()
        outputs += [c.output_token_ids for r in reqs for c in (r, *r.forks)]
    return rows, outputs


def test_logits_equal_single_device(engines: tuple[EngineCore, EngineCore]) -> None:
    single, parallel = engines
    # bfloat16 rounding flips greedy near-ties of this random model's flat logits within a few
    # tens of quantized decode steps: their script stops before the preemption phase
    exact = parallel.config.model.quantization is None
    stats = single.kv_cache.stats
    hits, preemptions = stats.prefix_hits, single.scheduler.num_preemptions
    expected, expected_tokens = scripted(single, preempt=exact)
    assert stats.prefix_hits > hits  # the script reaches a prefix-cache hit
    assert single.scheduler.num_preemptions > preemptions or not exact  # and a preemption
    rows, tokens = scripted(parallel, preempt=exact)
    assert tokens == expected_tokens
    assert len(rows) == len(expected)
    atol = ATOL if exact else QUANT_ATOL
    for ours, theirs in zip(rows, expected, strict=True):
        torch.testing.assert_close(ours, theirs, atol=atol, rtol=0)
    parallel.check_integrity()  # rank 0's bookkeeping, and every rank against it


def test_integrity_names_the_rank_that_disagrees(engines: tuple[EngineCore, EngineCore]) -> None:
    """Rank 0's record of what it sent, its cache's layout, or (replicated KV heads) its KV in a
    live block, tampered with: the ranks' check finds each, naming rank 1 (the first other
    rank), and passes again once restored."""
    parallel = engines[1]
    runner = parallel.executor.runner
    assert isinstance(runner, TPModelRunner)
    ledger, caches, size = runner.ledger, runner.kv_caches, runner.group.size
    steps, digest = ledger.steps, ledger.digest
    one_step_more = f"ran {steps} steps, rank 0 sent {steps + 1}"
    tampered: list[tuple[Callable[[], None], str]] = [
        (lambda: setattr(ledger, "steps", steps + 1), one_step_more),
        (lambda: setattr(ledger, "digest", digest ^ 1), "ran other block tables"),
        (lambda: setattr(runner, "kv_caches", [c[:, 1:] for c in caches]), "holds 2 layers of KV"),
    ]
    for tamper, message in tampered:
        tamper()
        with pytest.raises(AssertionError, match=f"rank 1 of {size} {message}"):
            parallel.check_integrity()
        ledger.steps, ledger.digest, runner.kv_caches = steps, digest, caches
    parallel.check_integrity()
    if size <= parallel.executor.model_config.num_kv_heads:
        return
    # Replicated KV heads: rank 1 holds rank 0's; a live block's KV changed on rank 0 alone
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    parallel.add_request("live", [7, 8, 9, 10, 11], params)
    parallel.step()  # the prompt's KV written; the request holds its blocks
    block = parallel.kv_cache.block_table("live")[0]
    kept = caches[0][:, block].clone()
    caches[0][:, block] = 1 - kept
    with pytest.raises(AssertionError, match=f"rank 1 of {size} holds other KV than rank 0"):
        parallel.check_integrity()
    caches[0][:, block] = kept
    parallel.check_integrity()
    while parallel.has_unfinished():
        parallel.step()
    parallel.check_integrity()


def test_prompt_logprobs_equal_single_device(engines: tuple[EngineCore, EngineCore]) -> None:
    """A prompt's scored rows ride in the step's one logits gather across the ranks."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2, ignore_eos=True)
    prompt = torch.randint(0, 250, (19,), generator=torch.Generator().manual_seed(2)).tolist()
    scores = []
    for engine in engines:
        req = engine.add_request("scored", prompt, params)
        while engine.has_unfinished():  # three prefill chunks of at most 8 tokens
            engine.step()
        scores.append(req.prompt_logprobs)
    single, parallel = scores
    assert [lp.token_id for lp in parallel] == [lp.token_id for lp in single] == prompt[1:]
    atol = ATOL if engines[1].config.model.quantization is None else QUANT_ATOL
    torch.testing.assert_close(
        torch.tensor([lp.logprob for lp in parallel]),
        torch.tensor([lp.logprob for lp in single]),
        atol=atol,
        rtol=0,
    )


# SmolLM2's weights -> engine options
SMOLLM2_WEIGHTS = {"float32": {}, "int8": {"quantization": "int8", **QUANT_ROUTES}}


@pytest.fixture(scope="module", params=sorted(SMOLLM2_WEIGHTS))
def smollm2_engines(
    request: pytest.FixtureRequest, smollm2_path: Path
) -> Iterator[tuple[EngineCore, EngineCore]]:
    """SmolLM2-135M (9 heads, 3 KV heads) at TP 1 and TP 3, both with n-gram speculation."""
    options = dict(num_blocks=16, block_size=16, num_threads=1, speculative={"method": "ngram"})
    options |= SMOLLM2_WEIGHTS[request.param]
    single = EngineCore(EngineConfig.create(str(smollm2_path), **options))
    parallel = EngineCore(EngineConfig.create(str(smollm2_path), tensor_parallel_size=3, **options))
    yield single, parallel
    parallel.close()


def test_smollm2_greedy_equals_single_device(
    smollm2_engines: tuple[EngineCore, EngineCore],
) -> None:
    """Plain and speculative (n-gram, a repetitive prompt) greedy requests in one batch. The
    plain one's int8 output passes a near-tie (a gap of 0.002 at token 8) that bfloat16-rounded
    partial sums flipped."""
    repeated = [504, 3458, 282] * 3
    prompts = [[1, 504, 3458, 282, 4649, 314, 216], [1, *repeated, 504]]
    outputs = []
    for engine in smollm2_engines:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        reqs = [
            engine.add_request(str(i), p, params, speculative=i == 1) for i, p in enumerate(prompts)
        ]
        while engine.has_unfinished():
            engine.step()
        outputs.append([r.output_token_ids for r in reqs])
        assert reqs[1].metrics.num_accepted_tokens > 0
        engine.check_integrity()  # at TP 3: every rank
    assert outputs[0] == outputs[1]


def test_draft_model_on_rank_0(tiny_llama_path: Path) -> None:
    """A draft model (here the target itself, whole) runs on rank 0 beside the target's shard:
    greedy output equals plain TP 1 decoding, and the drafts are accepted."""
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outputs = []
    speculative = {"method": "draft", "draft_model": str(tiny_llama_path)}
    for size, spec in ((1, None), (2, speculative)):
        config = EngineConfig.create(
            str(tiny_llama_path), tensor_parallel_size=size, speculative=spec, **OPTIONS
        )
        engine = EngineCore(config)
        reqs = [engine.add_request(str(i), p, params) for i, p in enumerate(prompts)]
        while engine.has_unfinished():
            engine.step()
        engine.close()
        outputs.append([r.output_token_ids for r in reqs])
    assert outputs[0] == outputs[1]
    assert sum(r.metrics.num_accepted_tokens for r in reqs) > 0


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("proj", ["q", "k", "o", "down"])
def test_quantized_whole_then_split(method: str, proj: str) -> None:
    """A rank's part of a quantized weight is the same part of the single-device one."""
    cfg = _cfg(num_heads=6, num_kv_heads=3, head_dim=32, intermediate_size=192, hidden_size=96)
    shard = Shard(cfg, rank=2, size=3)
    dim, start, end = shard.spans[proj]
    in_features = {"o": cfg.q_size, "down": cfg.intermediate_size}.get(proj, cfg.hidden_size)
    out_features = {"q": cfg.q_size, "k": cfg.kv_size}.get(proj, cfg.hidden_size)
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0))
    whole = quantize_weight(weight, method, 32)
    name = f"model.layers.0.{'mlp' if proj == 'down' else 'self_attn'}.{proj}_proj.weight"
    part = shard.quantized(name, whole)
    expected = whole.dequantize().narrow(dim, start, end - start)
    torch.testing.assert_close(part.dequantize(), expected, atol=0, rtol=0)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_every_rank_loads_its_part_of_the_quantized_model(
    tiny_llama_path: Path, method: str
) -> None:
    """Each rank's quantized layers (loaded as the rank loads them, here in one process: loading
    runs no collective, so the group is a stand-in) equal its part of the single-device model's."""
    cpu = torch.device("cpu")
    args = (TorchSDPABackend, 4, torch.float32, cpu, method, 32, "default")
    whole = load_model(tiny_llama_path, *args)
    for rank in range(2):
        group = TPGroup(None, rank, 2, cpu, timeout_s=1.0)
        shard = Shard(whole.cfg, rank, 2)
        part = load_model(tiny_llama_path, *args, tp=group)
        for name, module in part.layers.named_modules():
            if not isinstance(module, QuantizedLinear):
                continue
            expected = whole.layers.get_submodule(name).dequantize()
            if name.endswith("qkv_proj"):
                cfg = whole.cfg
                qkv = expected.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
                spans = [shard.spans[p] for p in "qkv"]
                expected = torch.cat([w[s:e] for w, (_, s, e) in zip(qkv, spans, strict=True)])
            elif name.endswith("gate_up_proj"):
                _, s, e = shard.spans["gate"]
                expected = torch.cat([w[s:e] for w in expected.chunk(2)])
            else:
                _, s, e = shard.spans[name.split(".")[-1].removesuffix("_proj")]
                expected = expected[:, s:e]
            torch.testing.assert_close(module.dequantize(), expected, atol=0, rtol=0)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_dead_or_stuck_rank_fails_the_step(tiny_llama_path: Path, sig: signal.Signals) -> None:
    """Rank 1 killed (its connections close: at once) or stopped (the group's timeout) in the
    middle of decoding: rank 0's step raises instead of blocking, and `close` kills the rest."""
    config = EngineConfig.create(
        str(tiny_llama_path), tensor_parallel_size=2, tp_timeout_s=2.0, **OPTIONS
    )
    engine = EngineCore(config)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine.add_request("r", [1, 2, 3], params)
    engine.step()
    assert isinstance(engine.executor, TPExecutor)
    (rank1,) = engine.executor.ranks.handles
    assert rank1.pid is not None
    os.kill(rank1.pid, sig)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="within 2 s"):
        while engine.has_unfinished():
            engine.step()
    assert time.monotonic() - start < 2.0 + 5.0
    engine.close()
    assert not rank1.is_alive()


def test_an_idle_worker_finds_a_stopped_rank(tiny_llama_path: Path) -> None:
    """Rank 1 stopped while rank 0 is idle: the keep-alive is a round trip, so the engine turns
    unhealthy within the group's timeout without a step (its worker then stops heartbeating)."""
    config = EngineConfig.create(
        str(tiny_llama_path), tensor_parallel_size=2, tp_timeout_s=1.0, **OPTIONS
    )
    engine = EngineCore(config)
    assert isinstance(engine.executor, TPExecutor)
    (rank1,) = engine.executor.ranks.handles
    assert rank1.pid is not None
    engine.executor.keep_alive()
    assert engine.executor.healthy
    os.kill(rank1.pid, signal.SIGSTOP)
    start = time.monotonic()
    while engine.executor.healthy and time.monotonic() - start < 10.0:
        engine.executor.keep_alive()
        time.sleep(0.05)
    assert not engine.executor.healthy
    assert time.monotonic() - start < 1.0 + KEEPALIVE_S + 2.0
    os.kill(rank1.pid, signal.SIGKILL)  # closing around a stopped rank: the test above
    engine.close()
    assert not rank1.is_alive()


def _cfg(**fields: int) -> ModelConfig:
    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1)
    shape |= dict(num_heads=4, num_kv_heads=2, head_dim=16)
    return ModelConfig("llama", **(shape | fields))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "cfg, size, quantization, group_size, message",
    [
        (_cfg(num_heads=9, num_kv_heads=3), 2, None, 32, "num_attention_heads=9"),
        (_cfg(num_heads=12, num_kv_heads=3), 2, None, 32, "num_key_value_heads=3"),
        (_cfg(num_heads=12, num_kv_heads=6), 4, None, 32, "num_key_value_heads=6"),
        (_cfg(intermediate_size=130), 4, None, 32, "intermediate_size=130"),
        # o_proj's 576 inputs take int4 groups of 64; 2 ranks split them at 288
        (_cfg(head_dim=144, intermediate_size=1536), 2, "int4", 128, "quant_group_size=128"),
    ],
)
def test_bad_split_refused(
    cfg: ModelConfig, size: int, quantization: str | None, group_size: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(cfg, size, quantization, group_size)


def test_natural_splits_accepted() -> None:
    smollm2 = _cfg(num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536)
    check_tensor_parallel(smollm2, 3, "int4", 32)


def write_the_mark(config: EngineConfig, model_path: Path, group: TPGroup, service: object) -> None:
    """A rank's main (test double): its environment's TANDEM_TEST_MARK into the file it names."""
    Path(os.environ["TANDEM_TEST_MARK_FILE"]).write_text(os.environ.get("TANDEM_TEST_MARK", "-"))


def test_each_rank_starts_with_rank_0s_environment_of_the_moment(
    tiny_llama_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Local ranks fork from a server started with the first of them: what rank 0's environment
    says later (a TANDEM_NATIVE_ISA cap, a TANDEM_HOME) must still reach the later ones."""
    config = EngineConfig.create(str(tiny_llama_path), tensor_parallel_size=2, num_threads=1)
    for mark in ("first", "second"):
        monkeypatch.setenv("TANDEM_TEST_MARK", mark)
        monkeypatch.setenv("TANDEM_TEST_MARK_FILE", str(tmp_path / mark))
        ranks = Ranks.start(config, tiny_llama_path, write_the_mark)
        try:
            ranks.handles[0].join(30)
            assert (tmp_path / mark).read_text() == mark
        finally:
            ranks.kill()


def test_engine_refuses_before_starting_ranks(smollm2_path: Path) -> None:
    with pytest.raises(ValueError, match="num_attention_heads=9"):
        EngineCore(EngineConfig.create(str(smollm2_path), tensor_parallel_size=2))
    # A worker's collectives must fail before the registry would forget it anyway.
    with pytest.raises(ValueError, match="tp_timeout_s=60 must be below heartbeat_ttl_s=3"):
        WorkerConfig(EngineConfig.create("m", tensor_parallel_size=3))
    WorkerConfig(EngineConfig.create("m", tensor_parallel_size=3, tp_timeout_s=1.5))


def test_devices_refused() -> None:
    with pytest.raises(ValueError, match="rank r on cuda:r"):
        rank_device(torch.device("cuda", 1), 0, 2)
    if torch.cuda.device_count() < 8:
        with pytest.raises(ValueError, match="needs 8 GPUs"):
            rank_device(torch.device("cuda"), 0, 8)
