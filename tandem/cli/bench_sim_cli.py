"""CLI of the simulated engine's benchmarks: `tandem bench calibrate | router | sim-cluster`."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from typing import Annotated

import typer
from rich.console import Console

from tandem.cli.bench_support import names
from tandem.config import DEFAULT_MODEL

console = Console()


def bench_calibrate(
    model: Annotated[str, typer.Option(help="Model to measure.")] = DEFAULT_MODEL,
    out: Annotated[str, typer.Option(help="Profile JSON to write.")] = "sim-profile.json",
    dtype: str = "float32",
    threads: int = 2,
    transfer_gbytes_per_s: Annotated[
        float, typer.Option(help="Assumed KV transfer bandwidth, GB/s (not measured).")
    ] = 10.0,
    transfer_latency_ms: Annotated[float, typer.Option(help="Assumed per-transfer latency.")] = 0.5,
    quick: Annotated[bool, typer.Option("--quick", help="Short prompts and contexts.")] = False,
) -> None:
    """Measure the real engine (prefill time per token, decode step time vs batch and context,
    KV bytes per token) and write the sim engine's profile."""
    from tandem.bench.calibrate import CalibrateConfig, calibrate, fit_error

    config = CalibrateConfig(
        model=model,
        dtype=dtype,
        threads=threads,
        transfer_bytes_per_s=transfer_gbytes_per_s * 1e9,
        transfer_latency_s=transfer_latency_ms / 1e3,
    )
    if quick:
        config = replace(
            config, prefill_lengths=(16, 64), batches=(1, 4), contexts=(16, 64), decode_steps=3
        )
    with console.status("measuring the real engine..."):
        profile = calibrate(config, console)
    profile.save(out)
    console.print(
        f"step = {profile.step_overhead_s * 1e3:.2f} ms + {profile.prefill_s_per_token * 1e3:.3f}"
        f" ms/prefill token + {profile.decode_s_per_seq * 1e3:.2f} ms/decode seq + "
        f"{profile.decode_s_per_context_token * 1e6:.3f} us/context token; KV "
        f"{profile.kv_bytes_per_token} B/token; worst fit error "
        f"{fit_error(profile, profile.samples):.0%}"
    )
    console.print(f"wrote {out}")


def bench_router(
    model: Annotated[str, typer.Option(help="Tokenizer/config of the served model.")] = (
        DEFAULT_MODEL
    ),
    requests: Annotated[int, typer.Option(help="Sequential requests per path.")] = 300,
    concurrency: Annotated[str, typer.Option(help="Comma-separated in-flight counts.")] = "16,64",
    duration_s: float = 5.0,
    max_tokens: int = 1,
) -> None:
    """Router overhead on a zero-cost sim cluster: added p50 latency vs calling the decode worker
    directly, and the request rate the router sustains."""
    from tandem.bench.router_bench import RouterBenchConfig, run_router_bench

    run_router_bench(
        RouterBenchConfig(
            model=model,
            latency_requests=requests,
            concurrency=tuple(int(c) for c in names(concurrency)),
            duration_s=duration_s,
            max_tokens=max_tokens,
        ),
        console,
    )


def bench_sim_cluster(
    ctx: typer.Context,
    model: Annotated[str, typer.Option(help="Tokenizer/config of the served model.")] = (
        DEFAULT_MODEL
    ),
    profile: Annotated[str | None, typer.Option(help="Sim profile JSON; none: zero cost.")] = None,
    prefill: int = 64,
    decode: int = 64,
    procs: Annotated[int, typer.Option(help="Worker host processes.")] = 2,
    local_prefill_tokens: int = 32,
    max_num_seqs: int = 64,
) -> None:
    """Start a simulated cluster (sim workers, real registry and router). With extra arguments,
    run `tandem bench serve --grpc <router> --url <router> <extra arguments>` against it, then
    stop; without, serve until Ctrl-C."""
    from tandem.bench.sim_cluster import SimCluster

    cluster = SimCluster(
        model,
        profile,
        prefill,
        decode,
        procs,
        local_prefill_tokens=local_prefill_tokens,
        max_num_seqs=max_num_seqs,
    )
    with console.status(f"starting {prefill} prefill + {decode} decode sim workers..."):
        cluster.start()
    console.print(f"[green]ready[/green]  HTTP {cluster.http_url}  gRPC {cluster.grpc_target}")
    rc = 0
    try:
        if ctx.args:
            cmd = [sys.executable, "-m", "tandem.cli", "bench", "serve", "--grpc"]
            cmd += [cluster.grpc_target, "--url", cluster.http_url, *ctx.args]
            rc = subprocess.call(cmd)
        else:
            assert cluster.router is not None
            cluster.router.wait()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
    raise typer.Exit(rc)


def register_sim_commands(app: typer.Typer) -> None:
    app.command("calibrate")(bench_calibrate)
    app.command("router")(bench_router)
    app.command(
        "sim-cluster",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )(bench_sim_cluster)
