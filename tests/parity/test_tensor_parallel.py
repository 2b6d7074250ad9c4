"""Tensor parallelism (Gloo, local processes) gives the single-device engine's logits and tokens.

float32 throughout. An all-reduce adds the row-parallel layers' partial products in another order
than one matmul does, so the logits of TP 2 and TP 4 equal TP 1's to rounding, not bit for bit:
within ATOL = 1e-5 (absolute; the largest difference measured on these models is ~1e-7, logits
of magnitude ~1). The scripted steps cover prefill, chunked prefill, a prefix-cache hit,
preemption and decode. Each engine's ranks start once per module (fixtures), one thread each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from tandem.config import EngineConfig
from tandem.engine.engine_core import EngineCore
from tandem.engine.tp.ranks import rank_device
from tandem.engine.tp.shard import check_tensor_parallel
from tandem.model_config import ModelConfig
from tandem.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-5
# name -> (HF config of the tiny shape, ranks)
CONFIGS: dict[str, tuple[Callable[[dict[str, int]], object], int]] = {
    "llama": (lambda tiny: LlamaConfig(**tiny), 2),
    "qwen2": (lambda tiny: Qwen2Config(**tiny), 2),
    "qwen3": (lambda tiny: Qwen3Config(**tiny, head_dim=16), 2),
    # tied embeddings; 2 KV heads on 4 ranks (each replicated on two); a vocabulary of 250 that
    # 4 ranks hold as 63 rows each, the last two padded
    "tied-replicated-kv": (
        lambda tiny: LlamaConfig(**{**tiny, "vocab_size": 250}, tie_word_embeddings=True),
        4,
    ),
}
OPTIONS = dict(num_blocks=12, block_size=4, max_num_batched_tokens=8, num_threads=1)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def engines(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_llama_kwargs: dict[str, int],
) -> Iterator[tuple[EngineCore, EngineCore]]:
    """(TP 1 engine, TP N engine) of one tiny random model."""
    make_config, size = CONFIGS[request.param]
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(request.param)
    AutoModelForCausalLM.from_config(make_config(tiny_llama_kwargs)).save_pretrained(path)
    single = EngineCore(EngineConfig.create(str(path), **OPTIONS))
    parallel = EngineCore(EngineConfig.create(str(path), tensor_parallel_size=size, **OPTIONS))
    yield single, parallel
    parallel.close()


def scripted(engine: EngineCore) -> tuple[list[torch.Tensor], list[list[int]]]:
    """The logits of every step and the tokens of a fixed script of greedy requests."""
    rows: list[torch.Tensor] = []
    compute_logits = engine.model.compute_logits

    def recorded(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(logits := compute_logits(hidden))
        return logits

    engine.model.compute_logits = recorded  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 250, (21,), generator=g).tolist()
    later = [prompt + [5, 6, 7], *(torch.randint(0, 250, (n,), generator=g).tolist() for n in (13, 30))]
    # three requests that grow to 5 blocks each on 12 blocks: one is preempted and recomputes
    growing = [torch.randint(0, 250, (4,), generator=g).tolist() for _ in range(3)]
    outputs = []
    for batch, max_tokens in (([prompt], 3), (later, 5), (growing, 16)):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        reqs = [engine.add_request(f"{len(outputs)}-{i}", p, params) for i, p in enumerate(batch)]
        while engine.has_unfinished():
            engine.step()
        outputs += [r.output_token_ids for r in reqs]
    return rows, outputs


def test_logits_equal_single_device(engines: tuple[EngineCore, EngineCore]) -> None:
    single, parallel = engines
    stats = single.kv_cache.stats
    hits, preemptions = stats.prefix_hits, single.scheduler.num_preemptions
    expected, expected_tokens = scripted(single)
    # the script reaches a prefix-cache hit and a preemption
    assert stats.prefix_hits > hits and single.scheduler.num_preemptions > preemptions
    rows, tokens = scripted(parallel)
    assert tokens == expected_tokens
    assert len(rows) == len(expected)
    for ours, theirs in zip(rows, expected, strict=True):
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    parallel.kv_cache.check_integrity()


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


def test_engine_refuses_before_starting_ranks(smollm2_path: Path) -> None:
    with pytest.raises(ValueError, match="num_attention_heads=9"):
        EngineCore(EngineConfig.create(str(smollm2_path), tensor_parallel_size=2))
    with pytest.raises(ValueError, match="'draft' does not run under tensor parallelism"):
        EngineConfig.create(
            "m", tensor_parallel_size=3, speculative={"method": "draft", "draft_model": "d"}
        )


def test_devices_refused() -> None:
    with pytest.raises(ValueError, match="rank r on cuda:r"):
        rank_device(torch.device("cuda", 1), 0, 2)
    if torch.cuda.device_count() < 8:
        with pytest.raises(ValueError, match="needs 8 GPUs"):
            rank_device(torch.device("cuda"), 0, 8)
