"""`tandem bench engine`: the offline engine vs transformers `generate` side by side, two limits.

Method
------
Both sides run in one process on the same weights (the checkpoint dequantized to float32, then cast
to the dtype under test), the same chat-templated prompt token ids, greedy decoding, exactly
`new_tokens` output tokens (engine: `ignore_eos`; transformers: `min_new_tokens`) and
`torch.set_num_threads(threads)`. The transformers reference is a plain dense `*ForCausalLM` built
from the checkpoint's config with the default (sdpa) attention, not transformers' own GGUF loading,
which keeps the weights packed and computes in float32. The engine runs with prefix caching off: the
same prompts come back every round, and transformers keeps no cache between calls.
With `quantization` the engine's linear layers hold int8 / int4 weights (`tandem/engine/quant/`);
the transformers side, the kernel floor and the bandwidth limit stay dense in the dtype under
test.

Per dtype: load both sides, one short warm-up of each (not measured), then `rounds` rounds. In a
round the sides alternate A B A B (engine first):

- batch 1, for each of `prompts_per_round` prompts (the same prompts every round): decode tok/s =
  1 / TPOT with TPOT = (t_last_token - t_first_token) / (n_out - 1), so prefill is excluded. The
  engine stamps a token when its scheduler appends it (`RequestOutput.metrics.tpot`); transformers
  is stamped by a streamer whose `put` it calls once per generated token. One sample per prompt.
- batch `batch`: output tok/s = batch * new_tokens / wall time of the whole `generate` call,
  prefill included (transformers: left padding with the EOS token and an attention mask, the padded
  tensors built before the clock starts). One sample per round.
- kernel floor: the model's linear layers alone at batch 1 (one token), run back to back for
  `kernel_steps` steps after two warm-up steps, in steps/s. "separate" is transformers' layout (per
  layer q, k, v, o, gate, up, down as separate `nn.Linear`, then the lm_head over the whole
  vocabulary) and is the floor the target refers to; "fused" is the engine's layout (qkv, o,
  gate_up, down, lm_head). No attention, norms, activations, sampling or Python scheduling: it is
  what a decode step would cost if everything but the matmuls were free. Same dtype and threads.
- read bandwidth: `t.sum()` over a float32 tensor of `bandwidth_mib` MiB, best of 5, in bytes/s.
  The memory-bandwidth limit is bandwidth / weight bytes (every parameter in the dtype under test,
  a tied embedding counted once), in steps/s: a batch-1 step reads every weight once.

Statistics: each figure is the median of its samples (`statistics.median`: the middle value, or the
mean of the two middle ones for an even count) with the spread given as min-max; ratios and
fractions are ratios of medians. The targets of BENCHMARKS.md are checked on those: engine batch 1
>= 80% of the (separate-layout) kernel floor in every dtype; in bfloat16, batch 1 >= 1.3x and batch
`batch` >= 2.5x transformers.

Prompts: the first turn of the Spec-Bench dev prompts (`tandem/data/specbench_dev.jsonl`),
without the long input-grounded categories (summarization, rag), whose left padding
would turn the batched run into a prefill test; a seeded shuffle picks them. `--json PATH` writes
the config, the machine, the prompts, every raw sample and the summaries, and `PATH.png` beside it.
"""

from __future__ import annotations

import gc
import json
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import torch
from rich import box
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from torch import nn

from tandem import hub
from tandem.bench.common import BenchError, write_report
from tandem.bench.engine_probes import greedy_params, kernel_steps_per_s, read_bandwidth
from tandem.bench.hf_reference import build_reference, quiet_transformers
from tandem.bench.machine import machine_info, machine_line
from tandem.bench.report import (
    fmt_stats,
    median_bar,
    pyplot,
    rounds_title,
    routes_table,
    save_chart,
    stats,
    target_result,
    targets_table,
)
from tandem.config import DEFAULT_MODEL, DTYPES, QUANT_METHODS, CacheConfig
from tandem.data import SPECBENCH_PATH
from tandem.engine import LLM, routes
from tandem.engine.dtypes import TORCH_DTYPES
from tandem.engine.models.llama import LlamaForCausalLM
from tandem.engine.models.loader import iter_weights
from tandem.progress import progress_bar

EXCLUDED_CATEGORIES = frozenset({"summarization", "rag"})

# Targets from BENCHMARKS.md (thresholds, not measurements).
TARGET_B1_OF_KERNEL_FLOOR = 0.80
TARGET_B1_BF16_VS_HF = 1.3
TARGET_BATCH_BF16_VS_HF = 2.5

_WARMUP_B1_TOKENS = 16
_WARMUP_BATCH_TOKENS = 4


@dataclass(frozen=True)
class EngineBenchConfig:
    model: str = DEFAULT_MODEL
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    quantization: str | None = None  # the engine's linear layers: int8 | int4
    kv_cache_dtype: str = "auto"  # the engine's KV cache: auto (each dtype) | int8 | fp8
    threads: int = 2
    new_tokens: int = 128
    batch: int = 16
    rounds: int = 3
    prompts_per_round: int = 3  # batch-1 prompts, the same ones every round
    kernel_steps: int = 30  # batch-1 steps of the linear layers per kernel-floor sample
    bandwidth_mib: int = 1024  # float32 tensor summed to measure read bandwidth
    seed: int = 0
    warmup: bool = True  # one short unmeasured run of each side first

    def __post_init__(self) -> None:
        if not self.dtypes:
            raise ValueError("dtypes is empty")
        for dtype in self.dtypes:
            if dtype not in DTYPES:
                raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if self.quantization not in (None, *QUANT_METHODS):
            raise ValueError(
                f"quantization must be one of {list(QUANT_METHODS)} or None, "
                f"got {self.quantization!r}"
            )
        if self.new_tokens < 2:
            raise ValueError(
                f"new_tokens must be >= 2 (TPOT needs two tokens), got {self.new_tokens}"
            )
        for name in ("threads", "batch", "rounds", "prompts_per_round", "kernel_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.bandwidth_mib < 16:
            raise ValueError(f"bandwidth_mib must be >= 16, got {self.bandwidth_mib}")
        CacheConfig(kv_cache_dtype=self.kv_cache_dtype)  # raises ValueError naming the field

    def quick(self) -> EngineBenchConfig:
        """A check that the whole pipeline works (about a minute), not a measurement."""
        return replace(
            self,
            new_tokens=8,
            batch=2,
            rounds=1,
            prompts_per_round=1,
            kernel_steps=3,
            bandwidth_mib=128,
            warmup=False,
        )


@dataclass(frozen=True)
class BenchPrompt:
    question_id: int
    category: str
    text: str  # first turn


# --- prompts ------------------------------------------------------------------------------


def load_prompts(path: Path = SPECBENCH_PATH) -> list[BenchPrompt]:
    """First turns of the Spec-Bench dev set, without the input-grounded long categories."""
    if not path.is_file():
        raise BenchError(f"prompt file not found: {path}")
    prompts = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if row["category"] in EXCLUDED_CATEGORIES:
            continue
        prompts.append(BenchPrompt(int(row["question_id"]), row["category"], row["turns"][0]))
    if not prompts:
        raise BenchError(f"no usable prompts in {path}")
    return prompts


def select_prompts(prompts: Sequence[BenchPrompt], count: int, seed: int) -> list[BenchPrompt]:
    """`count` prompts of a seeded shuffle (cycling when count exceeds the pool)."""
    pool = sorted(prompts, key=lambda p: p.question_id)
    random.Random(seed).shuffle(pool)
    return [pool[i % len(pool)] for i in range(count)]


# --- the two sides ------------------------------------------------------------------------


class EngineSide:
    """Tandem's offline engine."""

    name = "engine"

    def __init__(self, config: EngineBenchConfig, dtype: str) -> None:
        self.llm = LLM(
            config.model,
            dtype=dtype,
            quantization=config.quantization,
            kv_cache_dtype=config.kv_cache_dtype,
            num_threads=config.threads,
            enable_prefix_caching=False,
            max_num_seqs=max(64, config.batch),
        )

    def chat_ids(self, text: str) -> list[int]:
        return self.llm.apply_chat_template([{"role": "user", "content": text}])

    def decode_b1(self, ids: list[int], new_tokens: int) -> tuple[float, list[int]]:
        """(TPOT in seconds, output token ids) of one batch-1 greedy request."""
        (out,) = self.llm.generate([ids], greedy_params(new_tokens))
        m = out.metrics
        if m is None or m.tpot is None or len(out.token_ids) != new_tokens:
            raise BenchError(f"engine produced {len(out.token_ids)} tokens, not {new_tokens}")
        return m.tpot, list(out.token_ids)

    def generate_batch(self, batch: list[list[int]], new_tokens: int) -> float:
        """Wall seconds of one `generate` over the whole batch."""
        params = greedy_params(new_tokens)
        t0 = time.perf_counter()
        outs = self.llm.generate(batch, params)
        wall = time.perf_counter() - t0
        counts = {len(o.token_ids) for o in outs}
        if counts != {new_tokens}:
            raise BenchError(
                f"engine produced {sorted(counts)} tokens per request, not {new_tokens}"
            )
        return wall


class ReferenceSide:
    """transformers `generate` on a dense model holding the same weights in the same dtype."""

    name = "transformers"

    def __init__(self, model_path: Path, state: dict[str, torch.Tensor], dtype: str) -> None:
        self.model = build_reference(model_path, state, TORCH_DTYPES[dtype])
        eos = self.model.config.eos_token_id
        self.pad_id = int(eos[0] if isinstance(eos, list) else eos)

    def decode_b1(self, ids: list[int], new_tokens: int) -> tuple[float, list[int]]:
        clock = _TokenClock()
        input_ids = torch.tensor([ids])  # [1, prompt_len]
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            **self._greedy(new_tokens),
            streamer=clock,
        )
        tokens = out[0, len(ids) :].tolist()
        stamps = clock.token_times
        if len(tokens) != new_tokens or len(stamps) != new_tokens:
            raise BenchError(f"transformers produced {len(tokens)} tokens, not {new_tokens}")
        return (stamps[-1] - stamps[0]) / (new_tokens - 1), tokens

    def generate_batch(self, batch: list[list[int]], new_tokens: int) -> float:
        input_ids, mask = left_pad(batch, self.pad_id)  # [batch, max_prompt_len]
        t0 = time.perf_counter()
        out = self.model.generate(
            input_ids=input_ids, attention_mask=mask, **self._greedy(new_tokens)
        )
        wall = time.perf_counter() - t0
        produced = out.shape[1] - input_ids.shape[1]
        if produced != new_tokens:
            raise BenchError(f"transformers produced {produced} tokens, not {new_tokens}")
        return wall

    def _greedy(self, new_tokens: int) -> dict[str, Any]:
        return {
            "do_sample": False,
            "max_new_tokens": new_tokens,
            "min_new_tokens": new_tokens,
            "pad_token_id": self.pad_id,
        }


class _TokenClock:
    """A transformers streamer that stamps each generated token (the first `put` is the prompt)."""

    def __init__(self) -> None:
        self.token_times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.token_times.append(time.perf_counter())

    def end(self) -> None:
        pass


def left_pad(batch: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both [len(batch), longest], padded on the left."""
    width = max(len(ids) for ids in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        mask[row, width - len(ids) :] = 1
    return input_ids, mask


# --- limits -------------------------------------------------------------------------------


def linear_layers(model: Any, fused: bool) -> list[nn.Linear]:
    """The linear layers a batch-1 decode step runs, in order; `fused` = the engine's layout."""
    layers: list[nn.Linear] = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if fused:
            layers += [
                _fuse(attn.q_proj, attn.k_proj, attn.v_proj),
                attn.o_proj,
                _fuse(mlp.gate_proj, mlp.up_proj),
                mlp.down_proj,
            ]
        else:
            layers += [
                attn.q_proj,
                attn.k_proj,
                attn.v_proj,
                attn.o_proj,
                mlp.gate_proj,
                mlp.up_proj,
                mlp.down_proj,
            ]
    layers.append(model.lm_head)  # the whole vocabulary, as a decode step computes it
    return layers


@torch.no_grad()
def _fuse(*parts: nn.Linear) -> nn.Linear:
    weight = torch.cat([p.weight for p in parts])  # [sum(out_features), in_features]
    has_bias = all(p.bias is not None for p in parts)
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    return fused


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter; `parameters()` yields a tied embedding once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


# --- the run ------------------------------------------------------------------------------


def run_engine_bench(
    config: EngineBenchConfig,
    json_out: str | Path | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run the whole benchmark, print tables and target checks, return (and write) the report."""
    console = console or Console()
    pool = load_prompts()
    b1_prompts = select_prompts(pool, config.prompts_per_round, config.seed)
    batch_prompts = select_prompts(pool, config.batch, config.seed)
    torch.set_num_threads(config.threads)
    model_path = hub.resolve(config.model)

    report: dict[str, Any] = {
        "benchmark": "engine",
        "config": asdict(config),
        "method": __doc__,
        "machine": {**machine_info(), "torch_threads": torch.get_num_threads()},
        "model_path": str(model_path),
        "prompts": {},
        "results": {},
        "routes": {},
    }
    console.print(machine_line(report["machine"]))
    per_dtype_units = 2 + config.rounds * (2 * config.prompts_per_round + 5)
    with quiet_transformers(), progress_bar(console) as progress:
        task = progress.add_task("loading weights", total=per_dtype_units * len(config.dtypes))
        inputs = Inputs(model_path, dict(iter_weights(model_path)), b1_prompts, batch_prompts)
        for dtype in config.dtypes:
            result, prompts = _bench_dtype(config, dtype, inputs, progress, task)
            report["results"][dtype] = result
            report["prompts"] = prompts
            report["routes"][dtype] = result.pop("routes")
            progress.console.print(routes_table(f"{dtype}: kernel routes", report["routes"][dtype]))
            progress.console.print(_dtype_table(config, dtype, result))
        del inputs  # the float32 weights
    report["targets"] = check_targets(config, report["results"])
    console.print(targets_table(report["targets"]))
    if json_out is not None:
        write_report(report, json_out, write_chart, console)
    return report


@dataclass(frozen=True)
class Inputs:
    """What every dtype runs on: the checkpoint's path and its HF-named float32 weights, and the
    prompts (the same every round)."""

    model_path: Path
    state: dict[str, torch.Tensor]
    b1_prompts: list[BenchPrompt]
    batch_prompts: list[BenchPrompt]


@dataclass
class DtypeSetup:
    """One dtype's two sides, its prompts as token ids and the reference's linear layers for the
    kernel floor, loaded before its first round."""

    dtype: str
    engine: EngineSide
    reference: ReferenceSide
    routes: dict[str, str]  # the engine's kernel routes (`routes.describe`)
    b1_ids: list[list[int]]
    batch_ids: list[list[int]]
    separate: list[nn.Linear]  # transformers' layout
    fused: list[nn.Linear]  # the engine's layout
    nbytes: int  # weight bytes in the dtype under test

    @property
    def kernel_inputs(self) -> tuple[torch.dtype, torch.device]:
        """Where the kernel floor's inputs live: the dtype under test, the reference's device."""
        return TORCH_DTYPES[self.dtype], self.reference.model.device


@dataclass
class Samples:
    """One dtype's raw samples, one list per measurement."""

    b1: list[dict[str, Any]] = field(default_factory=list)
    batch: list[dict[str, Any]] = field(default_factory=list)
    kernel: list[dict[str, Any]] = field(default_factory=list)
    bandwidth: list[dict[str, Any]] = field(default_factory=list)


def _bench_dtype(
    config: EngineBenchConfig, dtype: str, inputs: Inputs, progress: Progress, task: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load both sides in `dtype`, warm them up, run every round; (result, prompt records)."""
    progress.update(task, description=f"{dtype}: loading engine and transformers")
    setup = _load_sides(config, dtype, inputs)
    progress.advance(task)
    if config.warmup:
        progress.update(task, description=f"{dtype}: warm-up")
        _warm_up(config, setup)
    progress.advance(task)
    samples = Samples()
    for r in range(config.rounds):
        _run_round(config, setup, r, inputs.b1_prompts, samples, progress, task)

    described, nbytes = setup.routes, setup.nbytes
    prompts = {
        "batch1": _prompt_records(inputs.b1_prompts, setup.b1_ids),
        "batch": _prompt_records(inputs.batch_prompts, setup.batch_ids),
    }
    del setup
    gc.collect()
    return {**_summarize(samples, nbytes), "routes": described}, prompts


def _load_sides(config: EngineBenchConfig, dtype: str, inputs: Inputs) -> DtypeSetup:
    engine = EngineSide(config, dtype)
    engine_model = cast(LlamaForCausalLM, engine.llm.engine.model)
    described = routes.describe(engine_model.routed_products())
    reference = ReferenceSide(inputs.model_path, inputs.state, dtype)
    return DtypeSetup(
        dtype=dtype,
        engine=engine,
        reference=reference,
        routes=described,
        b1_ids=[engine.chat_ids(p.text) for p in inputs.b1_prompts],
        batch_ids=[engine.chat_ids(p.text) for p in inputs.batch_prompts],
        separate=linear_layers(reference.model, fused=False),
        fused=linear_layers(reference.model, fused=True),
        nbytes=weight_bytes(reference.model),
    )


def _warm_up(config: EngineBenchConfig, setup: DtypeSetup) -> None:
    n = config.new_tokens
    for side in (setup.engine, setup.reference):
        side.decode_b1(setup.b1_ids[0], min(n, _WARMUP_B1_TOKENS))
        side.generate_batch(setup.batch_ids, min(n, _WARMUP_BATCH_TOKENS))


def _run_round(
    config: EngineBenchConfig,
    setup: DtypeSetup,
    r: int,
    b1_prompts: list[BenchPrompt],
    samples: Samples,
    progress: Progress,
    task: Any,
) -> None:
    """One round, the sides alternating engine first: batch 1 per prompt, then batch `batch`,
    then the kernel floors and the read bandwidth."""
    label = f"{setup.dtype} round {r + 1}"
    for i, (prompt, ids) in enumerate(zip(b1_prompts, setup.b1_ids, strict=True)):
        samples.b1.append(_b1_sample(config, setup, r, i, prompt, ids, label, progress, task))
    samples.batch.append(_batch_sample(config, setup, r, label, progress, task))
    progress.update(task, description=f"{label}: kernel floor")
    steps, on = config.kernel_steps, setup.kernel_inputs
    samples.kernel.append(
        {
            "round": r,
            "steps": steps,
            "separate_steps_s": kernel_steps_per_s(setup.separate, steps, *on),
            "fused_steps_s": kernel_steps_per_s(setup.fused, steps, *on),
        }
    )
    progress.advance(task, 2)
    progress.update(task, description=f"{label}: read bandwidth")
    bps, seconds = read_bandwidth(config.bandwidth_mib << 20)
    samples.bandwidth.append(
        {
            "round": r,
            "bytes": config.bandwidth_mib << 20,
            "trial_s": seconds,
            "gb_s": bps / 1e9,
            "limit_steps_s": bps / setup.nbytes,
        }
    )
    progress.advance(task)


def _b1_sample(
    config: EngineBenchConfig,
    setup: DtypeSetup,
    r: int,
    i: int,
    prompt: BenchPrompt,
    ids: list[int],
    label: str,
    progress: Progress,
    task: Any,
) -> dict[str, Any]:
    """Prompt `i` at batch 1 on the engine, then on transformers: TPOT and agreeing tokens."""
    n = config.new_tokens
    progress.update(task, description=f"{label}: batch 1, engine")
    engine_tpot, engine_tokens = setup.engine.decode_b1(ids, n)
    progress.advance(task)
    progress.update(task, description=f"{label}: batch 1, transformers")
    hf_tpot, hf_tokens = setup.reference.decode_b1(ids, n)
    progress.advance(task)
    return {
        "round": r,
        "prompt": i,
        "question_id": prompt.question_id,
        "n_prompt": len(ids),
        "engine_tpot_s": engine_tpot,
        "engine_tok_s": 1 / engine_tpot,
        "hf_tpot_s": hf_tpot,
        "hf_tok_s": 1 / hf_tpot,
        "agree_tokens": _common_prefix(engine_tokens, hf_tokens),
    }


def _batch_sample(
    config: EngineBenchConfig, setup: DtypeSetup, r: int, label: str, progress: Progress, task: Any
) -> dict[str, Any]:
    """The whole batch in one `generate` on the engine, then on transformers: output tok/s."""
    n = config.new_tokens
    progress.update(task, description=f"{label}: batch {config.batch}, engine")
    engine_wall = setup.engine.generate_batch(setup.batch_ids, n)
    progress.advance(task)
    progress.update(task, description=f"{label}: batch {config.batch}, transformers")
    hf_wall = setup.reference.generate_batch(setup.batch_ids, n)
    progress.advance(task)
    out_tokens = config.batch * n
    return {
        "round": r,
        "output_tokens": out_tokens,
        "engine_wall_s": engine_wall,
        "engine_tok_s": out_tokens / engine_wall,
        "hf_wall_s": hf_wall,
        "hf_tok_s": out_tokens / hf_wall,
    }


def _summarize(samples: Samples, nbytes: int) -> dict[str, Any]:
    b1, batched, kernel, bandwidth = samples.b1, samples.batch, samples.kernel, samples.bandwidth
    summary = {
        "engine_b1_tok_s": stats([s["engine_tok_s"] for s in b1]),
        "hf_b1_tok_s": stats([s["hf_tok_s"] for s in b1]),
        "engine_batch_tok_s": stats([s["engine_tok_s"] for s in batched]),
        "hf_batch_tok_s": stats([s["hf_tok_s"] for s in batched]),
        "kernel_floor_steps_s": stats([s["separate_steps_s"] for s in kernel]),
        "kernel_floor_fused_steps_s": stats([s["fused_steps_s"] for s in kernel]),
        "read_bandwidth_gb_s": stats([s["gb_s"] for s in bandwidth]),
        "bandwidth_limit_steps_s": stats([s["limit_steps_s"] for s in bandwidth]),
    }
    med = {k: v["median"] for k, v in summary.items()}
    engine_b1 = med["engine_b1_tok_s"]
    return {
        "weight_bytes": nbytes,
        "summary": summary,
        "ratios": {
            "b1_engine_vs_hf": engine_b1 / med["hf_b1_tok_s"],
            "batch_engine_vs_hf": med["engine_batch_tok_s"] / med["hf_batch_tok_s"],
        },
        "fractions": {
            "engine_b1_of_kernel_floor": engine_b1 / med["kernel_floor_steps_s"],
            "engine_b1_of_kernel_floor_fused": engine_b1 / med["kernel_floor_fused_steps_s"],
            "engine_b1_of_bandwidth_limit": engine_b1 / med["bandwidth_limit_steps_s"],
            "hf_b1_of_kernel_floor": med["hf_b1_tok_s"] / med["kernel_floor_steps_s"],
        },
        "samples": {"b1": b1, "batch": batched, "kernel": kernel, "bandwidth": bandwidth},
    }


def check_targets(config: EngineBenchConfig, results: dict[str, Any]) -> list[dict[str, Any]]:
    """The BENCHMARKS.md targets that this run's dtypes cover, each with its measured value."""
    targets = []
    for dtype, res in results.items():
        targets.append(
            target_result(
                f"{dtype} batch 1: engine / kernel floor",
                res["fractions"]["engine_b1_of_kernel_floor"],
                TARGET_B1_OF_KERNEL_FLOOR,
            )
        )
    if "bfloat16" in results:
        ratios = results["bfloat16"]["ratios"]
        targets.append(
            target_result(
                "bfloat16 batch 1: engine / transformers",
                ratios["b1_engine_vs_hf"],
                TARGET_B1_BF16_VS_HF,
            )
        )
        targets.append(
            target_result(
                f"bfloat16 batch {config.batch}: engine / transformers",
                ratios["batch_engine_vs_hf"],
                TARGET_BATCH_BF16_VS_HF,
            )
        )
    return targets


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _prompt_records(
    prompts: Sequence[BenchPrompt], ids: Sequence[list[int]]
) -> list[dict[str, Any]]:
    return [{**asdict(p), "n_tokens": len(i)} for p, i in zip(prompts, ids, strict=True)]


# --- output -------------------------------------------------------------------------------


def _dtype_table(config: EngineBenchConfig, dtype: str, res: dict[str, Any]) -> Table:
    s, ratios, frac = res["summary"], res["ratios"], res["fractions"]
    label = dtype if config.quantization is None else f"{dtype}, {config.quantization} weights"
    table = Table(
        title=f"{label}: {config.new_tokens} new tokens, greedy, {config.threads} threads; "
        f"median (min-max) of {config.rounds} rounds",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    table.add_column("", no_wrap=True)
    table.add_column("engine", justify="right", no_wrap=True)
    table.add_column("transformers", justify="right", no_wrap=True)
    table.add_column("engine / HF", justify="right", no_wrap=True)
    table.add_row(
        "batch 1 decode tok/s",
        fmt_stats(s["engine_b1_tok_s"]),
        fmt_stats(s["hf_b1_tok_s"]),
        f"{ratios['b1_engine_vs_hf']:.2f}x",
    )
    table.add_row(
        f"batch {config.batch} output tok/s",
        fmt_stats(s["engine_batch_tok_s"]),
        fmt_stats(s["hf_batch_tok_s"]),
        f"{ratios['batch_engine_vs_hf']:.2f}x",
    )
    table.add_section()
    table.add_row(
        "[bold]batch-1 limits[/bold]", "[bold]steps/s[/bold]", "", "[bold]engine b1[/bold]"
    )
    for label, key, fraction in (
        ("kernel floor", "kernel_floor_steps_s", "engine_b1_of_kernel_floor"),
        ("kernel floor, fused", "kernel_floor_fused_steps_s", "engine_b1_of_kernel_floor_fused"),
        ("bandwidth limit", "bandwidth_limit_steps_s", "engine_b1_of_bandwidth_limit"),
    ):
        table.add_row(label, fmt_stats(s[key]), "", f"{frac[fraction]:.0%}")
    table.add_row("  read bandwidth GB/s", fmt_stats(s["read_bandwidth_gb_s"]), "", "")
    table.add_row("  weight GB", f"{res['weight_bytes'] / 1e9:.3f}", "", "")
    return table


def write_chart(report: dict[str, Any], path: Path) -> None:
    """Bars: engine vs transformers tok/s at batch 1 and batch N per dtype (median, min-max);
    lines over the batch-1 bars: kernel floors and the bandwidth limit."""
    plt = pyplot()
    config, results = report["config"], report["results"]
    dtypes = list(results)
    fig, (ax_b1, ax_batch) = plt.subplots(1, 2, figsize=(11, 4.8))
    width = 0.36
    sides = (("engine", "Tandem engine", "tab:blue"), ("hf", "transformers", "tab:gray"))
    limits = (
        ("kernel_floor_steps_s", "kernel floor (separate)", "-"),
        ("kernel_floor_fused_steps_s", "kernel floor (fused)", ":"),
        ("bandwidth_limit_steps_s", "bandwidth limit", "--"),
    )
    for i, dtype in enumerate(dtypes):
        s = results[dtype]["summary"]
        for ax, key in ((ax_b1, "b1"), (ax_batch, "batch")):
            for j, (side, label, color) in enumerate(sides):
                st, x = s[f"{side}_{key}_tok_s"], i + (j - 0.5) * width
                shown = label if i == 0 else None
                median_bar(ax, x, st, width, capsize=3, color=color, label=shown)
        for key, label, style in limits:
            ax_b1.hlines(
                s[key]["median"],
                i - 0.45,
                i + 0.45,
                colors="tab:red",
                linestyles=style,
                label=label if i == 0 else None,
            )
    ax_b1.set_title("batch 1 decode (1 / TPOT)")
    ax_batch.set_title(f"batch {config['batch']} output tok/s")
    for ax, key in ((ax_b1, "b1"), (ax_batch, "batch")):
        ratios = [results[d]["ratios"][f"{key}_engine_vs_hf"] for d in dtypes]
        ax.set_xticks(
            range(len(dtypes)),
            [f"{d}\nengine / HF {r:.2f}x" for d, r in zip(dtypes, ratios, strict=True)],
        )
        ax.set_ylabel("tokens/s")
        ax.legend(fontsize=8, loc="upper left")
        ax.margins(y=0.15)
    save_chart(fig, rounds_title(config), path)
