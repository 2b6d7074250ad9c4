"""`tandem serve|router|worker`: a whole cluster, a router alone, or one worker."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from tandem.cli.options import (
    ApiKeyOpt,
    AttentionBackendOpt,
    CudaGraphsOpt,
    DeviceOpt,
    DraftModelOpt,
    DtypeOpt,
    GroupSizeOpt,
    KernelRoutesOpt,
    KVCacheDtypeOpt,
    ModelOpt,
    QuantOpt,
    SpecCostOpt,
    SpecOpt,
    ToolParserOpt,
    TPOpt,
    console,
    speculative_option,
)
from tandem.config import DEFAULT_MODEL, RouterConfig, TransferConfig, api_key_from_environment

DecodeWaitOpt = Annotated[
    float,
    typer.Option(help="With no decode worker, a request waits this long for one (0: 503 at once)."),
]
DecodeWaitersOpt = Annotated[
    int, typer.Option(help="Requests that may wait for a decode worker; more get 429.")
]


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
    api_key: ApiKeyOpt = None,
    tool_call_parser: ToolParserOpt = "auto",
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
    attention_backend: AttentionBackendOpt = "auto",
    max_num_seqs: Annotated[int, typer.Option(help="Requests per engine batch.")] = 64,
    num_threads: Annotated[int | None, typer.Option(help="torch threads per worker.")] = None,
    engine: Annotated[str, typer.Option(help="--no-ray: real | sim workers.")] = "real",
    sim_profile: Annotated[str | None, typer.Option(help="sim: profile JSON.")] = None,
    decode_wait_s: DecodeWaitOpt = 30.0,
    max_decode_waiters: DecodeWaitersOpt = 256,
    placement_timeout_s: Annotated[
        float, typer.Option(help="Ray: a worker not placed this long is dropped.")
    ] = 300.0,
    prefill_tp: Annotated[int, typer.Option(help="Tensor-parallel ranks per prefill worker.")] = 1,
    decode_tp: Annotated[int, typer.Option(help="Tensor-parallel ranks per decode worker.")] = 1,
) -> None:
    """Start the cluster: registry, router, prefill and decode pools (on Ray by default)."""
    from tandem.cluster.local_cluster import LocalCluster

    engine_options = {
        "dtype": dtype, "memory_gib": kv_memory_gib, "block_size": block_size,
        "kv_cache_dtype": kv_cache_dtype, "quantization": quantization,
        "quant_group_size": quant_group_size, "kernel_routes": kernel_routes,
        "attention_backend": attention_backend,
        "max_num_seqs": max_num_seqs, "num_threads": num_threads,
    }  # fmt: skip
    listen = (redis, host, http_port, grpc_port)
    router = router_config(
        model,
        api_key,
        decode_wait_s=decode_wait_s,
        max_decode_waiters=max_decode_waiters,
        tool_call_parser=tool_call_parser,
    )
    cluster: Any
    if ray:
        speculative = speculative_option(spec, draft_model, cost_aware=spec_cost_aware)
        tp = {"prefill": prefill_tp, "decode": decode_tp}
        pools = _ray_pools(cpus_per_worker, gpus_per_worker, pin_pools, tp)
        cluster = _ray_cluster(
            model, prefill, decode, address, listen, engine_options, speculative, pools,
            autoscale, dry_run, admin_token, router, placement_timeout_s,
        )  # fmt: skip
    else:
        spec_flags = ["--spec", spec] if spec else []
        spec_flags += ["--draft-model", draft_model] if draft_model else []
        spec_flags += [] if spec_cost_aware else ["--no-spec-cost-aware"]
        spec_flags += ["--engine", engine] + (["--sim-profile", sim_profile] if sim_profile else [])
        worker_args = _worker_flags(engine_options) + spec_flags
        cluster = LocalCluster(
            model, prefill, decode, *listen, worker_args=worker_args, router=router,
            admin_token=admin_token, restart_workers=True,
            prefill_args=["--tp", str(prefill_tp)], decode_args=["--tp", str(decode_tp)],
        )  # fmt: skip
    where = "Ray" if ray else "local processes"
    console.print(f"starting {prefill} prefill + {decode} decode workers of {model} on {where}")
    _serve_until_interrupted(cluster, model, demo, router.api_key)


def router_config(model: str, api_key: str | None, **options: Any) -> RouterConfig:
    """The router's config; the API key from `--api-key`, else `$TANDEM_API_KEY`."""
    return RouterConfig(model, api_key=api_key or api_key_from_environment(), **options)


def _ray_pools(cpus: float, gpus: int, pinned: bool, tp: dict[str, int]) -> dict[str, Any]:
    """Each pool's resources per worker: CPUs, GPU bundles, its node label when pinned, and its
    tensor-parallel ranks (one bundle each)."""
    from tandem.cluster.pools import PoolSpec

    pools = {}
    for role in ("prefill", "decode"):
        try:
            pools[role] = PoolSpec(
                cpus,
                gpus,
                resources={f"tandem_{role}": 1.0} if pinned else {},
                tensor_parallel_size=tp[role],
            )
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint=f"--{role}-tp/--gpus-per-worker") from e
    return pools


def _ray_cluster(
    model: str,
    prefill: int,
    decode: int,
    address: str | None,
    listen: tuple[str | None, str, int, int],
    engine_options: dict[str, Any],
    speculative: dict[str, Any] | None,
    pools: dict[str, Any],
    autoscale: bool,
    dry_run: bool,
    admin_token: str | None,
    router: RouterConfig,
    placement_timeout_s: float,
) -> Any:
    """The pools as Ray actors; the decode pool speculates as `--spec` says."""
    from tandem.cluster.autoscaler import AutoscalerConfig
    from tandem.cluster.ray_cluster import RayCluster

    device = "cuda" if pools["prefill"].gpus_per_worker else "cpu"
    return RayCluster(
        model, prefill, decode, address, *listen,
        engine={**engine_options, "device": device},
        decode_engine={"speculative": speculative} if speculative else {},
        prefill_pool=pools["prefill"], decode_pool=pools["decode"],
        autoscale=AutoscalerConfig() if autoscale else None, dry_run=dry_run,
        admin_token=admin_token, router=router, placement_timeout_s=placement_timeout_s,
    )  # fmt: skip


# `tandem worker` flags of the engine options that local worker processes take
_WORKER_FLAGS = {
    "dtype": "--dtype",
    "memory_gib": "--kv-memory-gib",
    "block_size": "--block-size",
    "kv_cache_dtype": "--kv-cache-dtype",
    "quantization": "--quantization",
    "quant_group_size": "--quant-group-size",
    "kernel_routes": "--kernel-routes",
    "attention_backend": "--attention-backend",
    "max_num_seqs": "--max-num-seqs",
    "num_threads": "--num-threads",
}


def _worker_flags(engine_options: dict[str, Any]) -> list[str]:
    """The engine options as `tandem worker` flags (unset ones left to the worker's default)."""
    return [
        part
        for name, flag in _WORKER_FLAGS.items()
        if engine_options[name] is not None
        for part in (flag, str(engine_options[name]))
    ]


def _serve_until_interrupted(cluster: Any, model: str, demo: bool, api_key: str | None) -> None:
    """Start the cluster, print how to reach it, answer the demo request, serve until Ctrl-C or
    SIGTERM; stop it however that ends (the router, then every worker, which drains, then the
    embedded Redis and the Ray this started)."""
    from tandem.cluster.lifetime import interrupt_on_sigterm

    interrupt_on_sigterm()  # a SIGTERM during startup still stops what has started
    try:
        address = cluster.start()
        interrupt_on_sigterm()  # again: ray.init installs Ray's own handler
        console.print(f"[green]ready[/green]  HTTP {address.http_url}  gRPC {address.grpc_target}")
        key = "" if api_key is None else "-H 'Authorization: Bearer <API key>' "
        console.print(
            f"  curl {address.http_url}/v1/chat/completions -H 'Content-Type: application/json' "
            + key
            + f"""-d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hi!"}}]}}'"""
        )
        console.print(
            f'  grpcurl -plaintext {key}-d \'{{"prompt": "Hi"}}\' {address.grpc_target} '
            "tandem.v1.Tandem/Generate"
        )
        console.print(f"  tandem status --router {address.grpc_target}")
        if cluster.redis_url is None:  # embedded: the URL names no password
            url = cluster.registry.url
            console.print(f"  registry {url}  (tandem router --redis)", soft_wrap=True)
        if demo:
            _demo_request(address.http_url, model, api_key)
        console.print("[dim]serving; Ctrl-C or SIGTERM stops[/dim]")
        assert cluster.router_server is not None
        cluster.router_server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()


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
    api_key: ApiKeyOpt = None,
    tool_call_parser: ToolParserOpt = "auto",
    prefill_policy: str = "prefix_aware",
    decode_policy: str = "least_loaded",
    local_prefill_tokens: int = 32,
    decode_wait_s: DecodeWaitOpt = 30.0,
    max_decode_waiters: DecodeWaitersOpt = 256,
) -> None:
    """Run only the router (its own process or Kubernetes Deployment); workers come from the
    registry."""
    from router.router_server import RouterServer

    controller = None
    if ray_address:
        import ray

        from tandem.cluster.pools import get_controller

        ray.init(ray_address)
        controller = get_controller()
    config = router_config(
        model,
        api_key,
        prefill_policy=prefill_policy,
        decode_policy=decode_policy,
        local_prefill_tokens=local_prefill_tokens,
        decode_wait_s=decode_wait_s,
        max_decode_waiters=max_decode_waiters,
        tool_call_parser=tool_call_parser,
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


def _demo_request(http_url: str, model: str, api_key: str | None) -> None:
    import json
    import urllib.request

    prompt = "In one sentence, what does a language model do?"
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 64}
    headers = {"Content-Type": "application/json"}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(
        f"{http_url}/v1/chat/completions", data=json.dumps(body).encode(), headers=headers
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        reply = json.load(response)
    console.print(f"[bold]user:[/bold] {prompt}")
    console.print(f"[bold]assistant:[/bold] {reply['choices'][0]['message']['content']}")


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
    max_num_seqs: Annotated[int, typer.Option(help="Requests per engine batch.")] = 64,
    chunked_prefill: Annotated[bool, typer.Option(help="Split long prompts over steps.")] = True,
    spec: SpecOpt = None,
    draft_model: DraftModelOpt = None,
    spec_cost_aware: SpecCostOpt = True,
    quantization: QuantOpt = None,
    quant_group_size: GroupSizeOpt = 32,
    kernel_routes: KernelRoutesOpt = "auto",
    attention_backend: AttentionBackendOpt = "auto",
    cuda_graphs: CudaGraphsOpt = True,
    on_transfer_failure: Annotated[str, typer.Option(help="decode: local | fail")] = "local",
    transfer_timeout: Annotated[
        float,
        typer.Option(
            help="decode: seconds a KV transfer may take; renewed while the prefill worker "
            "still holds the request unstarted."
        ),
    ] = TransferConfig.timeout_s,
    channel: Annotated[str, typer.Option(help="prefill: KV channel auto|grpc|pair|shm")] = "auto",
    stream_layers: Annotated[bool, typer.Option(help="prefill: layer-wise streaming.")] = True,
    engine: Annotated[str, typer.Option(help="real | sim (modelled step times).")] = "real",
    sim_profile: Annotated[
        str | None, typer.Option(help="sim: profile JSON (tandem bench calibrate).")
    ] = None,
    tp: TPOpt = 1,
    tp_timeout: Annotated[
        float | None,
        typer.Option(
            help="--tp: seconds a collective waits for a rank before the step fails; below "
            "--ttl (default: half of it)."
        ),
    ] = None,
) -> None:
    """One worker: `prefill` computes prompts and pushes their KV to decode workers; `decode`
    receives it and generates, with speculative decoding. SIGTERM drains it. With `--tp N` it
    is N local processes, this one rank 0; a rank that dies takes it out of the registry and
    ends it (exit code 1), for its supervisor to start again."""
    from tandem.cluster.workers import build_worker
    from tandem.config import WorkerConfig
    from tandem.drain_signal import drain_signal

    if role not in ("prefill", "decode"):
        raise typer.BadParameter("must be prefill or decode", param_hint="ROLE")
    stop = drain_signal()  # before registering: a signal during startup still drains
    config = worker_engine_config(
        role, model, dtype, device, spec, draft_model, spec_cost_aware,
        memory_gib=kv_memory_gib, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
        num_threads=num_threads, max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=chunked_prefill, engine=engine, sim_profile=sim_profile,
        quantization=quantization, quant_group_size=quant_group_size,
        kernel_routes=kernel_routes, attention_backend=attention_backend,
        cuda_graphs=cuda_graphs, tensor_parallel_size=tp,
        tp_timeout_s=tp_timeout if tp_timeout is not None else ttl / 2,
    )  # fmt: skip
    transfer = TransferConfig(
        channel=channel,
        stream_layers=stream_layers,
        on_failure=on_transfer_failure,
        timeout_s=transfer_timeout,
    )
    try:  # a bad configuration (e.g. a TP size the model cannot split) names its field
        server = build_worker(
            role,
            WorkerConfig(config, transfer, host, port, redis, metrics_port, heartbeat_ttl_s=ttl),
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    console.print(f"{role} worker {server.worker_id} on {server.endpoint}")
    if not server.serve_until(stop):
        raise typer.Exit(1)  # a rank died: the supervisor starts the worker again


def worker_engine_config(
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

    speculative = speculative_option(spec, draft_model, cost_aware=spec_cost_aware)
    if role == "prefill":
        speculative = prefill_speculative(speculative)
    return EngineConfig.create(model, speculative, dtype=dtype, device=device, **flat)
