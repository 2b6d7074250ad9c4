"""The `tandem bench experiment pd|spec` command (registered by tandem.cli.bench_cli).

Kept apart from tandem.bench.experiment, which is imported only when the command runs: `tandem
--help` stays free of httpx, grpc and torch imports.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from tandem.bench.common import BenchError
from tandem.cli.bench_support import names
from tandem.config import DEFAULT_MODEL

# The tables need ~90 columns; without a terminal (a log file) rich would cut them at 80.
console = Console() if sys.stdout.isatty() else Console(width=100)
EXPERIMENTS = ("pd", "spec")


def _pd_config(model: str, quick: bool, **kw: Any) -> Any:
    from tandem.bench.experiment import PdConfig

    config = PdConfig(model=model, **kw)
    return config.quick() if quick else config


def _spec_config(model: str, quick: bool, concurrencies: str, **kw: Any) -> Any:
    from tandem.bench.experiment import SpecExperimentConfig

    config = SpecExperimentConfig(
        model=model, concurrencies=tuple(int(c) for c in names(concurrencies)), **kw
    )
    return config.quick() if quick else config


def bench_experiment(
    experiment: Annotated[str, typer.Argument(help="pd (prefill/decode interference) | spec")],
    model: Annotated[str, typer.Option(help="Catalogue name, HF directory or .gguf path.")] = (
        DEFAULT_MODEL
    ),
    quick: Annotated[
        bool, typer.Option("--quick", help="A pipeline check with tiny sizes (not a measurement).")
    ] = False,
    out: Annotated[
        str | None, typer.Option(help="Write results.json, requests.jsonl, inputs.jsonl, PNG.")
    ] = None,
    cores: Annotated[
        int, typer.Option(help="torch threads per deployment (1P1D: split between P and D).")
    ] = 2,
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16 | float16")] = "float32",
    kv_memory_gib: Annotated[float, typer.Option(help="KV cache per worker, GiB.")] = 1.0,
    rounds: Annotated[int, typer.Option(help="Repetitions of every pass / point.")] = 1,
    seed: int = 0,
    num_short: Annotated[int, typer.Option(help="pd: short requests per pass.")] = 32,
    num_long: Annotated[int, typer.Option(help="pd: long prompts mixed in.")] = 4,
    concurrency: Annotated[int, typer.Option(help="pd: short requests in flight.")] = 4,
    chunk_tokens: Annotated[
        int, typer.Option(help="pd: step budget of the chunked colocated worker.")
    ] = 256,
    local_prefill_tokens: Annotated[
        int, typer.Option(help="pd, 1P1D long-on-P: prompts up to this long stay on D.")
    ] = 256,
    concurrencies: Annotated[
        str, typer.Option(help="spec: comma-separated concurrencies.")
    ] = "1,4,16",
    output_len: Annotated[int, typer.Option(help="spec: max new tokens (EOS honoured).")] = 64,
) -> None:
    """Side-by-side experiments on fresh local clusters: `pd` runs one interference workload
    (short requests + long prompts) on colocated (with and without chunked prefill) and 1P1D
    deployments; `spec` runs n-gram speculative decoding on vs off across concurrencies."""
    from tandem.bench.experiment import run_pd, run_spec

    if experiment not in EXPERIMENTS:
        raise typer.BadParameter(
            f"must be one of {', '.join(EXPERIMENTS)}", param_hint="EXPERIMENT"
        )
    common = {
        "cores": cores, "dtype": dtype, "kv_memory_gib": kv_memory_gib, "rounds": rounds,
        "seed": seed,
    }  # fmt: skip
    try:
        if experiment == "pd":
            config = _pd_config(
                model, quick, num_short=num_short, num_long=num_long, concurrency=concurrency,
                chunk_tokens=chunk_tokens, local_prefill_tokens=local_prefill_tokens, **common,
            )  # fmt: skip
        else:
            config = _spec_config(model, quick, concurrencies, output_len=output_len, **common)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    run = run_pd if experiment == "pd" else run_spec
    try:
        run(config, Path(out) if out else None, console)
    except BenchError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1) from None
