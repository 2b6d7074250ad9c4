"""`tandem bench router`: the router's own cost, on a zero-cost sim cluster (0P1D by default).

Method: a sim decode worker whose steps take no modelled time (all-zero SimProfile) and a
`tandem router` process; the client (this process, grpc.aio) sends token-id prompts shorter than
the router's local-prefill threshold, so every request goes router -> decode worker (local
prefill) and back.

- Added latency: the same requests one at a time, alternately (a) straight to the decode worker's
  `Decode` RPC and (b) through the router's `Generate`; added = p50(b) - p50(a) (and p99).
- Max rate: `concurrency` requests in flight through the router for `duration_s`; completed
  requests per second. The same load straight to the decode worker is reported beside it (the
  ceiling of the worker and of this client on this machine).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass
from typing import Any

import grpc
from rich.console import Console
from rich.table import Table

from tandem.bench.sim_cluster import SimCluster
from tandem.v1 import api_pb2, api_pb2_grpc
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wpb_grpc


@dataclass(frozen=True)
class RouterBenchConfig:
    model: str = "smollm2-135m"
    prompt_tokens: int = 16
    max_tokens: int = 1
    latency_requests: int = 300
    concurrency: tuple[int, ...] = (16, 64)
    duration_s: float = 5.0


def _prompt(i: int, n: int) -> list[int]:
    return [(100 + 13 * i + 7 * j) % 1000 + 10 for j in range(n)]


async def _via_router(stub: Any, i: int, cfg: RouterBenchConfig) -> None:
    req = api_pb2.GenerateRequest(
        prompt_token_ids=api_pb2.TokenIds(ids=_prompt(i, cfg.prompt_tokens)),
        sampling=api_pb2.SamplingOptions(max_tokens=cfg.max_tokens, ignore_eos=True),
    )
    async for _ in stub.Generate(req, timeout=30):
        pass


async def _direct(stub: Any, i: int, cfg: RouterBenchConfig) -> None:
    req = wpb.DecodeRequest(
        request=wpb.WorkerRequest(
            request_id=f"direct-{i}-{time.monotonic_ns()}",
            prompt_token_ids=_prompt(i, cfg.prompt_tokens),
            sampling=api_pb2.SamplingOptions(max_tokens=cfg.max_tokens, ignore_eos=True),
        ),
        local_prefill=True,
    )
    async for _ in stub.Decode(req, timeout=30):
        pass


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _measure(cluster: SimCluster, decode_endpoint: str, cfg: RouterBenchConfig) -> Any:
    async with (
        grpc.aio.insecure_channel(cluster.grpc_target) as rch,
        grpc.aio.insecure_channel(decode_endpoint) as dch,
    ):
        router = api_pb2_grpc.TandemStub(rch)
        decode = wpb_grpc.DecodeWorkerStub(dch)
        calls = {"router": router, "direct": decode}
        fns = {"router": _via_router, "direct": _direct}
        for i in range(30):  # warm-up
            await _via_router(router, i, cfg)
            await _direct(decode, i, cfg)
        lat: dict[str, list[float]] = {"router": [], "direct": []}
        for i in range(cfg.latency_requests):
            for name in ("direct", "router"):
                t0 = time.perf_counter()
                await fns[name](calls[name], i, cfg)
                lat[name].append(time.perf_counter() - t0)
        rates: list[dict[str, Any]] = []
        for conc in cfg.concurrency:
            for name in ("direct", "router"):
                done = 0
                errors = 0
                stop_at = time.perf_counter() + cfg.duration_s

                async def client(k: int, name: str = name, stop_at: float = stop_at) -> None:
                    nonlocal done, errors
                    i = k * 1_000_000
                    while time.perf_counter() < stop_at:
                        try:
                            await fns[name](calls[name], i, cfg)
                            done += 1
                        except grpc.aio.AioRpcError:
                            errors += 1
                        i += 1

                t0 = time.perf_counter()
                await asyncio.gather(*(client(k) for k in range(conc)))
                elapsed = time.perf_counter() - t0
                rates.append(
                    {"path": name, "concurrency": conc, "req_s": done / elapsed, "errors": errors}
                )
        return lat, rates


def run_router_bench(cfg: RouterBenchConfig, console: Console) -> dict[str, Any]:
    cluster = SimCluster(cfg.model, None, num_prefill=0, num_decode=1, procs=1)
    console.print("[dim]starting a zero-cost sim decode worker and a router...[/dim]")
    cluster.start()
    try:
        assert cluster.registry is not None
        (d,) = cluster.registry.workers(model=cfg.model, role="decode")
        lat, rates = asyncio.run(_measure(cluster, d.endpoint, cfg))
    finally:
        cluster.stop()
    direct, routed = lat["direct"], lat["router"]
    added_p50 = statistics.median(routed) - statistics.median(direct)
    added_p99 = _pct(routed, 0.99) - _pct(direct, 0.99)
    best = max((r["req_s"] for r in rates if r["path"] == "router"), default=0.0)
    table = Table(title="router overhead (zero-cost sim decode worker, local prefill)")
    for col in ("", "p50 ms", "p99 ms"):
        table.add_column(col, justify="right")
    table.add_row(
        "direct to D", f"{statistics.median(direct) * 1e3:.2f}", f"{_pct(direct, 0.99) * 1e3:.2f}"
    )
    table.add_row(
        "via router", f"{statistics.median(routed) * 1e3:.2f}", f"{_pct(routed, 0.99) * 1e3:.2f}"
    )
    table.add_row("added", f"{added_p50 * 1e3:.2f}", f"{added_p99 * 1e3:.2f}")
    console.print(table)
    rt = Table(title=f"throughput ({cfg.duration_s:.0f} s per point)")
    for col in ("path", "concurrency", "req/s", "errors"):
        rt.add_column(col, justify="right")
    for r in rates:
        rt.add_row(r["path"], str(r["concurrency"]), f"{r['req_s']:.0f}", str(r["errors"]))
    console.print(rt)
    ok_lat = "[green]meets[/green]" if added_p50 < 0.002 else "[red]misses[/red]"
    ok_rate = "[green]meets[/green]" if best >= 500 else "[red]misses[/red]"
    console.print(f"added p50 {added_p50 * 1e3:.2f} ms: {ok_lat} the < 2 ms target")
    console.print(f"max {best:.0f} req/s through the router: {ok_rate} the >= 500 req/s target")
    return {
        "added_p50_s": added_p50,
        "added_p99_s": added_p99,
        "direct_p50_s": statistics.median(direct),
        "router_p50_s": statistics.median(routed),
        "max_router_req_s": best,
        "rates": rates,
    }
