"""`tandem bench quant`: weight formats x speculation x batch size in one run, against llama.cpp.

Method
------
Engines: one Tandem `LLM` per (format, speculation), loaded before the first measurement: format
`fp32` (dense float32, no speculation), `bf16` (dense bfloat16), `int8` or `int4` (bfloat16
activations, groups of `group_size`; the linear layers quantized, the LM head with its int8
copy), speculation `off` or `ngram` (k = `num_speculative_tokens`). Same model, device, threads
and KV block size; prefix caching off (the same prompts come back every round). Each engine's
kernel routes (`engine/routes.py`: this machine's measured table) are printed and recorded.

Prompts: the input-grounded Spec-Bench dev categories (summarization, rag: long prompts whose
answers quote them, so n-gram drafts find matches), first turns, chat-templated, in a seeded
shuffle. At batch 1 the first `prompts` of them one at a time; at batch B > 1 one batch of the
first B (cycling).

A run is greedy with exactly `new_tokens` output tokens (EOS ignored). The engine is stepped
directly: decode tok/s = the output tokens produced after every request of the run has its first
token, over the time from that moment to the last token (prefill excluded; at batch 1 it is
1 / TPOT); output tok/s = all output tokens over the wall time of the run (prefill included).
Each n-gram run's tokens are compared with the same format's run without speculation (the first
differing position per request), and llama.cpp's with the int4 engine's (the same Q4_1 weights).

llama.cpp (`llama-cpp-python`, the `bench-ref` extra): `Llama` on the same GGUF with `n_threads`
= `threads`, the same prompt token ids, greedy (`temp=0`), `new_tokens` tokens drawn from its
`generate` iterator and each stamped: decode tok/s = (n - 1) / (last - first stamp), at batch 1
only (a single stream). Skipped, saying how to install it, when `llama_cpp` does not import.

Kernel floor per format: the engine's own linear layers (qkv, o, gate_up, down per decoder
layer, then the LM head over the whole vocabulary as `compute_logits` runs it: the float table
for fp32 / bf16, the int8 copy for int8 / int4) alone at batch 1, back to back (`tandem bench
engine`'s `kernel_steps_per_s`), in steps/s. The layers are called as the decode plan calls them
(`RowCall`: each product bound to its route once), not through their modules' `forward`, whose
route lookup costs a few microseconds a call: through the modules, the int4 floor of SmolLM2
read 193-197 steps/s against 233-249 bound (2 threads, Zen 4, 7 December), a floor 20% slower
than the products the engine runs, which flattered the engine's fraction of it.

Memory roofline per format: the machine's read bandwidth at the engine's thread count (`t.sum()`
over a float32 tensor of `bandwidth_mib` MiB, far beyond the last-level cache; best of 5, each
round) over the bytes a batch-1 decode step must read: the weights its routes read
(`LlamaForCausalLM.decode_weight_bytes`: codes and scales, the LM head's int8 copy) plus the KV
cache at the measured context (the batch-1 prompts' mean length plus half the new tokens).

Order: in each of `rounds` rounds, every batch-1 prompt runs on every side in turn (the engines,
then llama.cpp), then every batch of B on every engine, then the kernel floors. Figures are
medians of their samples with min-max; ratios are ratios of medians.

Targets (issue 27), without speculation, decode tok/s: int8 batch 1 >= 1.6x bf16; int4 batch 1
>= 2x bf16 and >= 1.0x llama.cpp's single stream; every format's batch 1 >= 70% of its memory
roofline (int4 >= 50%) and >= 85% of its kernel floor; at the largest batch, each quantized
format >= bf16. And KV transfer bytes of an int8 cache <= 0.55x bf16
(`kv_quant.kv_bytes_per_token`, scales included).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from rich.console import Console

from tandem import hub
from tandem.bench.common import BenchError, first_difference, write_report
from tandem.bench.engine_probes import (
    LinearLayer,
    greedy_params,
    kernel_steps_per_s,
    read_bandwidth,
)
from tandem.bench.machine import machine_info, machine_line
from tandem.bench.quant_config import (
    BF16,
    FORMATS,
    FP32,
    INSTALL_HINT,
    LLAMA_CPP,
    NGRAM,
    SPEC_OFF,
    SPECS,
    TARGET_BATCH_VS_BF16,
    TARGET_INT4_VS_BF16,
    TARGET_INT4_VS_LLAMA_CPP,
    TARGET_INT8_VS_BF16,
    TARGET_KV_INT8_OF_BF16,
    TARGET_OF_KERNEL_FLOOR,
    TARGET_OF_ROOFLINE,
    QuantBenchConfig,
)
from tandem.bench.quant_report import print_report, write_chart
from tandem.bench.report import routes_table, stats, target_result
from tandem.config import QUANT_METHODS
from tandem.engine import LLM, routes
from tandem.engine.dtypes import KV_TORCH_DTYPES
from tandem.engine.kv_quant import kv_bytes_per_token
from tandem.engine.models.linear import RowKernel
from tandem.engine.models.llama import DecoderLayer, LlamaForCausalLM
from tandem.engine.models.loader import load_tokenizer
from tandem.model_config import load_config
from tandem.progress import progress_bar

KV_DTYPES = {BF16: torch.bfloat16, "int8": torch.int8}  # the KV caches whose bytes are compared

_WARMUP_TOKENS = 4


@dataclass
class Run:
    wall_s: float
    decode_s: float  # from every request's first token to the last token
    decode_tokens: int  # output tokens produced in that time
    token_ids: list[list[int]]
    spec: dict[str, int] = field(default_factory=dict)  # drafts, draft_tokens, accepted

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


# --- prompts ------------------------------------------------------------------------------


def load_prompts(config: QuantBenchConfig, tokenizer: Any) -> list[tuple[int, list[int]]]:
    """(question id, chat-templated token ids) of the configured categories, seeded shuffle."""
    path = Path(config.prompts_path)
    if not path.is_file():
        raise BenchError(f"Spec-Bench prompts not found: {path}")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = sorted(
        (r for r in rows if r["category"] in config.categories),
        key=lambda r: int(r["question_id"]),
    )
    if not rows:
        raise BenchError(f"no prompts of {list(config.categories)} in {path}")
    random.Random(config.seed).shuffle(rows)
    prompts = []
    for row in rows:
        messages = [{"role": "user", "content": row["turns"][0]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        prompts.append((int(row["question_id"]), ids))
    return prompts


def batches_of(
    prompts: Sequence[tuple[int, list[int]]], batch_size: int, num_b1: int
) -> list[list[tuple[int, list[int]]]]:
    """At batch 1 the first `num_b1` prompts, one each; else one batch of the first B (cycling)."""
    if batch_size == 1:
        return [[prompts[i % len(prompts)]] for i in range(num_b1)]
    return [[prompts[i % len(prompts)] for i in range(batch_size)]]


def kv_blocks(config: QuantBenchConfig, prompts: Sequence[tuple[int, list[int]]]) -> int:
    """KV blocks of the largest batch: prompt, output and drafts of every request, 10% spare."""
    most = 0
    for b in config.batch_sizes:
        for batch in batches_of(prompts, b, config.prompts):
            tokens = [
                len(ids) + config.new_tokens + config.num_speculative_tokens + 1 for _, ids in batch
            ]
            most = max(most, sum(math.ceil(t / config.block_size) for t in tokens))
    return math.ceil(most * 1.1) + 1


# --- the sides ----------------------------------------------------------------------------


class EngineSide:
    """A Tandem `LLM` in one weight format (float32 for fp32, else bfloat16), with n-gram
    speculation or without."""

    def __init__(self, config: QuantBenchConfig, fmt: str, spec: str, num_blocks: int) -> None:
        self.fmt, self.spec = fmt, spec
        self.label = f"{fmt}, {spec}"
        self.dtype = torch.float32 if fmt == FP32 else torch.bfloat16
        self.llm = LLM(
            config.model,
            dtype="float32" if fmt == FP32 else "bfloat16",
            device=config.device,
            num_threads=config.threads,
            block_size=config.block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=False,
            max_num_seqs=max(config.batch_sizes),
            quantization=fmt if fmt in QUANT_METHODS else None,
            quant_group_size=config.group_size,
            kv_cache_dtype=config.kv_cache_dtype,
            speculative=None
            if spec == SPEC_OFF
            else {"method": NGRAM, "num_speculative_tokens": config.num_speculative_tokens},
        )
        self._request_ids = itertools.count()

    @property
    def model(self) -> LlamaForCausalLM:
        return cast(LlamaForCausalLM, self.llm.engine.model)

    def run(self, batch: list[list[int]], new_tokens: int) -> Run:
        engine = self.llm.engine
        params = greedy_params(new_tokens)
        t0 = time.perf_counter()
        reqs = [engine.add_request(f"q{next(self._request_ids)}", ids, params) for ids in batch]
        decode_from, tokens_before = None, 0
        while engine.has_unfinished():
            engine.step()
            if decode_from is None and all(r.output_token_ids for r in reqs):
                decode_from = time.perf_counter()
                tokens_before = sum(len(r.output_token_ids) for r in reqs)
        end = time.perf_counter()
        token_ids = [list(r.output_token_ids) for r in reqs]
        if decode_from is None or {len(t) for t in token_ids} != {new_tokens}:
            raise BenchError(f"{self.label} produced {[len(t) for t in token_ids]} tokens")
        spec = {
            "drafts": sum(r.metrics.num_drafts for r in reqs),
            "draft_tokens": sum(r.metrics.num_draft_tokens for r in reqs),
            "accepted": sum(r.metrics.num_accepted_tokens for r in reqs),
        }
        decode_tokens = len(batch) * new_tokens - tokens_before
        return Run(end - t0, end - decode_from, decode_tokens, token_ids, spec)


class LlamaCppSide:
    """llama.cpp on the same GGUF, one stream."""

    label = LLAMA_CPP
    fmt = spec = LLAMA_CPP

    def __init__(self, gguf: Path, threads: int, n_ctx: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=str(gguf),
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=n_ctx,
            verbose=False,
        )

    def run(self, batch: list[list[int]], new_tokens: int) -> Run:
        (ids,) = batch
        self.llm.reset()  # no prefix reuse from the previous run
        stamps: list[float] = []
        tokens: list[int] = []
        t0 = time.perf_counter()
        for token in self.llm.generate(ids, temp=0.0):  # greedy, EOS not checked
            stamps.append(time.perf_counter())
            tokens.append(int(token))
            if len(tokens) == new_tokens:
                break
        return Run(stamps[-1] - t0, stamps[-1] - stamps[0], new_tokens - 1, [tokens])


def llama_cpp_side(
    config: QuantBenchConfig, model_path: Path, n_ctx: int
) -> tuple[LlamaCppSide | None, str | None]:
    """(the side, None) or (None, why it is skipped)."""
    if not config.llama_cpp:
        return None, "turned off (--no-llama-cpp)"
    if importlib.util.find_spec("llama_cpp") is None:
        return None, f"llama_cpp is not installed: {INSTALL_HINT}"
    if model_path.suffix != ".gguf":
        return None, f"{model_path} is not a GGUF file"
    return LlamaCppSide(model_path, config.threads, n_ctx), None


# --- kernel floor -------------------------------------------------------------------------


@dataclass(frozen=True)
class LogitsLayer:
    """The LM head over the whole vocabulary, as a decode step computes it."""

    model: LlamaForCausalLM

    @property
    def in_features(self) -> int:
        return self.model.cfg.hidden_size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [1, hidden] -> [1, vocab]
        return self.model.compute_logits(x)


@dataclass(frozen=True)
class RowCall:
    """A linear layer's one-row product as the decode plan calls it: the route bound once
    (`row_kernel`), not looked up through the module's `forward` at every call."""

    in_features: int
    call: RowKernel

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.call(x)


def engine_linear_layers(model: LlamaForCausalLM) -> list[LinearLayer]:
    """The linear layers a batch-1 decode step of the engine runs, in order, as its decode plan
    calls them (the module itself where a layer has no direct call), then its LM head."""
    dtype = model.embed_tokens.weight.dtype
    layers: list[LinearLayer] = []
    for layer in cast("list[DecoderLayer]", list(model.layers)):
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            call = linear.row_kernel(dtype, 1)
            layers.append(linear if call is None else RowCall(linear.in_features, call))
    layers.append(LogitsLayer(model))
    return layers


# --- the run ------------------------------------------------------------------------------


def run_quant_bench(
    config: QuantBenchConfig,
    json_out: str | Path | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run the matrix, print the tables and target checks, return (and write) the report."""
    console = console or Console()
    torch.set_num_threads(config.threads)
    model_path = hub.resolve(config.model)
    prompts = load_prompts(config, load_tokenizer(model_path))
    num_blocks = kv_blocks(config, prompts)
    machine = {**machine_info(), "torch_threads": torch.get_num_threads()}
    console.print(machine_line(machine))
    engines = _load_engines(config, num_blocks, console)
    n_ctx = max(len(ids) for _, ids in prompts) + config.new_tokens + 16
    llama, skipped = llama_cpp_side(config, model_path, n_ctx)
    if skipped is not None:
        console.print(f"[yellow]llama.cpp skipped:[/yellow] {skipped}")

    plain = {e.fmt: e for e in engines if e.spec == SPEC_OFF}
    described = {fmt: routes.describe(e.model.routed_products()) for fmt, e in plain.items()}
    for fmt, text in described.items():
        console.print(routes_table(f"{fmt}: kernel routes", text))
    measured = _measure(config, prompts, engines, llama, console)

    summary = summarize(measured.samples, config)
    floors = summarize_kernel(measured.kernel, summary)
    context = statistics.mean(len(b[0][1]) for b in batches_of(prompts, 1, config.prompts))
    rooflines = summarize_roofline(
        plain, measured.bandwidth, context + config.new_tokens / 2, summary, config.kv_cache_dtype
    )
    cfg = load_config(model_path)
    kv = {name: kv_bytes_per_token(cfg, dtype) for name, dtype in KV_DTYPES.items()}
    report: dict[str, Any] = {
        "benchmark": "quant",
        "config": asdict(config),
        "method": __doc__,
        "machine": machine,
        "routes": described,
        "model_path": str(model_path),
        "kv_blocks": num_blocks,
        "skipped": {LLAMA_CPP: skipped} if skipped else {},
        "prompts": [{"question_id": q, "n_tokens": len(ids)} for q, ids in prompts],
        "samples": measured.samples,
        "summary": summary,
        "kernel_floor": floors,
        "kernel_samples": measured.kernel,
        "read_bandwidth_gb_s": stats([b / 1e9 for b in measured.bandwidth]),
        "roofline": rooflines,
        "kv_bytes_per_token": kv,
        "targets": check_targets(summary, floors, rooflines, kv, config),
    }
    print_report(report, console)
    if json_out is not None:
        write_report(report, json_out, write_chart, console)
    return report


def _load_engines(config: QuantBenchConfig, num_blocks: int, console: Console) -> list[EngineSide]:
    """Every (format, speculation) engine but fp32 with n-gram, loaded before any measurement."""
    engines: list[EngineSide] = []
    sides = [(f, s) for f, s in itertools.product(config.formats, SPECS) if (f, s) != (FP32, NGRAM)]
    with progress_bar(console) as progress:
        task = progress.add_task("loading engines", total=len(sides))
        for fmt, spec in sides:
            progress.update(task, description=f"loading {fmt}, {spec}")
            engines.append(EngineSide(config, fmt, spec, num_blocks))
            progress.advance(task)
    return engines


@dataclass
class Measurements:
    """Every round's raw figures: run samples, kernel floors, read bandwidth (bytes/s)."""

    samples: list[dict[str, Any]] = field(default_factory=list)
    kernel: list[dict[str, Any]] = field(default_factory=list)
    bandwidth: list[float] = field(default_factory=list)


def _measure(
    config: QuantBenchConfig,
    prompts: Sequence[tuple[int, list[int]]],
    engines: list[EngineSide],
    llama: LlamaCppSide | None,
    console: Console,
) -> Measurements:
    """The warm-up, then per round: every batch on every side, the kernel floors, the read
    bandwidth."""
    plain = {e.fmt: e for e in engines if e.spec == SPEC_OFF}
    measured = Measurements()
    batches = {b: batches_of(prompts, b, config.prompts) for b in config.batch_sizes}
    runs = sum(len(bs) * len(_sides(engines, llama, b)) for b, bs in batches.items())
    with progress_bar(console) as progress:
        task = progress.add_task("warm-up", total=config.rounds * (runs + len(plain) + 1))
        if config.warmup:
            for side in _sides(engines, llama, 1):
                side.run([prompts[0][1]], _WARMUP_TOKENS)
        for round_ in range(config.rounds):
            for batch_size, size_batches in batches.items():
                for index, batch in enumerate(size_batches):
                    sides = _sides(engines, llama, batch_size)
                    measured.samples += _run_batch(
                        config, round_, batch_size, index, batch, sides, progress, task
                    )
            measured.kernel += _kernel_floors(config, plain, round_, progress, task)
            progress.update(task, description=f"round {round_ + 1}: read bandwidth")
            measured.bandwidth.append(read_bandwidth(config.bandwidth_mib << 20)[0])
            progress.advance(task)
    return measured


def _run_batch(
    config: QuantBenchConfig,
    round_: int,
    batch_size: int,
    index: int,
    batch: list[tuple[int, list[int]]],
    sides: Sequence[EngineSide | LlamaCppSide],
    progress: Any,
    task: Any,
) -> list[dict[str, Any]]:
    """One batch on every side in turn, each run compared with its format's run without
    speculation."""
    samples = []
    base: dict[str, Run] = {}
    for side in sides:
        progress.update(task, description=f"round {round_ + 1}: batch {batch_size}, {side.label}")
        run = side.run([ids for _, ids in batch], config.new_tokens)
        if side.spec == SPEC_OFF:
            base[side.fmt] = run
        samples.append(_sample(round_, batch_size, index, side, batch, run, base))
        progress.advance(task)
    return samples


def _sides(
    engines: Sequence[EngineSide], llama: LlamaCppSide | None, batch_size: int
) -> list[EngineSide | LlamaCppSide]:
    """The engines, then llama.cpp at batch 1."""
    return [*engines, *([llama] if llama is not None and batch_size == 1 else [])]


def _kernel_floors(
    config: QuantBenchConfig,
    plain: dict[str, EngineSide],
    round_: int,
    progress: Any,
    task: Any,
) -> list[dict[str, Any]]:
    out = []
    for fmt, side in plain.items():
        progress.update(task, description=f"round {round_ + 1}: kernel floor, {fmt}")
        device = torch.device(config.device)
        layers = engine_linear_layers(side.model)
        steps_s = kernel_steps_per_s(layers, config.kernel_steps, side.dtype, device)
        out.append({"round": round_, "format": fmt, "steps_s": steps_s})
        progress.advance(task)
    return out


def _sample(
    round_: int,
    batch_size: int,
    index: int,
    side: EngineSide | LlamaCppSide,
    batch: list[tuple[int, list[int]]],
    run: Run,
    base: dict[str, Run],
) -> dict[str, Any]:
    """One run as JSON; `base`: this batch's runs without speculation so far, by format."""
    sample: dict[str, Any] = {
        "round": round_,
        "batch_size": batch_size,
        "batch": index,
        "side": side.label,
        "format": side.fmt,
        "spec": side.spec,
        "question_ids": [q for q, _ in batch],
        "n_prompt": [len(ids) for _, ids in batch],
        "output_tokens": run.output_tokens,
        "wall_s": run.wall_s,
        "output_tok_s": run.output_tokens / run.wall_s,
        "decode_s": run.decode_s,
        "decode_tokens": run.decode_tokens,
        "decode_tok_s": run.decode_tokens / run.decode_s,
        "spec_counters": run.spec,
    }
    if side.spec == NGRAM and side.fmt in base:  # per request; None = the same tokens
        pairs = zip(run.token_ids, base[side.fmt].token_ids, strict=True)
        sample["first_difference"] = [first_difference(a, b) for a, b in pairs]
    if side.fmt == LLAMA_CPP and "int4" in base:
        first = first_difference(run.token_ids[0], base["int4"].token_ids[0])
        sample["first_difference_int4"] = first
    return sample


# --- summaries and targets ----------------------------------------------------------------


def summarize(samples: Sequence[dict[str, Any]], config: QuantBenchConfig) -> list[dict[str, Any]]:
    """One row per (side, batch size): decode and output tok/s, ratios, acceptance, same output."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for s in samples:
        groups.setdefault((s["format"], s["spec"], s["batch_size"]), []).append(s)
    medians = {key: stats([s["decode_tok_s"] for s in ss])["median"] for key, ss in groups.items()}
    llama = medians.get((LLAMA_CPP, LLAMA_CPP, 1))
    rows = []
    for (fmt, spec, b), ss in groups.items():
        decode = stats([s["decode_tok_s"] for s in ss])
        bf16 = medians.get((BF16, spec, b))
        row: dict[str, Any] = {
            "format": fmt,
            "spec": spec,
            "batch_size": b,
            "runs": len(ss),
            "decode_tok_s": decode,
            "output_tok_s": stats([s["output_tok_s"] for s in ss]),
            "vs_bf16": decode["median"] / bf16 if bf16 and fmt != LLAMA_CPP else None,
            "vs_llama_cpp": decode["median"] / llama if llama and fmt != LLAMA_CPP else None,
        }
        if spec == NGRAM:
            differences = [d for s in ss for d in s.get("first_difference", [])]
            counters = [s["spec_counters"] for s in ss]
            drafts = sum(c["drafts"] for c in counters)
            draft_tokens = sum(c["draft_tokens"] for c in counters)
            accepted = sum(c["accepted"] for c in counters)
            row["same_output"] = [differences.count(None), len(differences)]
            row["first_differences"] = sorted(d for d in differences if d is not None)
            row["acceptance_rate"] = accepted / draft_tokens if draft_tokens else None
            row["mean_acceptance_length"] = 1 + accepted / drafts if drafts else None
            off = medians.get((fmt, SPEC_OFF, b))
            row["vs_off"] = decode["median"] / off if off else None
        if fmt == LLAMA_CPP:  # greedy tokens against the int4 engine's (the same weights)
            row["first_difference_int4"] = [s.get("first_difference_int4") for s in ss]
        rows.append(row)
    order = {f: i for i, f in enumerate((*FORMATS, LLAMA_CPP))}
    rows.sort(key=lambda r: (r["batch_size"], order[r["format"]], r["spec"] != SPEC_OFF))
    return rows


def summarize_kernel(
    kernel: Sequence[dict[str, Any]], summary: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per format: the kernel floor, its ratio to bf16's, and engine batch 1 (no spec) / floor."""
    floors = {
        fmt: stats([k["steps_s"] for k in kernel if k["format"] == fmt])
        for fmt in dict.fromkeys(k["format"] for k in kernel)
    }
    b1 = {
        r["format"]: r["decode_tok_s"]["median"]
        for r in summary
        if r["batch_size"] == 1 and r["spec"] == SPEC_OFF
    }
    bf16 = floors.get(BF16)
    return [
        {
            "format": fmt,
            "steps_s": s,
            "vs_bf16": s["median"] / bf16["median"] if bf16 else None,
            "engine_b1_of_floor": b1[fmt] / s["median"] if fmt in b1 else None,
        }
        for fmt, s in floors.items()
    ]


def summarize_roofline(
    plain: dict[str, EngineSide],
    bandwidth: Sequence[float],
    context: float,
    summary: Sequence[dict[str, Any]],
    kv_cache_dtype: str,
) -> list[dict[str, Any]]:
    """Per format: the bytes a batch-1 decode step reads (weights through its routes, KV at
    `context` tokens), the memory roofline (median read bandwidth / those bytes, steps/s) and
    the engine's batch 1 (no spec) over it."""
    b1 = {
        r["format"]: r["decode_tok_s"]["median"]
        for r in summary
        if r["batch_size"] == 1 and r["spec"] == SPEC_OFF
    }
    gb_s = statistics.median(bandwidth)
    rows = []
    for fmt, side in plain.items():
        model = side.model
        kv_dtype = KV_TORCH_DTYPES.get(kv_cache_dtype, side.dtype)
        weight = model.decode_weight_bytes(1)
        kv = kv_bytes_per_token(model.cfg, kv_dtype) * context
        roofline = gb_s / (weight + kv)
        rows.append(
            {
                "format": fmt,
                "weight_bytes": weight,
                "kv_bytes": kv,
                "context_tokens": context,
                "roofline_tok_s": roofline,
                "engine_b1_of_roofline": b1[fmt] / roofline if fmt in b1 else None,
            }
        )
    return rows


def check_targets(
    summary: Sequence[dict[str, Any]],
    floors: Sequence[dict[str, Any]],
    rooflines: Sequence[dict[str, Any]],
    kv: dict[str, int],
    config: QuantBenchConfig,
) -> list[dict[str, Any]]:
    """The issue's targets that this run covers, each with its measured value."""
    tok_s = {
        (r["format"], r["batch_size"]): r["decode_tok_s"]["median"]
        for r in summary
        if r["spec"] in (SPEC_OFF, LLAMA_CPP)
    }
    targets = []
    for fmt, target in (("int8", TARGET_INT8_VS_BF16), ("int4", TARGET_INT4_VS_BF16)):
        if (fmt, 1) in tok_s and (BF16, 1) in tok_s:
            value = tok_s[fmt, 1] / tok_s[BF16, 1]
            targets.append(target_result(f"{fmt} batch 1: / bf16", value, target))
    llama = tok_s.get((LLAMA_CPP, 1))
    if llama is not None and ("int4", 1) in tok_s:
        value = tok_s["int4", 1] / llama
        targets.append(target_result("int4 batch 1: / llama.cpp", value, TARGET_INT4_VS_LLAMA_CPP))
    fractions = [
        *(
            (r["format"], "memory roofline", r["engine_b1_of_roofline"], TARGET_OF_ROOFLINE)
            for r in rooflines
        ),
        *(
            (f["format"], "kernel floor", f["engine_b1_of_floor"], TARGET_OF_KERNEL_FLOOR)
            for f in floors
        ),
    ]
    for fmt, limit, fraction, least in fractions:
        if fraction is not None:
            targets.append(target_result(f"{fmt} batch 1: of its {limit}", fraction, least[fmt]))
    largest = max(config.batch_sizes)
    for fmt in QUANT_METHODS:
        if largest > 1 and (fmt, largest) in tok_s and (BF16, largest) in tok_s:
            value = tok_s[fmt, largest] / tok_s[BF16, largest]
            targets.append(
                target_result(f"{fmt} batch {largest}: / bf16", value, TARGET_BATCH_VS_BF16)
            )
    # Stated as bf16 / int8 >= 1 / 0.55, so that more is better like the other targets.
    targets.append(
        target_result(
            f"KV bytes per token: bf16 / int8 (int8 <= {TARGET_KV_INT8_OF_BF16}x bf16)",
            kv[BF16] / kv["int8"],
            1 / TARGET_KV_INT8_OF_BF16,
        )
    )
    return targets
