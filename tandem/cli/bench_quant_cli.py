"""The `tandem bench quant` command (registered by tandem.cli.bench_cli); tandem.bench.quant is
imported only when it runs, so `tandem --help` stays free of torch imports."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console

from tandem.bench.quant_config import QuantBenchConfig
from tandem.cli.bench_support import JsonOutOpt, names, run_bench_command
from tandem.config import DEFAULT_MODEL

# The matrix needs ~140 columns; without a terminal (a log file) rich would cut it at 80.
console = Console() if sys.stdout.isatty() else Console(width=160)


def bench_quant(
    model: Annotated[str, typer.Option(help="Catalogue name, HF directory or .gguf path.")] = (
        DEFAULT_MODEL
    ),
    formats: Annotated[str, typer.Option(help="Comma-separated: fp32, bf16, int8, int4.")] = (
        "fp32,bf16,int8,int4"
    ),
    group_size: Annotated[int, typer.Option(help="int4: input channels per group.")] = 32,
    kv_cache_dtype: Annotated[
        str, typer.Option(help="KV cache of every Tandem engine: auto (bfloat16), int8, fp8.")
    ] = "auto",
    num_spec_tokens: Annotated[int, typer.Option(help="n-gram draft tokens per step (k).")] = 5,
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "1,16",
    prompts: Annotated[int, typer.Option(help="Batch-1 prompts per round, one at a time.")] = 3,
    new_tokens: Annotated[int, typer.Option(help="Output tokens of every request.")] = 128,
    rounds: Annotated[int, typer.Option(help="Repetitions of every run.")] = 3,
    threads: int = 2,
    device: Annotated[str, typer.Option(help="cpu | cuda | cuda:N")] = "cpu",
    llama_cpp: Annotated[
        bool, typer.Option(help="llama.cpp on the same GGUF at batch 1 (the bench-ref extra).")
    ] = True,
    seed: Annotated[int, typer.Option(help="Seed of the prompt order.")] = 0,
    quick: Annotated[
        bool,
        typer.Option("--quick", help="A pipeline check: one prompt, batch 1 and 2, 8 tokens."),
    ] = False,
    json_out: JsonOutOpt = None,
) -> None:
    """Weight formats x n-gram speculation x batch size in one run, with llama.cpp on the same
    GGUF and each format's kernel floor, against the quantization targets."""
    from tandem.bench.quant import run_quant_bench

    run_bench_command(
        lambda: QuantBenchConfig(
            model=model,
            formats=names(formats),
            group_size=group_size,
            kv_cache_dtype=kv_cache_dtype,
            num_speculative_tokens=num_spec_tokens,
            batch_sizes=tuple(int(b) for b in names(batch_sizes)),
            prompts=prompts,
            new_tokens=new_tokens,
            rounds=rounds,
            threads=threads,
            device=device,
            llama_cpp=llama_cpp,
            seed=seed,
        ),
        quick,
        run_quant_bench,
        json_out,
        console,
    )
