"""`tandem bench ...`: every benchmark's command; each imports its benchmark when it runs."""

from __future__ import annotations

from typing import Annotated

import typer

from tandem.cli.bench_experiment_cli import bench_experiment
from tandem.cli.bench_quant_cli import bench_quant
from tandem.cli.bench_serve_cli import bench_serve, bench_sla
from tandem.cli.bench_sim_cli import register_sim_commands
from tandem.cli.bench_spec_cli import bench_spec
from tandem.cli.bench_support import JsonOutOpt, names, run_bench_command
from tandem.cli.options import DtypeOpt, KVCacheDtypeOpt, ModelOpt, QuantOpt, console
from tandem.config import DEFAULT_MODEL

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (ratios measured side by side).")
bench_app.command("serve")(bench_serve)
bench_app.command("sla")(bench_sla)
register_sim_commands(bench_app)  # calibrate, router, sim-cluster
bench_app.command("experiment")(bench_experiment)
bench_app.command("spec")(bench_spec)
bench_app.command("quant")(bench_quant)


@bench_app.command("grammar")
def bench_grammar(
    model: ModelOpt = DEFAULT_MODEL,
    rounds: Annotated[int, typer.Option(help="Passes over each schema's answer.")] = 20,
    json_out: JsonOutOpt = None,
) -> None:
    """Structured outputs: per-token mask cost of llguidance (and xgrammar, if installed)."""
    from tandem.bench.grammar_bench import run_grammar_bench

    run_grammar_bench(model, rounds, json_out, console)


@bench_app.command("engine")
def bench_engine(
    ctx: typer.Context,
    model: ModelOpt = DEFAULT_MODEL,
    dtypes: Annotated[str, typer.Option(help="Comma-separated dtypes.")] = "float32,bfloat16",
    quantization: QuantOpt = None,
    kv_cache_dtype: KVCacheDtypeOpt = "auto",
    threads: int = 2,
    new_tokens: int = 128,
    batch: int = 16,
    rounds: int = 3,
    prompts_per_round: Annotated[
        int, typer.Option(help="Batch-1 prompts per round (the same ones every round).")
    ] = 3,
    seed: Annotated[int, typer.Option(help="Seed of the prompt selection.")] = 0,
    tp: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated tensor-parallel sizes: instead of the comparison, batch-1 "
            "decode tok/s and the collectives' share of a step at each (on a CPU with fewer "
            "cores than ranks: the overhead, not a speedup)."
        ),
    ] = None,
    device: Annotated[str, typer.Option(help="With --tp: cpu | cuda (rank r on GPU r).")] = "cpu",
    quick: Annotated[
        bool,
        typer.Option(
            "--quick", help="A one-minute pipeline check with tiny sizes (overrides the sizes)."
        ),
    ] = False,
    json_out: JsonOutOpt = None,
) -> None:
    """Engine vs transformers `generate` side by side, with the kernel floor and bandwidth limit;
    with --tp, decode speed per tensor-parallel size."""
    if tp is not None:
        _bench_tensor_parallel(ctx, tp, device, quick, json_out)
        return
    if device != "cpu":
        raise typer.BadParameter("--device applies with --tp only")
    from tandem.bench.engine_bench import EngineBenchConfig, run_engine_bench

    run_bench_command(
        lambda: EngineBenchConfig(
            model=model,
            dtypes=names(dtypes),
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            threads=threads,
            new_tokens=new_tokens,
            batch=batch,
            rounds=rounds,
            prompts_per_round=prompts_per_round,
            seed=seed,
        ),
        quick,
        run_engine_bench,
        json_out,
        console,
    )


def _bench_tensor_parallel(
    ctx: typer.Context, tp: str, device: str, quick: bool, json_out: str | None
) -> None:
    """`bench engine --tp`: tandem/bench/tp_bench.py with the engine options that apply."""
    from tandem.bench.tp_bench import TPBenchConfig, run_tp_bench

    sources = {
        name: ctx.get_parameter_source(name) for name in ("batch", "prompts_per_round", "seed")
    }
    given = [  # typer's own click: the enum by name
        f"--{name.replace('_', '-')}"
        for name, source in sources.items()
        if source is not None and source.name != "DEFAULT"
    ]
    if given:
        raise typer.BadParameter(
            f"{', '.join(given)}: the comparison with transformers only; --tp measures batch 1"
        )
    p = ctx.params
    run_bench_command(
        lambda: TPBenchConfig(
            model=p["model"],
            sizes=tuple(int(n) for n in names(tp)),
            dtypes=names(p["dtypes"]),
            quantization=p["quantization"],
            kv_cache_dtype=p["kv_cache_dtype"],
            device=device,
            threads=p["threads"],
            new_tokens=p["new_tokens"],
            rounds=p["rounds"],
        ),
        quick,
        run_tp_bench,
        json_out,
        console,
    )


def tp_pair(text: str) -> tuple[int, int]:
    """ "3:1" -> (3, 1)."""
    prefill, sep, decode = text.partition(":")
    if not sep:
        raise ValueError(f"exposed_tp: {text!r} is not PREFILL:DECODE")
    return int(prefill), int(decode)


@bench_app.command("transfer")
def bench_transfer(
    model: ModelOpt = DEFAULT_MODEL,
    device: Annotated[
        str, typer.Option(help="cpu | cuda | cuda:N (CUDA: the pair runs NCCL, shm is CUDA IPC).")
    ] = "cpu",
    dtype: DtypeOpt = "float32",
    channels: Annotated[str, typer.Option(help="Comma-separated: pair, grpc, shm.")] = (
        "pair,grpc,shm"
    ),
    tokens: Annotated[
        str, typer.Option(help="Comma-separated prompt lengths of the throughput part.")
    ] = "512,2048,8192",
    reps: int = 5,
    exposed_channels: Annotated[
        str, typer.Option(help="Channels of the exposed-time part (real workers).")
    ] = "pair,grpc,shm",
    exposed_tokens: Annotated[
        str,
        typer.Option(help="Comma-separated prompt lengths of the exposed-time part; '' skips it."),
    ] = "2048",
    exposed_reps: int = 3,
    exposed_tp: Annotated[
        str,
        typer.Option(
            help="Comma-separated PREFILL:DECODE tensor-parallel sizes of the exposed-time part's "
            "workers."
        ),
    ] = "1:1,3:1,1:3",
    decode_tokens: Annotated[
        int, typer.Option(help="Tokens decoded after admission; their TPOT is the decode step.")
    ] = 16,
    threads: int = 2,
    seed: int = 0,
    quick: Annotated[
        bool,
        typer.Option(
            "--quick", help="A pipeline check: 512 tokens, one round (overrides the sizes)."
        ),
    ] = False,
    json_out: JsonOutOpt = None,
) -> None:
    """KV transfer: each channel's GB/s against raw TCP / memcpy, and the exposed transfer time
    with and without layer-wise streaming."""
    from tandem.bench.transfer import TransferBenchConfig, run_transfer_bench

    run_bench_command(
        lambda: TransferBenchConfig(
            model=model,
            device=device,
            dtype=dtype,
            channels=names(channels),
            prompt_tokens=tuple(int(n) for n in names(tokens)),
            reps=reps,
            exposed_channels=names(exposed_channels),
            exposed_tokens=tuple(int(n) for n in names(exposed_tokens)),
            exposed_reps=exposed_reps,
            exposed_tp=tuple(tp_pair(pair) for pair in names(exposed_tp)),
            decode_tokens=decode_tokens,
            threads=threads,
            seed=seed,
        ),
        quick,
        run_transfer_bench,
        json_out,
        console,
    )


@bench_app.command(
    "gpu",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def bench_gpu(ctx: typer.Context) -> None:
    """The engine at GPU speed on one CUDA GPU (kernels, 8B-shaped decode against the HBM
    roofline and transformers, CUDA graphs); `tandem bench gpu --help` for its options."""
    from tandem.bench.gpu import main

    raise typer.Exit(main(ctx.args))


@bench_app.command("soak")
def bench_soak(
    model: ModelOpt = DEFAULT_MODEL,
    duration: Annotated[float, typer.Option(help="Seconds of load (faults included).")] = 1800.0,
    seed: Annotated[int, typer.Option(help="Seeds the fault schedule, victims and load.")] = 0,
    prefill: Annotated[int, typer.Option(help="Prefill workers.")] = 2,
    decode: Annotated[int, typer.Option(help="Decode workers (2 or more: streams migrate).")] = 2,
    clients: Annotated[int, typer.Option(help="Client threads, back to back.")] = 3,
    steady: Annotated[float, typer.Option(help="Seconds before the first fault.")] = 60.0,
    fault_interval: Annotated[float, typer.Option(help="Seconds between faults.")] = 90.0,
    long_share: Annotated[
        float, typer.Option(help="Share of requests with a long prompt (~400 SmolLM2 tokens).")
    ] = 0.15,
    recovery_window: Annotated[
        float, typer.Option(help="Seconds after a fault's replacement is ready: its recovery.")
    ] = 10.0,
    quick: Annotated[bool, typer.Option("--quick", help="One minute, a fault a kind.")] = False,
    json_out: JsonOutOpt = None,
) -> None:
    """A local --no-ray cluster under mixed streaming load while a seeded schedule SIGKILLs its
    prefill and decode worker processes and its embedded Redis (restarted by their
    supervisors): requests by outcome, p99 TTFT/TPOT per phase (steady, fault, recovery), each
    fault's recovery times and leak check."""
    from tandem.bench.soak import SoakConfig, run_soak

    run_bench_command(
        lambda: SoakConfig(
            model=model, duration_s=duration, seed=seed, num_prefill=prefill, num_decode=decode,
            clients=clients, steady_s=steady, fault_interval_s=fault_interval,
            recovery_window_s=recovery_window, long_share=long_share,
        ),
        quick,
        run_soak,
        json_out,
        console,
    )  # fmt: skip
