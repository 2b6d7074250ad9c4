"""`tandem bench engine --tp 1,3`: decode speed and the collectives' share of a step per
tensor-parallel size.

Method
------
Per dtype and size N (`--tp 1,3`): one engine of N ranks (`tensor_parallel_size=N`, each rank
`threads // N` torch threads, at least one), one warm-up request, then `rounds` rounds, each a
batch-1 greedy request of a fixed prompt decoding `new_tokens` tokens (EOS ignored). Measured
from the step after prefill to the last token: decode tok/s (tokens / wall time), and rank 0's
time inside collectives (`TPGroup.wait_seconds`: the broadcasts of the step message, the
all-reduces, the gather of the logits), as a share of that wall time. Rank 0 waits there also for
the other ranks' compute, so on a machine with fewer cores than ranks the share counts their
compute too: a CPU run measures the overhead of the collectives, not a speedup (two cores cannot
run three ranks at once). Figures: median over rounds, min-max beside. With `quantization` the
ranks hold their shards of the int8 / int4 model (quantized whole, then split).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from tandem import hub
from tandem.bench.common import BenchError, write_report
from tandem.bench.engine_probes import greedy_params
from tandem.bench.machine import machine_info, machine_line
from tandem.bench.report import fmt_stats, median_bar, pyplot, save_chart, stats
from tandem.config import EngineConfig
from tandem.engine.engine_core import EngineCore
from tandem.engine.models.loader import load_tokenizer
from tandem.engine.tp.group import TPGroup
from tandem.engine.tp.ranks import TPModelRunner

PROMPT = "Explain in a few sentences how a paged KV cache works."


@dataclass(frozen=True)
class TPBenchConfig:
    model: str
    sizes: tuple[int, ...] = (1, 3)
    dtypes: tuple[str, ...] = ("float32",)
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    device: str = "cpu"  # "cuda": rank r on GPU r (NCCL)
    threads: int = 2
    new_tokens: int = 64
    rounds: int = 3

    def __post_init__(self) -> None:
        if not self.sizes or min(self.sizes) < 1:
            raise ValueError(f"tp sizes must be >= 1, got {self.sizes}")
        if not self.dtypes:
            raise ValueError("dtypes is empty")
        if self.new_tokens < 2 or self.rounds < 1 or self.threads < 1:
            raise ValueError("new_tokens must be >= 2, rounds and threads >= 1")

    def quick(self) -> TPBenchConfig:
        return replace(self, new_tokens=8, rounds=1)


def run_tp_bench(config: TPBenchConfig, json_out: str | None, console: Console) -> dict[str, Any]:
    path = hub.resolve(config.model)
    results: dict[str, dict[str, Any]] = {}  # dtype -> TP size -> figures
    for dtype in config.dtypes:
        for size in config.sizes:
            console.print(f"[dim]{dtype} TP {size}: starting {size} rank(s)[/dim]")
            results.setdefault(dtype, {})[str(size)] = _bench_size(config, path, dtype, size)
    report = {"config": asdict(config), "machine": machine_info(), "results": results}
    console.print(_table(config, results))
    console.print(f"[dim]{machine_line(report['machine'])}[/dim]")
    if json_out is not None:
        write_report(report, json_out, write_chart, console)
    return report


def _bench_size(config: TPBenchConfig, path: Path, dtype: str, size: int) -> dict[str, Any]:
    engine = EngineCore(
        EngineConfig.create(
            str(path),
            dtype=dtype,
            quantization=config.quantization,
            kv_cache_dtype=config.kv_cache_dtype,
            device=config.device,
            tensor_parallel_size=size,
            num_threads=max(1, config.threads // size),
        )
    )
    try:
        runner = engine.runner
        group = runner.group if isinstance(runner, TPModelRunner) else None
        ids = list(load_tokenizer(path)(PROMPT)["input_ids"])
        _decode(engine, ids, 4)  # warm-up
        samples = []
        for _ in range(config.rounds):
            samples.append(_decode(engine, ids, config.new_tokens, group))
    finally:
        engine.close()
    return {
        "samples": samples,
        "tok_s": stats([s["tok_s"] for s in samples]),
        "collective_share": stats([s["collective_share"] for s in samples]),
    }


def _decode(
    engine: EngineCore, ids: list[int], new_tokens: int, group: TPGroup | None = None
) -> dict[str, float]:
    req = engine.add_request(f"r{time.monotonic_ns()}", ids, greedy_params(new_tokens))
    while not req.output_token_ids:  # prefill, not measured
        engine.step()
    waited = group.wait_seconds if group is not None else 0.0
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    seconds = time.perf_counter() - start
    if len(req.output_token_ids) != new_tokens:
        raise BenchError(f"got {len(req.output_token_ids)} tokens, asked for {new_tokens}")
    in_collectives = (group.wait_seconds - waited) if group is not None else 0.0
    return {"tok_s": (new_tokens - 1) / seconds, "collective_share": in_collectives / seconds}


def _table(config: TPBenchConfig, results: dict[str, Any]) -> Table:
    weights = f", {config.quantization} weights" if config.quantization else ""
    table = Table(
        title=f"{config.model}{weights}, batch 1, {config.new_tokens} tokens, "
        f"{config.threads} threads shared by the ranks",
        caption="With fewer cores than ranks this is the overhead of tensor parallelism, "
        "not a speedup.",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    table.add_column("dtype")
    table.add_column("TP", justify="right")
    table.add_column("decode tok/s", justify="right")
    table.add_column("in collectives (rank 0)", justify="right")
    for dtype, sizes in results.items():
        for size, res in sizes.items():
            share = res["collective_share"]
            table.add_row(dtype, size, fmt_stats(res["tok_s"]), f"{share['median']:.0%}")
    return table


def write_chart(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    results = report["results"].items()
    runs = [(f"{d} TP {n}", res) for d, sizes in results for n, res in sizes.items()]
    for i, (label, res) in enumerate(runs):
        median_bar(ax, i, res["tok_s"], 0.6, label=label)
    ax.set_xticks(range(len(runs)), [label for label, _ in runs])
    ax.set_ylabel("decode tok/s (batch 1)")
    config = report["config"]
    save_chart(fig, f"{config['model']}: {config['threads']} threads", path)
