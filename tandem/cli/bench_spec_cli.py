"""The `tandem bench spec` command (registered by tandem.cli.bench_cli); tandem.bench.spec is
imported only when it runs, so `tandem --help` stays free of torch and transformers imports."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console

from tandem.bench.spec_config import SpecBenchConfig
from tandem.cli.bench_support import JsonOutOpt, names, run_bench_command
from tandem.config import DEFAULT_MODEL
from tandem.data import SPECBENCH_CATEGORIES

# The tables need ~130 columns; without a terminal (a log file) rich would cut them at 80.
console = Console() if sys.stdout.isatty() else Console(width=160)


def bench_spec(
    model: Annotated[str, typer.Option(help="Catalogue name, HF directory or .gguf path.")] = (
        DEFAULT_MODEL
    ),
    methods: Annotated[
        str,
        typer.Option(
            help="Comma-separated proposers: ngram, layerskip:N, draft:MODEL, medusa:PATH, "
            "eagle:PATH (one the engine cannot build is skipped, with the reason)."
        ),
    ] = "ngram",
    num_spec_tokens: Annotated[int, typer.Option(help="Draft tokens per step at most (k).")] = 5,
    categories: Annotated[
        str, typer.Option(help="Comma-separated Spec-Bench categories; '' = all 13.")
    ] = "",
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "1,4,16,32",
    prompts_per_category: Annotated[
        int, typer.Option(help="Batch-1 prompts per category (one at a time).")
    ] = 3,
    new_tokens: Annotated[int, typer.Option(help="New tokens at most (EOS honoured).")] = 128,
    rounds: Annotated[int, typer.Option(help="Repetitions of every run.")] = 1,
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16 | float16")] = "float32",
    device: Annotated[str, typer.Option(help="cpu | cuda | cuda:N")] = "cpu",
    threads: int = 2,
    references: Annotated[
        bool, typer.Option(help="transformers greedy / prompt lookup / assisted at batch 1.")
    ] = True,
    seed: Annotated[int, typer.Option(help="Seed of the prompt order.")] = 0,
    quick: Annotated[
        bool,
        typer.Option(
            "--quick",
            help="A pipeline check: one prompt per category, batch 1 and 4, 16 tokens.",
        ),
    ] = False,
    json_out: JsonOutOpt = None,
) -> None:
    """Output tok/s with and without speculative decoding per proposer, category and batch size,
    with acceptance, against transformers prompt lookup and assisted generation."""
    from tandem.bench.spec import run_spec_bench

    run_bench_command(
        lambda: SpecBenchConfig(
            model=model,
            methods=names(methods),
            num_speculative_tokens=num_spec_tokens,
            categories=names(categories) or SPECBENCH_CATEGORIES,
            batch_sizes=tuple(int(b) for b in names(batch_sizes)),
            prompts_per_category=prompts_per_category,
            new_tokens=new_tokens,
            rounds=rounds,
            dtype=dtype,
            device=device,
            threads=threads,
            references=references,
            seed=seed,
        ),
        quick,
        run_spec_bench,
        json_out,
        console,
    )
