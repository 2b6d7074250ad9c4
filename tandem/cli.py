"""`tandem` command line: models, generate, serve, bench, spec."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from tandem.bench.cli_common import names, run_bench_command
from tandem.bench.experiment_cli import bench_experiment
from tandem.bench.quant_cli import bench_quant
from tandem.bench.serve_cli import bench_serve, bench_sla
from tandem.bench.sim_cli import register_sim_commands
from tandem.bench.spec_bench_cli import bench_spec
from tandem.config import DEFAULT_MODEL, parse_speculative
from tandem.spec_cli import spec_train

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
models_app = typer.Typer(no_args_is_help=True, help="Manage local models.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (ratios measured side by side).")
app.add_typer(models_app, name="models")
app.add_typer(bench_app, name="bench")
spec_app = typer.Typer(no_args_is_help=True, help="Speculative decoding: train draft heads.")
app.add_typer(spec_app, name="spec")
spec_app.command("train")(spec_train)  # options in tandem/spec_cli.py
console = Console()

ModelOpt = Annotated[str, typer.Option(help="Catalogue name, HF directory or .gguf path.")]
DtypeOpt = Annotated[str, typer.Option(help="float32 | bfloat16 | float16")]
DeviceOpt = Annotated[str, typer.Option(help="cpu | cuda | cuda:N")]
SpecOpt = Annotated[
    str | None,
    typer.Option(
        help="Speculative decoding: ngram | draft[:MODEL] | layerskip:N | medusa:DIR | eagle:DIR."
    ),
]
DraftModelOpt = Annotated[str | None, typer.Option(help="--spec draft: the draft model.")]
SpecCostOpt = Annotated[
    bool,
    typer.Option(help="Draft only as far as measured step times say it pays (off: always draft)."),
]
QuantOpt = Annotated[str | None, typer.Option(help="Weights of the linear layers: int8 | int4.")]
GroupSizeOpt = Annotated[
    int, typer.Option(help="int4: input channels per scale and zero (32 | 64 | 128 | 256).")
]
KernelRoutesOpt = Annotated[
    str,
    typer.Option(
        help="CPU kernels of the linear layers: auto (this machine's measured table, measuring "
        "what it lacks) | probe (measure again) | default | a route forced everywhere it runs "
        "(row_gemm, f_linear, quant_gemm, dequant, ...)."
    ),
]
KVCacheDtypeOpt = Annotated[
    str,
    typer.Option(help="KV cache: auto (the model dtype) | int8 | fp8 (e4m3), scaled per token."),
]


@models_app.command("pull")
def models_pull(
    name: Annotated[str, typer.Argument(help="Catalogue name.")] = DEFAULT_MODEL,
) -> None:
    """Download a catalogue model into $TANDEM_HOME/models."""
    from tandem import hub

    try:
        path = hub.pull(name)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="NAME") from None
    console.print(f"[green]ready:[/green] {path}")


@models_app.command("list")
def models_list() -> None:
    """Show the catalogue and what is already local."""
    from tandem import hub

    table = Table("catalogue name", "source", "local")
    local = set(hub.list_local())
    pulled = [hub.models_dir() / e.filename for e in hub.CATALOGUE.values()]
    for (name, entry), path in zip(hub.CATALOGUE.items(), pulled, strict=True):
        table.add_row(name, entry.requirement, "yes" if path in local else "-")
    console.print(table)
    for path in sorted(local):  # whole, on a line each: a table cell would cut a long path
        console.print(f"{'local' if path in pulled else 'also local'}: {path}", soft_wrap=True)


@app.command()
def generate(
    prompt: str,
    chat: Annotated[
        bool, typer.Option(help="Wrap the prompt in the model's chat template.")
    ] = False,
    max_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    spec: SpecOpt = None,
    draft_model: DraftModelOpt = None,
    num_spec_tokens: int = 5,
    spec_cost_aware: SpecCostOpt = True,
    quantization: QuantOpt = None,
    quant_group_size: GroupSizeOpt = 32,
    kernel_routes: KernelRoutesOpt = "auto",
    model: ModelOpt = DEFAULT_MODEL,
    dtype: DtypeOpt = "float32",
    device: DeviceOpt = "cpu",
    kv_cache_dtype: KVCacheDtypeOpt = "auto",
) -> None:
    """Generate a completion with the offline engine, streamed to the terminal."""
    from tandem.engine import LLM, SamplingParams

    speculative = _speculative(
        spec, draft_model, num_speculative_tokens=num_spec_tokens, cost_aware=spec_cost_aware
    )
    try:
        llm = LLM(
            model,
            dtype=dtype,
            device=device,
            speculative=speculative,
            quantization=quantization,
            quant_group_size=quant_group_size,
            kernel_routes=kernel_routes,
            kv_cache_dtype=kv_cache_dtype,
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
    try:
        params.validate(llm.engine.vocab_size)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    ids = llm.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    last = None
    for out in llm.stream(ids, params):
        sys.stdout.write(out.delta)
        sys.stdout.flush()
        last = out
    sys.stdout.write("\n")
    if last is not None and last.metrics is not None:
        m = last.metrics
        tpot = f"{m.tpot * 1e3:.1f} ms" if m.tpot else "-"
        ttft = f"{m.ttft * 1e3:.0f} ms" if m.ttft else "-"
        accepted = ""
        if m.num_draft_tokens:
            accepted = f", accepted {m.num_accepted_tokens}/{m.num_draft_tokens} drafts"
        console.print(
            f"[dim]{m.n_prompt} prompt + {m.n_out} output tokens, "
            f"TTFT {ttft}, TPOT {tpot}{accepted}, finish={last.finish_reason}[/dim]"
        )


def _speculative(
    spec: str | None, draft_model: str | None, **options: Any
) -> dict[str, Any] | None:
    """`--spec METHOD[:ARG]` and `--draft-model` as the engine's `speculative` dict; None
    without --spec."""
    if not spec:
        return None
    if draft_model is not None:
        options["draft_model"] = draft_model
    try:
        return parse_speculative(spec, **options)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--spec") from None


def _engine_config(
    role: str,
    model: str,
    dtype: str,
    device: str,
    spec: str | None,
    draft_model: str | None = None,
    spec_cost_aware: bool = True,
    **flat: object,
) -> Any:
    """A worker's engine: a decode worker's speculates as `--spec` says; a prefill worker's
    runs the proposer too when it hands state over (EAGLE), else none."""
    from tandem.config import EngineConfig
    from tandem.engine.spec.factory import prefill_speculative

    speculative = _speculative(spec, draft_model, cost_aware=spec_cost_aware)
    if role == "prefill":
        speculative = prefill_speculative(speculative)
    return EngineConfig.create(model, speculative, dtype=dtype, device=device, **flat)


@app.command()
def serve(
    model: ModelOpt = DEFAULT_MODEL,
    prefill: Annotated[int, typer.Option(help="Prefill workers.")] = 1,
    decode: Annotated[int, typer.Option(help="Decode workers.")] = 1,
    ray: Annotated[bool, typer.Option("--ray/--no-ray", help="Pools on Ray.")] = True,
    address: Annotated[str | None, typer.Option(help="Join this Ray cluster.")] = None,
    redis: Annotated[str | None, typer.Option(help="redis:// URL; default: embedded.")] = None,
    host: str = "127.0.0.1",
    http_port: int = 8000,
    grpc_port: int = 50051,
    spec: SpecOpt = None,
    draft_model: DraftModelOpt = None,
    spec_cost_aware: SpecCostOpt = True,
    dtype: DtypeOpt = "float32",
    autoscale: Annotated[bool, typer.Option(help="SLO autoscaler (Ray only).")] = False,
    dry_run: Annotated[bool, typer.Option(help="Autoscaler logs, does not act.")] = False,
    admin_token: Annotated[str | None, typer.Option(help="Token for the admin APIs.")] = None,
    demo: Annotated[bool, typer.Option(help="Answer one request, then keep serving.")] = True,
    gpus_per_worker: Annotated[int, typer.Option(help="GPU bundles per worker (0: CPU).")] = 0,
    cpus_per_worker: Annotated[float, typer.Option(help="CPUs reserved per worker.")] = 1.0,
    pin_pools: Annotated[
        bool, typer.Option(help="Place pools on nodes with tandem_prefill/tandem_decode.")
    ] = False,
    kv_memory_gib: Annotated[float, typer.Option(help="KV cache per worker, GiB.")] = 1.0,
    block_size: Annotated[int, typer.Option(help="KV block size, tokens.")] = 16,
    kv_cache_dtype: KVCacheDtypeOpt = "auto",
    quantization: QuantOpt = None,
    quant_group_size: GroupSizeOpt = 32,
    kernel_routes: KernelRoutesOpt = "auto",
    max_num_seqs: Annotated[int, typer.Option(help="Requests per engine batch.")] = 64,
    num_threads: Annotated[int | None, typer.Option(help="torch threads per worker.")] = None,
    engine: Annotated[str, typer.Option(help="--no-ray: real | sim workers.")] = "real",
    sim_profile: Annotated[str | None, typer.Option(help="sim: profile JSON.")] = None,
) -> None:
    """Start the cluster: registry, router, prefill and decode pools (on Ray by default)."""
    from tandem.cluster.autoscaler import AutoscalerConfig
    from tandem.cluster.local_cluster import LocalCluster
    from tandem.cluster.pools import PoolSpec
    from tandem.cluster.ray_cluster import RayCluster

    cluster: RayCluster | LocalCluster
    if ray:
        speculative = _speculative(spec, draft_model, cost_aware=spec_cost_aware)
        decode_engine = {"speculative": speculative} if spec else {}
        pools = {
            role: PoolSpec(
                cpus_per_worker,
                gpus_per_worker,
                resources={f"tandem_{role}": 1.0} if pin_pools else {},
            )
            for role in ("prefill", "decode")
        }
        device = "cuda" if gpus_per_worker else "cpu"
        cluster = RayCluster(
            model, prefill, decode, address, redis, host, http_port, grpc_port,
            engine={
                "dtype": dtype, "device": device, "memory_gib": kv_memory_gib,
                "block_size": block_size, "kv_cache_dtype": kv_cache_dtype,
                "quantization": quantization, "quant_group_size": quant_group_size,
                "kernel_routes": kernel_routes,
                "max_num_seqs": max_num_seqs, "num_threads": num_threads,
            },
            decode_engine=decode_engine,
            prefill_pool=pools["prefill"], decode_pool=pools["decode"],
            autoscale=AutoscalerConfig() if autoscale else None, dry_run=dry_run,
            admin_token=admin_token,
        )  # fmt: skip
    else:
        worker_args = ["--dtype", dtype, "--kv-memory-gib", str(kv_memory_gib)]
        worker_args += ["--block-size", str(block_size), "--kv-cache-dtype", kv_cache_dtype]
        worker_args += ["--quantization", quantization] if quantization else []
        worker_args += ["--quant-group-size", str(quant_group_size)]
        worker_args += ["--kernel-routes", kernel_routes]
        worker_args += ["--spec", spec] if spec else []
        worker_args += ["--draft-model", draft_model] if draft_model else []
        worker_args += [] if spec_cost_aware else ["--no-spec-cost-aware"]
        if num_threads is not None:
            worker_args += ["--num-threads", str(num_threads)]
        worker_args += ["--engine", engine]
        worker_args += ["--sim-profile", sim_profile] if sim_profile else []
        cluster = LocalCluster(
            model, prefill, decode, redis, host, http_port, grpc_port, worker_args=worker_args,
            admin_token=admin_token,
        )  # fmt: skip
    where = "Ray" if ray else "local processes"
    console.print(f"starting {prefill} prefill + {decode} decode workers of {model} on {where}")
    address_ = cluster.start()
    try:
        console.print(
            f"[green]ready[/green]  HTTP {address_.http_url}  gRPC {address_.grpc_target}"
        )
        console.print(
            f"  curl {address_.http_url}/v1/chat/completions -H 'Content-Type: application/json' "
            f"""-d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hi!"}}]}}'"""
        )
        console.print(
            f'  grpcurl -plaintext -d \'{{"prompt": "Hi"}}\' {address_.grpc_target} '
            "tandem.v1.Tandem/Generate"
        )
        console.print(f"  tandem status --router {address_.grpc_target}")
        if demo:
            _demo_request(address_.http_url, model)
        console.print("[dim]serving; Ctrl-C stops[/dim]")
        assert cluster.router_server is not None
        cluster.router_server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()


@app.command("router")
def router_cmd(
    model: ModelOpt = DEFAULT_MODEL,
    redis: Annotated[
        str, typer.Option(help="Registry URL (redis://...).")
    ] = "redis://127.0.0.1:6379",
    host: Annotated[str, typer.Option(help="Address to bind.")] = "0.0.0.0",
    http_port: int = 8000,
    grpc_port: int = 50051,
    ray_address: Annotated[
        str | None, typer.Option(help="Ray cluster (e.g. ray://head:10001) for Scale/Drain.")
    ] = None,
    admin_token: Annotated[str | None, typer.Option(help="Token for the admin APIs.")] = None,
    prefill_policy: str = "prefix_aware",
    decode_policy: str = "least_loaded",
    local_prefill_tokens: int = 32,
) -> None:
    """Run only the router (its own process or Kubernetes Deployment); workers come from the
    registry."""
    from router.router_server import RouterServer
    from tandem.config import RouterConfig

    controller = None
    if ray_address:
        import ray

        from tandem.cluster.pools import get_controller

        ray.init(ray_address)
        controller = get_controller()
    config = RouterConfig(
        model,
        prefill_policy=prefill_policy,
        decode_policy=decode_policy,
        local_prefill_tokens=local_prefill_tokens,
    )
    server = RouterServer(
        config, redis, host, http_port, grpc_port, admin_token, controller=controller
    )
    address = server.start()
    console.print(f"router: HTTP {address.http_url}  gRPC {address.grpc_target}")
    try:
        server.wait()
    except KeyboardInterrupt:
        server.stop()


RouterOpt = Annotated[str, typer.Option(help="The router's gRPC address.")]
TokenOpt = Annotated[str | None, typer.Option(help="Admin token.")]


def _admin(router: str, token: str | None) -> tuple[Any, list[tuple[str, str]]]:
    import grpc

    from tandem.v1 import admin_pb2_grpc

    metadata = [("authorization", f"Bearer {token}")] if token else []
    return admin_pb2_grpc.AdminStub(grpc.insecure_channel(router)), metadata


def _admin_call(fn: Any, request: Any, metadata: list[tuple[str, str]]) -> Any:
    import grpc

    try:
        return fn(request, metadata=metadata, timeout=30)
    except grpc.RpcError as e:
        console.print(f"[red]{e.code().name}:[/red] {e.details()}")
        raise typer.Exit(1) from None


@app.command()
def scale(
    prefill: Annotated[int | None, typer.Option(help="Prefill pool size.")] = None,
    decode: Annotated[int | None, typer.Option(help="Decode pool size.")] = None,
    router: RouterOpt = "127.0.0.1:50051",
    token: TokenOpt = None,
) -> None:
    """Set the size of the prefill and/or decode pool (scale-down drains)."""
    from tandem.v1 import admin_pb2

    stub, metadata = _admin(router, token)
    reply = _admin_call(
        stub.Scale, admin_pb2.ScaleRequest(prefill=prefill, decode=decode), metadata
    )
    console.print(f"desired: {reply.prefill} prefill, {reply.decode} decode")


@app.command()
def status(router: RouterOpt = "127.0.0.1:50051", token: TokenOpt = None) -> None:
    """The workers of the cluster: role, endpoint, load, KV usage."""
    from tandem.cluster.signals import worker_summary
    from tandem.v1 import admin_pb2

    stub, metadata = _admin(router, token)
    reply = _admin_call(stub.ListWorkers, admin_pb2.ListWorkersRequest(), metadata)
    table = Table(
        "worker", "role", "endpoint", "running", "waiting", "KV used", "p50 TTFT", "p50 TPOT",
        "accept", "state", "beat",
    )  # fmt: skip
    for w in sorted(reply.workers, key=lambda w: (w.role, w.worker_id)):
        used = 1 - w.kv_blocks_free / w.kv_blocks_total if w.kv_blocks_total else 0.0
        state = "draining" if w.draining else "serving"
        s = worker_summary(w.metrics_url)
        table.add_row(
            w.worker_id, w.role, w.endpoint, str(w.running), str(w.waiting), f"{used:.0%}",
            _ms(s.get("ttft_p50")), _ms(s.get("tpot_p50")),
            f"{s['acceptance']:.0%}" if s.get("acceptance") is not None else "-",
            state, f"{w.heartbeat_age_s:.1f}s ago",
        )  # fmt: skip
    console.print(table)


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds is not None else "-"


@app.command()
def drain(
    worker: Annotated[str, typer.Argument(help="Worker id (see `tandem status`).")],
    router: RouterOpt = "127.0.0.1:50051",
    token: TokenOpt = None,
) -> None:
    """Drain one worker: it finishes its requests and leaves; the pool replaces it."""
    from tandem.v1 import admin_pb2

    stub, metadata = _admin(router, token)
    _admin_call(stub.Drain, admin_pb2.DrainRequest(worker_id=worker), metadata)
    console.print(f"draining {worker}")


def _demo_request(http_url: str, model: str) -> None:
    import json
    import urllib.request

    prompt = "In one sentence, what does a language model do?"
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 64}
    request = urllib.request.Request(
        f"{http_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        reply = json.load(response)
    console.print(f"[bold]user:[/bold] {prompt}")
    console.print(f"[bold]assistant:[/bold] {reply['choices'][0]['message']['content']}")


@app.command()
def worker(
    role: Annotated[str, typer.Argument(help="prefill | decode")],
    model: ModelOpt = DEFAULT_MODEL,
    host: str = "127.0.0.1",
    port: int = 0,
    redis: Annotated[str | None, typer.Option(help="Registry URL.")] = None,
    metrics_port: int = 0,
    ttl: Annotated[float, typer.Option(help="Registry heartbeat TTL, seconds.")] = 3.0,
    dtype: DtypeOpt = "float32",
    device: DeviceOpt = "cpu",
    kv_memory_gib: Annotated[float, typer.Option(help="KV cache memory, GiB.")] = 1.0,
    block_size: Annotated[int, typer.Option(help="KV block size, tokens.")] = 16,
    kv_cache_dtype: KVCacheDtypeOpt = "auto",
    num_threads: Annotated[int | None, typer.Option(help="torch threads on CPU.")] = None,
    max_num_batched_tokens: Annotated[int, typer.Option(help="Token budget of a step.")] = 2048,
    chunked_prefill: Annotated[bool, typer.Option(help="Split long prompts over steps.")] = True,
    spec: SpecOpt = None,
    draft_model: DraftModelOpt = None,
    spec_cost_aware: SpecCostOpt = True,
    quantization: QuantOpt = None,
    quant_group_size: GroupSizeOpt = 32,
    kernel_routes: KernelRoutesOpt = "auto",
    on_transfer_failure: Annotated[str, typer.Option(help="decode: local | fail")] = "local",
    channel: Annotated[str, typer.Option(help="prefill: KV channel auto|grpc|pair|shm")] = "auto",
    stream_layers: Annotated[bool, typer.Option(help="prefill: layer-wise streaming.")] = True,
    engine: Annotated[str, typer.Option(help="real | sim (modelled step times).")] = "real",
    sim_profile: Annotated[
        str | None, typer.Option(help="sim: profile JSON (tandem bench calibrate).")
    ] = None,
) -> None:
    """One worker: `prefill` computes prompts and pushes their KV to decode workers; `decode`
    receives it and generates, with speculative decoding. SIGTERM drains it."""
    from tandem.cluster.workers import build_worker
    from tandem.config import TransferConfig, WorkerConfig
    from tandem.worker_server import drain_signal

    if role not in ("prefill", "decode"):
        raise typer.BadParameter("must be prefill or decode", param_hint="ROLE")
    stop = drain_signal()  # before registering: a signal during startup still drains
    config = _engine_config(
        role, model, dtype, device, spec, draft_model, spec_cost_aware,
        memory_gib=kv_memory_gib, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
        num_threads=num_threads, max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=chunked_prefill, engine=engine, sim_profile=sim_profile,
        quantization=quantization, quant_group_size=quant_group_size,
        kernel_routes=kernel_routes,
    )  # fmt: skip
    transfer = TransferConfig(
        channel=channel, stream_layers=stream_layers, on_failure=on_transfer_failure
    )
    server = build_worker(
        role,
        WorkerConfig(config, transfer, host, port, redis, metrics_port, heartbeat_ttl_s=ttl),
    )
    console.print(f"{role} worker {server.worker_id} on {server.endpoint}")
    server.serve_until(stop)


@bench_app.command("engine")
def bench_engine(
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
    quick: Annotated[
        bool,
        typer.Option(
            "--quick", help="A one-minute pipeline check with tiny sizes (overrides the sizes)."
        ),
    ] = False,
    json_out: Annotated[
        str | None, typer.Option("--json", help="Write results here, and a .png beside them.")
    ] = None,
) -> None:
    """Engine vs transformers `generate` side by side, with the kernel floor and bandwidth limit."""
    from tandem.bench.engine_bench import BenchConfig, run_engine_bench

    run_bench_command(
        lambda: BenchConfig(
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
    json_out: Annotated[
        str | None, typer.Option("--json", help="Write results here, and a .png beside them.")
    ] = None,
) -> None:
    """KV transfer: each channel's GB/s against raw TCP / memcpy, and the exposed transfer time
    with and without layer-wise streaming."""
    from tandem.bench.transfer import BenchConfig, run_transfer_bench

    run_bench_command(
        lambda: BenchConfig(
            model=model,
            device=device,
            dtype=dtype,
            channels=names(channels),
            prompt_tokens=tuple(int(n) for n in names(tokens)),
            reps=reps,
            exposed_channels=names(exposed_channels),
            exposed_tokens=tuple(int(n) for n in names(exposed_tokens)),
            exposed_reps=exposed_reps,
            decode_tokens=decode_tokens,
            threads=threads,
            seed=seed,
        ),
        quick,
        run_transfer_bench,
        json_out,
        console,
    )


bench_app.command("serve")(bench_serve)  # options in tandem/bench/serve_cli.py
bench_app.command("sla")(bench_sla)
register_sim_commands(bench_app)  # calibrate, router, sim-cluster: tandem/bench/sim_cli.py
bench_app.command("experiment")(bench_experiment)  # tandem/bench/experiment_cli.py
bench_app.command("spec")(bench_spec)  # tandem/bench/spec_cli.py
bench_app.command("quant")(bench_quant)  # tandem/bench/quant_cli.py


if __name__ == "__main__":
    app()
