"""The `tandem bench serve` and `tandem bench sla` commands (registered by tandem.cli.bench_cli).

Kept apart from tandem.bench.serve, which is imported only when a command runs: `tandem --help`
stays free of httpx, grpc and torch imports (the config, workload and error modules it imports
here are light). The two commands share their options.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console

from tandem.bench.common import BenchError
from tandem.bench.serve_config import ServeConfig, parse_list, sweep_points
from tandem.bench.serving_metrics import SLO
from tandem.bench.workloads import WorkloadConfig, WorkloadError

console = Console()

Url = Annotated[str, typer.Option(help="The router's HTTP API (also scraped for /metrics).")]
Grpc = Annotated[
    str | None, typer.Option(help="Send over gRPC tandem.v1.Tandem at this host:port instead.")
]
Admin = Annotated[
    str | None,
    typer.Option(help="Admin gRPC host:port for ListWorkers (default: --grpc; else HTTP)."),
]
AdminToken = Annotated[str | None, typer.Option(help="Admin token.")]
Model = Annotated[str, typer.Option(help="The requests' model field ('' = the cluster's).")]
Workload = Annotated[
    str,
    typer.Option(
        help="specbench[:cat,...] | random | shared-prefix | interference | json-schema | "
        "trace:PATH.jsonl"
    ),
]
NumRequests = Annotated[
    int | None,
    typer.Option(help="Requests per point (default: the pool); pool size of random workloads."),
]
Duration = Annotated[float | None, typer.Option(help="Seconds per point (stops sending).")]
Length = Annotated[str, typer.Option(help="N | uniform(lo,hi) | normal(mean,std,min,max)")]
Temperature = Annotated[float, typer.Option(help="0 = greedy.")]
Concurrency = Annotated[
    int | None, typer.Option(help="Closed loop at this concurrency; with --rate: a cap.")
]
Rate = Annotated[float | None, typer.Option(help="Open loop: requests/s.")]
Burstiness = Annotated[float, typer.Option(help="Gamma shape of the gaps; 1 = Poisson.")]
RampUp = Annotated[float, typer.Option(help="Seconds to ramp the rate / open the slots.")]
Seconds = Annotated[float, typer.Option(help="Seconds excluded from the measured window.")]
SloMs = Annotated[float | None, typer.Option(help="Goodput SLO, milliseconds.")]
Out = Annotated[
    str | None, typer.Option(help="Write results.json, requests.jsonl, CSV and PNGs here.")
]
ClientTimeout = Annotated[float, typer.Option(help="Per request, client side.")]
ServerMetrics = Annotated[bool, typer.Option(help="Scrape router and workers.")]
LeakWait = Annotated[float, typer.Option(help="Wait for KV blocks to free.")]
ChunkTokens = Annotated[
    str, typer.Option(help="HTTP: count each streamed event (events) or non-empty text (text).")
]
IgnoreEos = Annotated[
    bool | None,
    typer.Option("--ignore-eos/--honor-eos", help="Default: ignore except for specbench."),
]


def _config(**kw: Any) -> ServeConfig:
    """A ServeConfig from the shared options (BadParameter on a bad value)."""

    def seconds(ms: float | None) -> float | None:
        return None if ms is None else ms / 1e3

    try:
        workload = WorkloadConfig(
            name=kw["workload"],
            num_requests=kw["num_requests"],
            input_len=kw["input_len"],
            output_len=kw["output_len"],
            num_groups=kw["num_groups"],
            prompts_per_group=kw["prompts_per_group"],
            prefix_len=kw["prefix_len"],
            long_fraction=kw["long_fraction"],
            long_input_len=kw["long_input_len"],
            long_output_len=kw["long_output_len"],
            ignore_eos=kw["ignore_eos"],
            seed=kw["seed"],
        )
        points = sweep_points(
            kw["rate"],
            kw["concurrency"],
            parse_list(kw.get("rates"), float),
            parse_list(kw.get("concurrencies"), int),
            kw["burstiness"],
            kw["ramp_up_s"],
            trace=workload.kind == "trace" and kw.get("ttft_p99") is None,
        )
        return ServeConfig(
            url=kw["url"],
            grpc=kw["grpc"],
            admin=kw["admin"],
            admin_token=kw["admin_token"],
            model=kw["model"],
            workload=workload,
            points=points,
            max_requests=kw["num_requests"],
            duration_s=kw["duration_s"],
            warmup_s=kw["warmup_s"],
            cooldown_s=kw["cooldown_s"],
            slo=SLO(seconds(kw["slo_ttft"]), seconds(kw["slo_tpot"]), seconds(kw["slo_e2e"])),
            temperature=kw["temperature"],
            timeout_s=kw["timeout_s"],
            vocab_size=kw["vocab_size"],
            http_chunk_tokens=kw["http_chunk_tokens"],
            server_metrics=kw["server_metrics"],
            leak_wait_s=kw["leak_wait_s"],
            out=kw["out"],
            plots=kw["plots"],
        )
    except (ValueError, WorkloadError) as e:
        raise typer.BadParameter(str(e)) from None


def bench_serve(
    url: Url = "http://127.0.0.1:8000",
    grpc: Grpc = None,
    admin: Admin = None,
    admin_token: AdminToken = None,
    model: Model = "",
    workload: Workload = "random",
    num_requests: NumRequests = None,
    duration_s: Duration = None,
    input_len: Length = "128",
    output_len: Length = "128",
    num_groups: Annotated[int, typer.Option(help="shared-prefix: groups.")] = 4,
    prompts_per_group: Annotated[int, typer.Option(help="shared-prefix: prompts each.")] = 8,
    prefix_len: Annotated[int, typer.Option(help="shared-prefix: common tokens.")] = 256,
    long_fraction: Annotated[float, typer.Option(help="interference: long share.")] = 0.1,
    long_input_len: Length = "2048",
    long_output_len: Length = "16",
    ignore_eos: IgnoreEos = None,
    vocab_size: Annotated[int | None, typer.Option(help="Default: the model's.")] = None,
    temperature: Temperature = 0.0,
    concurrency: Concurrency = None,
    rate: Rate = None,
    burstiness: Burstiness = 1.0,
    ramp_up_s: RampUp = 0.0,
    rates: Annotated[str | None, typer.Option(help="Sweep: comma-separated rates.")] = None,
    concurrencies: Annotated[
        str | None, typer.Option(help="Sweep: comma-separated concurrencies.")
    ] = None,
    warmup_s: Seconds = 0.0,
    cooldown_s: Seconds = 0.0,
    seed: int = 0,
    slo_ttft: SloMs = None,
    slo_tpot: SloMs = None,
    slo_e2e: SloMs = None,
    timeout_s: ClientTimeout = 600.0,
    http_chunk_tokens: ChunkTokens = "events",
    server_metrics: ServerMetrics = True,
    leak_wait_s: LeakWait = 10.0,
    out: Out = None,
    plots: bool = True,
) -> None:
    """Load a running cluster (OpenAI HTTP streaming, or gRPC) and report TTFT, TPOT, ITL, E2E,
    throughput, goodput and the server-side deltas per load point."""
    from tandem.bench.serve import run_serve_bench

    config = _config(**locals())
    try:
        run_serve_bench(config, console)
    except BenchError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1) from None


def bench_sla(
    ttft_p99: Annotated[float, typer.Option(help="SLO: p99 TTFT, milliseconds.")],
    tpot_p99: Annotated[float, typer.Option(help="SLO: p99 TPOT, milliseconds.")],
    url: Url = "http://127.0.0.1:8000",
    grpc: Grpc = None,
    admin: Admin = None,
    admin_token: AdminToken = None,
    model: Model = "",
    rates: Annotated[
        str | None, typer.Option(help="Rates to try (default: double, then bisect).")
    ] = None,
    start_rate: Annotated[float, typer.Option(help="First rate of the doubling.")] = 1.0,
    max_rate: Annotated[float, typer.Option(help="Stop doubling above this.")] = 1024.0,
    bisect_steps: Annotated[int, typer.Option(help="Bisections after the SLO breaks.")] = 3,
    workload: Workload = "random",
    num_requests: NumRequests = None,
    duration_s: Duration = None,
    input_len: Length = "128",
    output_len: Length = "128",
    num_groups: int = 4,
    prompts_per_group: int = 8,
    prefix_len: int = 256,
    long_fraction: float = 0.1,
    long_input_len: Length = "2048",
    long_output_len: Length = "16",
    ignore_eos: IgnoreEos = None,
    vocab_size: Annotated[int | None, typer.Option(help="Default: the model's.")] = None,
    temperature: Temperature = 0.0,
    concurrency: Annotated[int | None, typer.Option(help="Cap on requests in flight.")] = None,
    burstiness: Burstiness = 1.0,
    ramp_up_s: RampUp = 0.0,
    warmup_s: Seconds = 0.0,
    cooldown_s: Seconds = 0.0,
    seed: int = 0,
    timeout_s: ClientTimeout = 600.0,
    http_chunk_tokens: ChunkTokens = "events",
    server_metrics: ServerMetrics = True,
    leak_wait_s: LeakWait = 10.0,
    out: Out = None,
    plots: bool = True,
) -> None:
    """Sweep request rates and report the operating point: the highest rate whose p99 TTFT and
    p99 TPOT meet the SLO (with no failed request)."""
    from tandem.bench.serve import run_sla_bench

    if bisect_steps < 0 or not 0 < start_rate <= max_rate:
        raise typer.BadParameter("need bisect_steps >= 0 and 0 < start_rate <= max_rate")
    config = _config(**locals(), rate=start_rate, slo_ttft=None, slo_tpot=None, slo_e2e=None)
    try:
        run_sla_bench(
            config,
            console,
            ttft_p99 / 1e3,
            tpot_p99 / 1e3,
            parse_list(rates, float),
            start_rate,
            max_rate,
            bisect_steps,
        )
    except BenchError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1) from None
