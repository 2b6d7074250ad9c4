"""`tandem bench spec`: output tok/s with and without speculative decoding, side by side.

Method
------
Every engine is a Tandem `LLM` in this process with the same model, dtype, device, threads and KV
block size, prefix caching off (the same prompts come back every round): one without
speculation and one per proposer of `--methods` (`ngram`, `layerskip:N`, `draft:MODEL`,
`medusa:PATH`, `eagle:PATH`; a method the engine refuses to build is skipped with its reason).
All engines are loaded before the first measurement and run alternately on the same prompts.

Prompts: the first turn of the Spec-Bench dev questions (`tandem/data/specbench_dev.jsonl`),
chat-templated, per category; a seeded shuffle orders each category. Groups: input-grounded =
summarization, rag; chat = the eight MT-bench categories; other = translation, qa,
math_reasoning. Greedy decoding, at most `new_tokens` new tokens, EOS honoured.

Per round, for each batch size B and category: at B = 1 the first `prompts_per_category` prompts
one at a time; at B > 1 one batch of the first B prompts (cycling when the category has fewer).
Each batch runs on the engine without speculation first, then on each proposer's engine; at
B = 1 also on `transformers` (a dense model holding the same weights, built as by `tandem bench
engine`): plain greedy `generate`, prompt lookup (`prompt_lookup_num_tokens` = the engine's k) and,
when `draft:MODEL` is given, assisted generation (`assistant_model=`).

Measured per run: output tokens / wall seconds of the whole `generate` call (prefill included);
each request's TPOT (the engine's; decode speed without prefill); the engine's speculation
counters over the run (drafts, draft tokens, accepted, per position, proposer and verify time);
and whether each request's greedy output equals the run without speculation (token for token).

Summaries per (category or group, B, side): tok/s = output tokens / wall seconds summed over the
scope's runs; spec / no-spec = the ratio of those, with the median and min-max of the per-run
ratios beside it; decode speedup = median over requests of TPOT without / with speculation;
acceptance rate = accepted / draft tokens, mean acceptance length = 1 + accepted / drafts,
per-position rates (BENCHMARKS.md names). Targets (BENCHMARKS.md): n-gram, B = 1, input-grounded:
>= 2x without speculation and >= 2x transformers prompt lookup; the best model-based proposer,
B = 1, chat: >= 1.5x with the same greedy output; every proposer at B = 32 over all prompts:
>= 0.95x.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from tandem import hub
from tandem.bench.common import BenchError, first_difference, write_report
from tandem.bench.hf_reference import build_reference, quiet_transformers
from tandem.bench.machine import machine_info
from tandem.bench.report import stats, target_result
from tandem.bench.spec_config import (
    ALL,
    GROUPS,
    HF_ASSISTED,
    HF_GREEDY,
    HF_LOOKUP,
    LARGE_BATCH,
    NO_SPEC,
    TARGET_LARGE_BATCH,
    TARGET_MODEL_B1_CHAT,
    TARGET_NGRAM_B1_GROUNDED,
    SpecBenchConfig,
    SpecMethod,
)
from tandem.bench.spec_report import print_report, write_chart
from tandem.engine import LLM, SamplingParams
from tandem.engine.dtypes import TORCH_DTYPES
from tandem.engine.models.loader import iter_weights, load_tokenizer
from tandem.engine.spec.acceptance import SpecStats
from tandem.progress import progress_bar

_WARMUP_TOKENS = 4


@dataclass(frozen=True)
class Prompt:
    question_id: int
    category: str
    token_ids: list[int]


# --- prompts ------------------------------------------------------------------------------


def load_prompts(config: SpecBenchConfig, tokenizer: Any) -> dict[str, list[Prompt]]:
    """Per category, its chat-templated first turns in a seeded shuffle."""
    path = Path(config.prompts_path)
    if not path.is_file():
        raise BenchError(f"Spec-Bench prompts not found: {path}")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: int(r["question_id"]))
    random.Random(config.seed).shuffle(rows)
    prompts: dict[str, list[Prompt]] = {c: [] for c in config.categories}
    for row in rows:
        if row["category"] in prompts:
            messages = [{"role": "user", "content": row["turns"][0]}]
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            prompts[row["category"]].append(Prompt(int(row["question_id"]), row["category"], ids))
    empty = [c for c, ps in prompts.items() if not ps]
    if empty:
        raise BenchError(f"no Spec-Bench prompts of {empty} in {path}")
    return prompts


def batches_of(prompts: Sequence[Prompt], batch_size: int, num_b1: int) -> list[list[Prompt]]:
    """At batch 1 the first `num_b1` prompts, one each; else one batch of the first B (cycling)."""
    if batch_size == 1:
        return [[prompts[i % len(prompts)]] for i in range(num_b1)]
    return [[prompts[i % len(prompts)] for i in range(batch_size)]]


def kv_blocks_needed(config: SpecBenchConfig, prompts: dict[str, list[Prompt]]) -> int:
    """KV blocks of the largest batch: prompt + new tokens + drafts per request, 10% spare."""
    k = config.num_speculative_tokens
    most = 0
    for ps in prompts.values():
        for b in config.batch_sizes:
            for batch in batches_of(ps, b, config.prompts_per_category):
                need = sum(
                    math.ceil((len(p.token_ids) + config.new_tokens + k + 1) / config.block_size)
                    for p in batch
                )
                most = max(most, need)
    return math.ceil(most * 1.1) + 1


# --- the sides ----------------------------------------------------------------------------


@dataclass
class RunResult:
    wall_s: float
    token_ids: list[list[int]]
    tpot_s: list[float | None]
    spec: dict[str, Any] = field(default_factory=dict)  # the engine's counters over the run


class EngineSide:
    """A Tandem `LLM`, with one proposer or none."""

    def __init__(self, config: SpecBenchConfig, method: SpecMethod | None, num_blocks: int) -> None:
        self.label = NO_SPEC if method is None else method.label
        self.llm = LLM(
            config.model,
            dtype=config.dtype,
            device=config.device,
            num_threads=config.threads,
            block_size=config.block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=False,
            max_num_seqs=max(config.batch_sizes),
            speculative=None if method is None else method.speculative,
        )

    def run(self, batch: list[list[int]], new_tokens: int) -> RunResult:
        stats = self.llm.engine.scheduler.spec_stats
        before = counters(stats)
        t0 = time.perf_counter()
        outs = self.llm.generate(batch, SamplingParams(max_tokens=new_tokens, temperature=0.0))
        wall = time.perf_counter() - t0
        return RunResult(
            wall,
            [list(o.token_ids) for o in outs],
            [o.metrics.tpot if o.metrics else None for o in outs],
            counters_since(before, counters(stats)) if self.label != NO_SPEC else {},
        )


def counters(stats: SpecStats) -> dict[str, Any]:
    """The engine's speculation counters now, as JSON."""
    return {
        "drafts": stats.num_drafts,
        "draft_tokens": stats.num_draft_tokens,
        "accepted": stats.num_accepted_tokens,
        "drafted_per_position": list(stats.drafted_per_position),
        "accepted_per_position": list(stats.accepted_per_position),
        "propose_s": stats.propose_seconds,
        "verify_s": stats.verify_seconds,
        "plain_by_cost": stats.num_plain_by_cost,
    }


def counters_since(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What each counter gained from `before` to `after` (per-position lists only grow)."""
    out: dict[str, Any] = {}
    for key, now in after.items():
        if isinstance(now, list):
            out[key] = [x - _at(before[key], i) for i, x in enumerate(now)]
        else:
            out[key] = now - before[key]
    return out


class ReferenceSide:
    """transformers `generate` at batch 1: greedy, prompt lookup, or assisted by a draft model."""

    def __init__(self, label: str, model: Any, device: str, options: dict[str, Any]) -> None:
        self.label = label
        self.model = model
        self.device = torch.device(device)
        self.options = options
        eos = model.config.eos_token_id
        self.pad_id = int(eos[0] if isinstance(eos, list) else eos)

    def run(self, batch: list[list[int]], new_tokens: int) -> RunResult:
        (ids,) = batch
        input_ids = torch.tensor([ids], device=self.device)  # [1, prompt_len]
        t0 = time.perf_counter()
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            pad_token_id=self.pad_id,
            **self.options,
        )
        wall = time.perf_counter() - t0
        tokens = out[0, len(ids) :].tolist()
        return RunResult(wall, [tokens], [None])


def dense_model(name: str, dtype: str, device: str) -> Any:
    """A dense transformers model with the checkpoint's weights (as in `tandem bench engine`)."""
    path = hub.resolve(name)
    return build_reference(path, dict(iter_weights(path)), TORCH_DTYPES[dtype]).to(device)


def reference_sides(
    config: SpecBenchConfig, methods: Sequence[SpecMethod], console: Console
) -> list[ReferenceSide]:
    model = dense_model(config.model, config.dtype, config.device)
    k = config.num_speculative_tokens
    sides = [
        ReferenceSide(HF_GREEDY, model, config.device, {}),
        ReferenceSide(HF_LOOKUP, model, config.device, {"prompt_lookup_num_tokens": k}),
    ]
    for m in methods:
        if m.name == "draft":
            try:
                draft = dense_model(m.speculative["draft_model"], config.dtype, config.device)
            except (ValueError, OSError) as e:
                console.print(f"[yellow]skipping {HF_ASSISTED}:[/yellow] {e}")
                break
            sides.append(
                ReferenceSide(HF_ASSISTED, model, config.device, {"assistant_model": draft})
            )
            break
    return sides


# --- the run ------------------------------------------------------------------------------


def run_spec_bench(
    config: SpecBenchConfig,
    json_out: str | Path | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run the benchmark, print the tables and target checks, return (and write) the report."""
    console = console or Console()
    torch.set_num_threads(config.threads)
    model_path = hub.resolve(config.model)
    prompts = load_prompts(config, load_tokenizer(model_path))
    num_blocks = kv_blocks_needed(config, prompts)
    methods = config.parsed_methods()
    engines, skipped = _load_engines(config, methods, num_blocks, console)
    built = [m for m in methods if m.label not in skipped]
    references: list[ReferenceSide] = []
    if config.references and 1 in config.batch_sizes:
        with quiet_transformers():
            references = reference_sides(config, built, console)
    samples = _measure(config, prompts, engines, references, console)

    rows = summarize(samples, config, [NO_SPEC, *[m.label for m in built]])
    report: dict[str, Any] = {
        "benchmark": "spec",
        "config": asdict(config),
        "method": __doc__,
        "machine": {**machine_info(), "torch_threads": torch.get_num_threads()},
        "model_path": str(model_path),
        "kv_blocks": num_blocks,
        "skipped": skipped,
        "prompts": {
            c: [{"question_id": p.question_id, "n_tokens": len(p.token_ids)} for p in ps]
            for c, ps in prompts.items()
        },
        "samples": samples,
        "summary": rows,
        "targets": check_targets(rows, built),
    }
    print_report(report, console)
    if json_out is not None:
        write_report(report, json_out, write_chart, console)
    return report


def _load_engines(
    config: SpecBenchConfig, methods: Sequence[SpecMethod], num_blocks: int, console: Console
) -> tuple[list[EngineSide], dict[str, str]]:
    """(the engine without speculation, then one per method the engine builds; why each other
    method is skipped)."""
    engines = [EngineSide(config, None, num_blocks)]
    skipped: dict[str, str] = {}
    for m in methods:
        try:
            engines.append(EngineSide(config, m, num_blocks))
        except (ValueError, OSError) as e:  # the proposer's factory refused it
            skipped[m.label] = str(e)
            console.print(f"[yellow]skipping {m.label}:[/yellow] {e}")
    if len(engines) == 1:
        raise BenchError(f"no speculative method could be built: {skipped}")
    return engines, skipped


def _measure(
    config: SpecBenchConfig,
    prompts: dict[str, list[Prompt]],
    engines: Sequence[EngineSide],
    references: Sequence[ReferenceSide],
    console: Console,
) -> list[dict[str, Any]]:
    """The warm-up, then every batch of the plan on every side (references at batch 1 only)."""
    plan = list(_plan(config, prompts))
    samples: list[dict[str, Any]] = []
    with quiet_transformers(), progress_bar(console) as progress:
        units = sum(len(engines) + (len(references) if b == 1 else 0) for _, b, _, _ in plan)
        task = progress.add_task("warm-up", total=units)
        if config.warmup:
            first = plan[0][3][0].token_ids
            for side in sides_of(engines, references):
                side.run([first], _WARMUP_TOKENS)
        for round_, batch_size, index, batch in plan:
            category = batch[0].category
            ids = [p.token_ids for p in batch]
            base: RunResult | None = None
            for side in sides_of(engines, references if batch_size == 1 else []):
                progress.update(
                    task,
                    description=f"round {round_ + 1}: {category}, batch {batch_size}, {side.label}",
                )
                result = side.run(ids, config.new_tokens)
                base = base or result
                samples.append(
                    _sample(round_, category, batch_size, index, side.label, batch, result, base)
                )
                progress.advance(task)
    return samples


def sides_of(
    engines: Sequence[EngineSide], references: Sequence[ReferenceSide]
) -> list[EngineSide | ReferenceSide]:
    """The engines (no speculation first), then the transformers references."""
    return [*engines, *references]


def _plan(
    config: SpecBenchConfig, prompts: dict[str, list[Prompt]]
) -> Iterator[tuple[int, int, int, list[Prompt]]]:
    """(round, batch size, batch index, prompts) in run order."""
    for round_ in range(config.rounds):
        for batch_size in config.batch_sizes:
            for category in config.categories:
                batches = batches_of(prompts[category], batch_size, config.prompts_per_category)
                for index, batch in enumerate(batches):
                    yield round_, batch_size, index, batch


def _sample(
    round_: int,
    category: str,
    batch_size: int,
    index: int,
    label: str,
    batch: list[Prompt],
    result: RunResult,
    base: RunResult,
) -> dict[str, Any]:
    """One run as JSON; `base` is the same batch's run without speculation."""
    differs = [
        first_difference(a, b) for a, b in zip(result.token_ids, base.token_ids, strict=True)
    ]
    output_tokens = sum(len(t) for t in result.token_ids)
    return {
        "round": round_,
        "category": category,
        "batch_size": batch_size,
        "batch": index,
        "side": label,
        "question_ids": [p.question_id for p in batch],
        "n_prompt": [len(p.token_ids) for p in batch],
        "output_tokens": output_tokens,
        "wall_s": result.wall_s,
        "tok_s": output_tokens / result.wall_s,
        "tpot_s": result.tpot_s,
        "first_difference": differs,  # vs no spec, per request; None = same output
        "spec": result.spec,
    }


# --- summaries and targets ----------------------------------------------------------------


def scopes(categories: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Each category alone, then each group with a category in the run, then all of them."""
    out: dict[str, tuple[str, ...]] = {c: (c,) for c in categories}
    for group, members in GROUPS.items():
        present = tuple(c for c in members if c in categories)
        if present and len(categories) > 1:
            out[group] = present
    out[ALL] = tuple(categories)
    return out


def summarize(
    samples: Sequence[dict[str, Any]], config: SpecBenchConfig, engine_labels: Sequence[str]
) -> list[dict[str, Any]]:
    """One row per (scope, batch size, side) with its tok/s, ratios and acceptance."""
    runs: dict[tuple[str, int, int, int], dict[str, dict[str, Any]]] = defaultdict(dict)
    for s in samples:
        runs[s["category"], s["batch_size"], s["round"], s["batch"]][s["side"]] = s
    rows = []
    for scope, members in scopes(config.categories).items():
        for batch_size in config.batch_sizes:
            keyed = [r for (c, b, _, _), r in runs.items() if c in members and b == batch_size]
            sides = [*engine_labels, *(_reference_labels(keyed) if batch_size == 1 else [])]
            tok_s = {side: _tok_s([r[side] for r in keyed if side in r]) for side in sides}
            for side in sides:
                pairs = [(r[side], r[NO_SPEC]) for r in keyed if side in r]
                rows.append(_row(scope, batch_size, side, pairs, tok_s))
    return rows


def _reference_labels(keyed: Sequence[dict[str, dict[str, Any]]]) -> list[str]:
    return [
        label for label in (HF_GREEDY, HF_LOOKUP, HF_ASSISTED) if any(label in r for r in keyed)
    ]


def _tok_s(samples: Sequence[dict[str, Any]]) -> float | None:
    wall = sum(s["wall_s"] for s in samples)
    return sum(s["output_tokens"] for s in samples) / wall if wall > 0 else None


def _row(
    scope: str,
    batch_size: int,
    side: str,
    pairs: Sequence[tuple[dict[str, Any], dict[str, Any]]],
    tok_s: dict[str, float | None],
) -> dict[str, Any]:
    own, base = tok_s[side], tok_s[NO_SPEC]
    requests = sum(len(s["first_difference"]) for s, _ in pairs)
    speedups = [
        b / a for s, n in pairs for a, b in zip(s["tpot_s"], n["tpot_s"], strict=True) if a and b
    ]
    row: dict[str, Any] = {
        "scope": scope,
        "batch_size": batch_size,
        "side": side,
        "runs": len(pairs),
        "requests": requests,
        "output_tokens": sum(s["output_tokens"] for s, _ in pairs),
        "tok_s": own,
        "no_spec_tok_s": base,
        "vs_no_spec": own / base if own and base else None,
        "vs_no_spec_per_run": stats([s["tok_s"] / n["tok_s"] for s, n in pairs]),
        "decode_speedup": statistics.median(speedups) if speedups else None,
        "same_output": sum(d is None for s, _ in pairs for d in s["first_difference"]),
    }
    for label, key in ((HF_LOOKUP, "vs_hf_lookup"), (HF_GREEDY, "vs_hf_greedy")):
        ref = tok_s.get(label)
        row[key] = own / ref if own and ref else None
    if pairs and pairs[0][0]["spec"]:
        row["acceptance"] = acceptance([s["spec"] for s, _ in pairs])
    return row


def acceptance(counters: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Summed speculation counters with BENCHMARKS.md's rates."""
    drafts = sum(c["drafts"] for c in counters)
    draft_tokens = sum(c["draft_tokens"] for c in counters)
    accepted = sum(c["accepted"] for c in counters)
    width = max((len(c["drafted_per_position"]) for c in counters), default=0)
    drafted = [sum(_at(c["drafted_per_position"], i) for c in counters) for i in range(width)]
    kept = [sum(_at(c["accepted_per_position"], i) for c in counters) for i in range(width)]
    return {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "per_position": [a / d if d else None for a, d in zip(kept, drafted, strict=True)],
        "propose_s": sum(c["propose_s"] for c in counters),
        "verify_s": sum(c["verify_s"] for c in counters),
        "plain_by_cost": sum(c["plain_by_cost"] for c in counters),
    }


def _at(values: Sequence[int], i: int) -> int:
    return values[i] if i < len(values) else 0


def check_targets(
    rows: Sequence[dict[str, Any]], methods: Sequence[SpecMethod]
) -> list[dict[str, Any]]:
    """The BENCHMARKS.md targets this run covers, each with its measured value."""
    by_key = {(r["scope"], r["batch_size"], r["side"]): r for r in rows}
    targets = []
    for m in methods:
        grounded = by_key.get(("input-grounded", 1, m.label))
        if m.name == "ngram" and grounded is not None:
            name = f"{m.label}, batch 1, input-grounded"
            if grounded["vs_no_spec"] is not None:
                targets.append(
                    target_result(
                        f"{name}: / no spec", grounded["vs_no_spec"], TARGET_NGRAM_B1_GROUNDED
                    )
                )
            if grounded["vs_hf_lookup"] is not None:
                targets.append(
                    target_result(
                        f"{name}: / transformers prompt lookup",
                        grounded["vs_hf_lookup"],
                        TARGET_NGRAM_B1_GROUNDED,
                    )
                )
        large = by_key.get((ALL, LARGE_BATCH, m.label))
        if large is not None and large["vs_no_spec"] is not None:
            targets.append(
                target_result(
                    f"{m.label}, batch {LARGE_BATCH}, all prompts: / no spec",
                    large["vs_no_spec"],
                    TARGET_LARGE_BATCH,
                )
            )
    chat = [
        by_key[key]
        for m in methods
        if m.model_based
        and (key := ("chat", 1, m.label)) in by_key
        and by_key[key]["vs_no_spec"] is not None
    ]
    if chat:
        best = max(chat, key=lambda r: r["vs_no_spec"])
        target = target_result(
            f"best model-based ({best['side']}), batch 1, chat: / no spec, same output",
            best["vs_no_spec"],
            TARGET_MODEL_B1_CHAT,
        )
        target["pass"] = target["pass"] and best["same_output"] == best["requests"]
        targets.append(target)
    return targets
