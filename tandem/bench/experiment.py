"""`tandem bench experiment pd|spec`: two side-by-side experiments, each on fresh local clusters
(`LocalCluster`, router in this process), driven by the `tandem bench serve`
harness over gRPC (exact tokens per streamed message; the harness's summaries, server-side deltas
and KV leak check). Metric names and percentiles are those of BENCHMARKS.md (`serving_metrics`).

pd: prefill/decode interference
-------------------------------
One seeded pool, the same for every deployment (the `interference` workload of `bench serve`):
`num_short` short requests (random token ids, EOS ignored so lengths are exact) and `num_long`
long prompts. The short ones run in a closed loop at `concurrency` (that many in flight, always);
the long ones come on top of that loop, outside its slots: long prompt j is sent the moment short
request k_j starts, the k_j spread evenly over the shorts after the first and before the last
`concurrency` of them. Every deployment thus sees the same inputs in the same order, and the short
requests in flight are the same number with and without the long ones.

Deployments (each a fresh cluster):

- colocated, no chunked prefill: 0P1D, `--no-chunked-prefill` (a step budget that fits a long
  prompt next to every short one): a long prompt is prefilled in one step and every running
  decode waits for it. The contrast of the BENCHMARKS.md target.
- colocated, chunked prefill: 0P1D, `--max-num-batched-tokens chunk_tokens`: long prompts are cut
  into chunks that share steps with the decodes.
- 1P1D long-on-P: one prefill and one decode worker; the router prefills prompts up to
  `local_prefill_tokens` (default 256: every short prompt, no long one) on D, the long ones on P,
  whose KV then moves to D. D's load is the same with and without the long prompts.
- 1P1D all-on-P: the same workers, `local_prefill_tokens` 0: every prompt is prefilled on P. A
  short prompt that arrives while P computes a long one waits for it (TTFT), and D's batch
  thins out meanwhile, which lowers TPOT for a reason that is not isolation: read the two 1P1D
  rows together.

Threads: a deployment gets `cores` torch threads in all. The single worker of a colocated
deployment gets all of them; each 1P1D worker gets cores // 2 (at least 1), so P and D each have
one core of this 2-core machine. Nothing is pinned (no CPU affinity): the router and the client
(this process) share the cores with the workers, and on a shared machine so does everything else.

Per deployment: a warm-up of short requests (not measured), then `rounds` rounds of two passes:
the short requests alone (baseline, uninterfered) and the short ones with the long ones mixed in
(interfered). The figure of merit is the BENCHMARKS.md target, on the same deployment:
p99 TPOT(short, interfered) / p99 TPOT(short, baseline) <= 1.3. With several rounds each round
gives a ratio; the reported one is their median.

spec: speculative decoding on vs off
------------------------------------
Two 0P1D clusters alive side by side, identical but for `--spec ngram` on the decode worker (all
`cores` threads each; the idle one waits). For each workload (Spec-Bench first turns as chat:
input-grounded = summarization, rag; chat = the eight MT-bench categories) and concurrency
(closed loop), the same requests go to the spec-off cluster, then to the spec-on one (A B A B).
Each concurrency point takes the next slice of the seeded pool, so a point does not find the
previous point's prompts in the prefix cache. Greedy (temperature 0), EOS honoured, at most
`output_len` new tokens; the outputs of the two sides are compared token for token (batching can
change a near tie even without speculation: the count of identical outputs is reported, not
assumed). Reported per point: output tok/s over the window, TPOT, the on/off ratios, and the
acceptance of the decode worker (server-side deltas: acceptance rate = accepted / draft tokens;
mean acceptance length = 1 + accepted / drafts).

Outputs with `out`: results.json (config, machine, git commit, every pass's summaries by tag,
server deltas, leak checks, the table rows and the target checks), requests.jsonl (every request),
inputs.jsonl (the pool) and pd.png / spec.png.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
from rich import box
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from router.router_server import RouterAddress
from tandem.bench.common import BenchError, passive_omp
from tandem.bench.machine import machine_info
from tandem.bench.report import pyplot, save_chart
from tandem.bench.serve import (
    GrpcClient,
    HttpClient,
    ModelInfo,
    ServerMetrics,
    model_info,
    run_point,
    server_deltas,
    summarize_point,
)
from tandem.bench.serve_config import PointResult, ServeConfig
from tandem.bench.serving_metrics import Stats, Summary, Timeline, summarize
from tandem.bench.workloads import (
    BenchRequest,
    LengthDist,
    LoadPoint,
    Sent,
    WorkloadConfig,
    WorkloadError,
    build_workload,
    drive,
)
from tandem.cluster.local_cluster import LocalCluster
from tandem.config import DEFAULT_MODEL, RouterConfig

TPOT_RATIO_TARGET = 1.3  # BENCHMARKS.md: disaggregated 1P1D under long-prompt interference
SPEC_BATCH1_TARGET = 2.0  # BENCHMARKS.md: n-gram, batch 1, input-grounded prompts
MT_BENCH = "writing,roleplay,reasoning,math,coding,extraction,stem,humanities"
PERCENTILES = "linear interpolation between closest ranks (numpy 'linear')"
_WARMUP_TOKENS = 4


# --- clusters and the client ---------------------------------------------------------------


@dataclass(frozen=True)
class Deployment:
    """One cluster layout: its workers' options and the router's local-prefill threshold."""

    name: str
    description: str
    num_prefill: int
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    local_prefill_tokens: int = 32

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@contextmanager
def local_cluster(
    model: str, deployment: Deployment, worker_args: Sequence[str], timeout_s: float
) -> Iterator[RouterAddress]:
    """A fresh LocalCluster (1 decode worker, `num_prefill` prefill workers) on free ports."""
    cluster = LocalCluster(
        model,
        num_prefill=deployment.num_prefill,
        num_decode=1,
        http_port=0,
        grpc_port=0,
        worker_args=list(worker_args),
        prefill_args=list(deployment.prefill_args),
        decode_args=list(deployment.decode_args),
        router=RouterConfig(model, local_prefill_tokens=deployment.local_prefill_tokens),
    )
    try:
        with passive_omp():
            address = cluster.start(timeout_s=timeout_s)
        yield address
    finally:
        cluster.stop(grace_s=10.0)


class TokenGrpcClient(GrpcClient):
    """The harness's gRPC client, also keeping each request's output token ids
    (`extra["token_ids"]`) so that greedy outputs can be compared across clusters."""

    keep_token_ids = True


@dataclass
class Session:
    """The clients of one cluster for one asyncio run."""

    config: ServeConfig
    http: HttpClient
    client: TokenGrpcClient
    server: ServerMetrics


def serve_config(address: RouterAddress, workload: WorkloadConfig, timeout_s: float) -> ServeConfig:
    return ServeConfig(
        url=address.http_url,
        grpc=address.grpc_target,
        workload=workload,
        temperature=0.0,
        timeout_s=timeout_s,
        leak_wait_s=30.0,
        plots=False,
    )


@asynccontextmanager
async def open_session(config: ServeConfig) -> AsyncIterator[Session]:
    http = HttpClient(config)
    client = TokenGrpcClient(config)
    server = ServerMetrics(config, http)
    try:
        yield Session(config, http, client, server)
    finally:
        await server.close()
        await client.close()
        await http.close()


async def warm_up(session: Session, requests: Sequence[BenchRequest]) -> None:
    """Send these requests at once, each cut to a few tokens; not measured. Raises BenchError
    when one fails (the cluster does not serve)."""
    cut = [replace(r, max_tokens=min(r.max_tokens, _WARMUP_TOKENS)) for r in requests]
    timelines = [Timeline(send_time=0.0) for _ in cut]
    await asyncio.gather(*(session.client.send(r, t) for r, t in zip(cut, timelines, strict=True)))
    errors = sorted({t.error for t in timelines if t.error is not None})
    if errors:
        raise BenchError(f"warm-up requests failed: {', '.join(errors)}")


async def _measure(
    session: Session, point: LoadPoint, run: Awaitable[list[Sent]], label: str
) -> tuple[PointResult, dict[str, Any]]:
    """Scrape the servers, await `run` (a coroutine returning the Sents), summarise, then wait
    for the workers to settle and take the server-side deltas."""
    before = await session.server.scrape()
    load_before = os.getloadavg()
    start = time.perf_counter()
    sents = await run
    result = summarize_point(point, sents, session.config, start)
    after, check = await session.server.settle(session.config.leak_wait_s)
    result.report["server"] = server_deltas(before, after)
    result.report["kv_leak_check"] = check
    result.report["label"] = label
    extra = {"loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    return result, extra


def tag_summaries(sents: Sequence[Sent]) -> dict[str, Summary]:
    tags = sorted({s.request.tag for s in sents})
    return {tag: summarize([s.timeline for s in sents if s.request.tag == tag]) for tag in tags}


def _ms(stats: Stats | None, q: str) -> float | None:
    return None if stats is None else float(getattr(stats, q)) * 1e3


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _fmt_ms(value: float | None) -> str:
    """Milliseconds: no decimals from 100 up."""
    return _fmt(value, ".0f" if value is not None and value >= 100 else ".1f")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _requests_lines(label: dict[str, Any], result: PointResult) -> list[str]:
    return [json.dumps({**label, **record}) for record in result.report["requests"]]


def _write_jsonl(path: Path, lines: Sequence[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines))


# --- pd: prefill/decode interference -------------------------------------------------------


@dataclass(frozen=True)
class PdConfig:
    model: str = DEFAULT_MODEL
    num_short: int = 32
    num_long: int = 4
    short_input_len: str = "uniform(64,128)"
    short_output_len: str = "32"
    long_input_len: str = "uniform(1536,2048)"
    long_output_len: str = "8"
    concurrency: int = 4  # short requests in flight (closed loop)
    chunk_tokens: int = 256  # colocated chunked: the step budget
    local_prefill_tokens: int = 256  # 1P1D long-on-P: prompts up to this long stay on D
    cores: int = 2  # torch threads per deployment
    dtype: str = "float32"
    kv_memory_gib: float = 1.0
    rounds: int = 1
    seed: int = 0
    timeout_s: float = 600.0  # per request
    startup_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("num_long", "concurrency", "chunk_tokens", "cores", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_short < 2 * self.concurrency:
            raise ValueError(
                f"num_short must be >= 2 x concurrency ({2 * self.concurrency}), "
                f"got {self.num_short}"
            )
        if self.local_prefill_tokens < 0:
            raise ValueError("local_prefill_tokens must be >= 0")
        for name in ("short_input_len", "short_output_len", "long_input_len", "long_output_len"):
            LengthDist.parse(getattr(self, name))
        if LengthDist.parse(self.short_output_len).lower < 2:
            raise ValueError("short_output_len must be >= 2 tokens (TPOT needs two)")
        if self.local_prefill_tokens >= LengthDist.parse(self.long_input_len).lower:
            raise ValueError("local_prefill_tokens must be below the long prompts' length")

    def quick(self) -> PdConfig:
        """A pipeline check (the tiny test model: 512 positions), not a measurement."""
        return replace(
            self,
            num_short=8,
            num_long=2,
            short_input_len="uniform(16,32)",
            short_output_len="8",
            long_input_len="uniform(256,320)",
            long_output_len="4",
            concurrency=2,
            chunk_tokens=64,
            local_prefill_tokens=64,
            rounds=1,
        )

    @property
    def workload(self) -> WorkloadConfig:
        n = self.num_short + self.num_long
        return WorkloadConfig(
            "interference",
            num_requests=n,
            input_len=self.short_input_len,
            output_len=self.short_output_len,
            long_fraction=self.num_long / n,
            long_input_len=self.long_input_len,
            long_output_len=self.long_output_len,
            seed=self.seed,
        )

    @property
    def no_chunk_budget(self) -> int:
        """A step budget that fits the longest long prompt next to every short request."""
        longest = LengthDist.parse(self.long_input_len).upper
        return max(2048, longest + self.concurrency * LengthDist.parse(self.short_input_len).upper)

    @property
    def worker_args(self) -> list[str]:
        return ["--dtype", self.dtype, "--kv-memory-gib", str(self.kv_memory_gib)]


def pd_deployments(config: PdConfig) -> list[Deployment]:
    split = str(max(1, config.cores // 2))
    cores = str(config.cores)
    return [
        Deployment(
            "colocated no-chunk",
            f"0P1D, {cores} threads, --no-chunked-prefill, "
            f"--max-num-batched-tokens {config.no_chunk_budget}",
            0,
            decode_args=(
                "--num-threads",
                cores,
                "--no-chunked-prefill",
                "--max-num-batched-tokens",
                str(config.no_chunk_budget),
            ),
        ),
        Deployment(
            "colocated chunked",
            f"0P1D, {cores} threads, chunked prefill, --max-num-batched-tokens "
            f"{config.chunk_tokens}",
            0,
            decode_args=(
                "--num-threads",
                cores,
                "--max-num-batched-tokens",
                str(config.chunk_tokens),
            ),
        ),
        Deployment(
            "1P1D long-on-P",
            f"1 prefill + 1 decode worker, {split} thread(s) each, router "
            f"local_prefill_tokens={config.local_prefill_tokens}",
            1,
            prefill_args=("--num-threads", split),
            decode_args=("--num-threads", split),
            local_prefill_tokens=config.local_prefill_tokens,
        ),
        Deployment(
            "1P1D all-on-P",
            f"1 prefill + 1 decode worker, {split} thread(s) each, router local_prefill_tokens=0",
            1,
            prefill_args=("--num-threads", split),
            decode_args=("--num-threads", split),
            local_prefill_tokens=0,
        ),
    ]


def salted(requests: Sequence[BenchRequest], salt: int, vocab_size: int) -> list[BenchRequest]:
    """The requests with their first prompt token shifted by `salt`: the same lengths and the
    same work, but no block of them is in a prefix cache filled by another pass."""
    return [
        replace(
            r,
            prompt_token_ids=((r.prompt_token_ids[0] + salt) % vocab_size, *r.prompt_token_ids[1:]),
        )
        for r in requests
    ]


def long_schedule(num_short: int, num_long: int, concurrency: int) -> list[int]:
    """k_j: long prompt j is sent when short request k_j starts; evenly spread over the shorts
    after the first and before the last `concurrency`."""
    span = max(num_short - 2 * concurrency, 1)
    return [concurrency + int((j + 0.5) * span / num_long) for j in range(num_long)]


async def send_mixed(
    client: GrpcClient,
    shorts: Sequence[BenchRequest],
    longs: Sequence[BenchRequest],
    concurrency: int,
) -> list[Sent]:
    """The shorts in a closed loop at `concurrency`; the longs on top, each sent as its short
    request starts (`long_schedule`). No longs: the uninterfered baseline."""
    due: dict[int, list[BenchRequest]] = {}
    for k, long in zip(long_schedule(len(shorts), len(longs), concurrency), longs, strict=True):
        due.setdefault(shorts[k].index, []).append(long)
    pending: list[asyncio.Task[Sent]] = []

    async def send_long(request: BenchRequest) -> Sent:
        timeline = Timeline(send_time=time.perf_counter())
        arrival = timeline.send_time
        extra = await client.send(request, timeline)
        return Sent(0, request, arrival, timeline, extra)

    async def send_short(request: BenchRequest, timeline: Timeline) -> dict[str, Any]:
        for long in due.get(request.index, ()):
            pending.append(asyncio.create_task(send_long(long)))
        return await client.send(request, timeline)

    point = LoadPoint(concurrency=concurrency)
    sents = await drive(((0.0, r) for r in shorts), send_short, point)
    sents += await asyncio.gather(*pending)
    sents.sort(key=lambda s: s.timeline.send_time)
    for seq, s in enumerate(sents):
        s.seq = seq
    return sents


@dataclass
class PdPass:
    kind: str  # "baseline" | "interfered"
    round: int
    result: PointResult
    by_tag: dict[str, Summary]
    extra: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        report = {k: v for k, v in self.result.report.items() if k != "requests"}
        return {
            "kind": self.kind,
            "round": self.round,
            "by_tag": {tag: asdict(s) for tag, s in self.by_tag.items()},
            **self.extra,
            **report,
        }


@dataclass
class PdRun:
    deployment: Deployment
    passes: list[PdPass] = field(default_factory=list)

    def passes_of(self, kind: str) -> list[PdPass]:
        return [p for p in self.passes if p.kind == kind]


async def pd_deployment(
    config: PdConfig, deployment: Deployment, address: RouterAddress, console: Console
) -> tuple[PdRun, ModelInfo, list[BenchRequest]]:
    serve = serve_config(address, config.workload, config.timeout_s)
    async with open_session(serve) as session:
        info = await model_info(serve, session.http, session.client)
        pool = build_workload(config.workload, info.vocab_size, info.max_model_len)
        shorts = [r for r in pool if r.tag == "short"]
        longs = [r for r in pool if r.tag == "long"]
        await warm_up(session, shorts[: config.concurrency])
        run = PdRun(deployment)
        point = LoadPoint(concurrency=config.concurrency)
        vocab = info.vocab_size or 1
        for round_ in range(config.rounds):
            for kind, mixed in (("baseline", ()), ("interfered", longs)):
                salt = len(run.passes) + 1  # warm-up: 0
                label = f"{deployment.name} {kind} r{round_}"
                console.print(f"  {label} ...")
                sending = send_mixed(
                    session.client,
                    salted(shorts, salt, vocab),
                    salted(mixed, salt, vocab),
                    config.concurrency,
                )
                result, extra = await _measure(session, point, sending, label)
                run.passes.append(PdPass(kind, round_, result, tag_summaries(result.sents), extra))
        return run, info, pool


def pd_ratio(run: PdRun) -> dict[str, Any]:
    """p99 TPOT(short, interfered) / p99 TPOT(short, baseline), per round and their median."""
    per_round = []
    for base, hit in zip(run.passes_of("baseline"), run.passes_of("interfered"), strict=True):
        b, i = base.by_tag["short"].tpot, hit.by_tag["short"].tpot
        per_round.append(_ratio(i.p99 if i else None, b.p99 if b else None))
    ratio = _median(per_round)
    return {
        "p99_tpot_ratio": ratio,
        "per_round": per_round,
        "at_most": TPOT_RATIO_TARGET,
        "meets": ratio is not None and ratio <= TPOT_RATIO_TARGET,
    }


def pd_rows(runs: Sequence[PdRun]) -> list[dict[str, Any]]:
    """One row per deployment, pass kind and tag (the last round's pass of each kind)."""
    rows = []
    for run in runs:
        for kind in ("baseline", "interfered"):
            p = run.passes_of(kind)[-1]
            timings = p.result.report.get("server_timings") or {}
            for tag, s in p.by_tag.items():
                via_p = sum(
                    1
                    for x in p.result.sents
                    if x.request.tag == tag and (x.extra.get("server") or {}).get("prefill_worker")
                )
                rows.append(
                    {
                        "deployment": run.deployment.name,
                        "pass": kind,
                        "tag": tag,
                        "n": s.num_requests,
                        "ok": s.num_ok,
                        "ttft_p50_ms": _ms(s.ttft, "p50"),
                        "ttft_p99_ms": _ms(s.ttft, "p99"),
                        "tpot_p50_ms": _ms(s.tpot, "p50"),
                        "tpot_p99_ms": _ms(s.tpot, "p99"),
                        "itl_max_ms": _ms(s.itl_token, "max"),
                        "prefilled_on_p": via_p if timings else None,
                    }
                )
    return rows


_KIND_LABELS = {
    ("baseline", "short"): "short alone",
    ("interfered", "short"): "short +long",
    ("interfered", "long"): "long",
}


def pd_table(rows: Sequence[dict[str, Any]]) -> Table:
    table = Table(
        title="pd: latency of the short and long requests by deployment (ms)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        collapse_padding=True,
        pad_edge=False,
    )
    table.add_column("deployment", no_wrap=True)
    table.add_column("requests", no_wrap=True)
    for name in ("n", "TTFT p50/p99", "TPOT p50/p99", "max ITL", "P"):
        table.add_column(name, justify="right", no_wrap=True)
    for r in rows:
        ttft = f"{_fmt(r['ttft_p50_ms'], '.0f')} / {_fmt(r['ttft_p99_ms'], '.0f')}"
        tpot = f"{_fmt_ms(r['tpot_p50_ms'])} / {_fmt_ms(r['tpot_p99_ms'])}"
        on_p = "-" if r["prefilled_on_p"] is None else str(r["prefilled_on_p"])
        table.add_row(
            r["deployment"],
            _KIND_LABELS[r["pass"], r["tag"]],
            f"{r['ok']}/{r['n']}",
            ttft,
            tpot,
            _fmt(r["itl_max_ms"], ".0f"),
            on_p,
        )
    return table


def pd_ratio_table(runs: Sequence[PdRun]) -> Table:
    table = Table(
        title=f"pd: p99 TPOT of the short requests, with / without the long ones "
        f"(target <= {TPOT_RATIO_TARGET}x on 1P1D)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    table.add_column("deployment")
    for name in ("baseline p99", "interfered p99", "ratio", "<= 1.3x"):
        table.add_column(name, justify="right")
    for run in runs:
        ratio = pd_ratio(run)
        b = run.passes_of("baseline")[-1].by_tag["short"].tpot
        i = run.passes_of("interfered")[-1].by_tag["short"].tpot
        table.add_row(
            run.deployment.name,
            _fmt(_ms(b, "p99")),
            _fmt(_ms(i, "p99")),
            _fmt(ratio["p99_tpot_ratio"], ".2f") + "x",
            "[green]yes[/green]" if ratio["meets"] else "[red]no[/red]",
        )
    return table


def pd_targets(runs: Sequence[PdRun]) -> list[dict[str, Any]]:
    disaggregated = [r for r in runs if r.deployment.num_prefill > 0]
    return [
        {
            "target": "disaggregated 1P1D under long-prompt interference: p99 TPOT <= 1.3x the "
            "uninterfered p99 TPOT",
            "deployment": r.deployment.name,
            **pd_ratio(r),
        }
        for r in disaggregated
    ]


def plot_pd(path: Path, rows: Sequence[dict[str, Any]], ratios: dict[str, float | None]) -> Path:
    """Bars of p50/p99 TTFT and TPOT per deployment (`rows` of `pd_rows`), and the p99 TPOT
    ratio per deployment name."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    names = list(ratios)
    ticks = [n.replace(" ", "\n", 1) for n in names]
    series = (
        ("baseline", "short", "short, uninterfered"),
        ("interfered", "short", "short, interfered"),
        ("interfered", "long", "long"),
    )
    panels = (("ttft", "TTFT (ms, log)"), ("tpot", "TPOT (ms)"))
    width = 0.13
    for ax, (metric, title) in zip(axes[:2], panels, strict=True):
        bar = 0
        for kind, tag, label in series:
            for q, hatch in (("p50", ""), ("p99", "//")):
                ys = [_row_value(rows, n, kind, tag, f"{metric}_{q}_ms") for n in names]
                xs = [i + (bar - 2.5) * width for i in range(len(names))]
                ax.bar(
                    xs,
                    ys,
                    width,
                    label=f"{label} {q}",
                    hatch=hatch,
                    color=f"C{series.index((kind, tag, label))}",
                    alpha=0.55 if q == "p50" else 0.9,
                )
                bar += 1
        ax.set_xticks(range(len(names)), ticks, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        if metric == "ttft":
            ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    values = [v if v is not None else float("nan") for v in ratios.values()]
    colors = ["tab:green" if v <= TPOT_RATIO_TARGET else "tab:red" for v in values]
    axes[2].bar(range(len(names)), values, color=colors, alpha=0.8)
    axes[2].axhline(TPOT_RATIO_TARGET, color="k", linestyle="--", label="target 1.3x")
    for i, v in enumerate(values):
        axes[2].annotate(
            f"{v:.2f}x",
            (i, v),
            ha="center",
            va="bottom",
            fontsize=8,
            xytext=(0, 3),
            textcoords="offset points",
        )
    axes[2].set_xticks(range(len(names)), ticks, fontsize=8)
    axes[2].set_title("p99 TPOT short: with / without the long prompts", fontsize=10)
    axes[2].legend(fontsize=8)
    axes[2].grid(axis="y", alpha=0.3)
    title = "prefill/decode interference (closed loop of short requests + long prompts)"
    save_chart(fig, title, path, dpi=110)
    return path


def _row_value(
    rows: Sequence[dict[str, Any]], deployment: str, kind: str, tag: str, key: str
) -> float:
    for r in rows:
        if (r["deployment"], r["pass"], r["tag"]) == (deployment, kind, tag):
            value = r[key]
            return float(value) if value is not None else float("nan")
    return float("nan")


def run_pd(config: PdConfig, out: Path | None, console: Console) -> dict[str, Any]:
    """Run the three deployments one after the other; print the tables; write the outputs."""
    deployments = pd_deployments(config)
    console.print(
        f"[bold]experiment pd[/bold] {config.model}: {config.num_short} short + "
        f"{config.num_long} long requests, short concurrency {config.concurrency}, "
        f"{config.rounds} round(s), {len(deployments)} deployments"
    )
    runs: list[PdRun] = []
    info: ModelInfo | None = None
    pool: list[BenchRequest] = []
    for d in deployments:
        console.print(f"[bold]{d.name}[/bold]: {d.description}")
        with local_cluster(config.model, d, config.worker_args, config.startup_timeout_s) as addr:
            try:
                run, info, pool = asyncio.run(pd_deployment(config, d, addr, console))
            except (grpc.aio.AioRpcError, WorkloadError) as e:
                raise BenchError(f"{d.name}: {type(e).__name__}: {e}") from None
        runs.append(run)
    assert info is not None
    rows = pd_rows(runs)
    report = {
        "benchmark": "experiment-pd",
        "config": asdict(config),
        "machine": {**machine_info(), "loadavg_end": os.getloadavg()},
        "model": asdict(info),
        "percentiles": PERCENTILES,
        "long_schedule": long_schedule(config.num_short, config.num_long, config.concurrency),
        "deployments": [
            {
                **r.deployment.to_json(),
                "worker_args": config.worker_args,
                "ratio": pd_ratio(r),
                "passes": [p.to_json() for p in r.passes],
            }
            for r in runs
        ],
        "rows": rows,
        "targets": pd_targets(runs),
    }
    console.print(pd_table(rows))
    console.print(pd_ratio_table(runs))
    _print_leaks(console, [p.result for r in runs for p in r.passes])
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        _write_jsonl(out / "inputs.jsonl", [json.dumps(r.to_json()) for r in pool])
        lines = [
            line
            for r in runs
            for p in r.passes
            for line in _requests_lines(
                {"deployment": r.deployment.name, "pass": p.kind, "round": p.round}, p.result
            )
        ]
        _write_jsonl(out / "requests.jsonl", lines)
        ratios = {r.deployment.name: pd_ratio(r)["p99_tpot_ratio"] for r in runs}
        plot_pd(out / "pd.png", rows, ratios)
        console.print(f"[dim]wrote {out}[/dim]")
    return report


def _print_leaks(console: Console, results: Sequence[PointResult]) -> None:
    for r in results:
        status = r.report.get("kv_leak_check", {}).get("status")
        if status != "OK":
            console.print(f"[yellow]{r.report['label']}: KV leak check {status}[/yellow]")
        errors = r.summary.errors
        if errors:
            console.print(f"[red]{r.report['label']}: errors {errors}[/red]")


# --- spec: speculative decoding on vs off --------------------------------------------------


@dataclass(frozen=True)
class SpecExperimentConfig:
    model: str = DEFAULT_MODEL
    # (label, Spec-Bench categories)
    workloads: tuple[tuple[str, str], ...] = (
        ("input-grounded", "summarization,rag"),
        ("chat", MT_BENCH),
    )
    concurrencies: tuple[int, ...] = (1, 4, 16)
    output_len: int = 64  # max new tokens (EOS honoured)
    min_requests: int = 4  # per point: max(min_requests, 2 x concurrency), at most
    max_requests: int = 16  # max(max_requests, concurrency)
    cores: int = 2
    dtype: str = "float32"
    kv_memory_gib: float = 1.0
    rounds: int = 1
    seed: int = 0
    timeout_s: float = 600.0
    startup_timeout_s: float = 300.0
    # the spec-on worker drafts only as far as its measured step times pay (spec/cost.py); off:
    # at every step the acceptance and batch limits allow
    cost_aware: bool = True

    def __post_init__(self) -> None:
        if not self.workloads or not self.concurrencies:
            raise ValueError("need at least one workload and one concurrency")
        for name in ("output_len", "min_requests", "max_requests", "cores", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if any(c < 1 for c in self.concurrencies):
            raise ValueError(f"concurrencies must be >= 1, got {self.concurrencies}")
        if self.output_len < 2:
            raise ValueError("output_len must be >= 2 (TPOT needs two tokens)")
        for _, categories in self.workloads:
            WorkloadConfig(f"specbench:{categories}")

    def quick(self) -> SpecExperimentConfig:
        """A pipeline check with short prompts (they fit the tiny test model's 512 positions),
        not a measurement. The spec-on side drafts whether or not it pays: a tiny model's
        verify steps do not pay on a CPU, and the cost model would leave drafting, verification
        and their metrics unexercised."""
        return replace(
            self,
            workloads=(("qa", "qa"), ("humanities", "humanities")),
            concurrencies=(1, 2),
            output_len=8,
            min_requests=2,
            max_requests=2,
            rounds=1,
            cost_aware=False,
        )

    def requests_at(self, concurrency: int) -> int:
        return min(max(self.min_requests, 2 * concurrency), max(self.max_requests, concurrency))

    def workload(self, categories: str) -> WorkloadConfig:
        return WorkloadConfig(
            f"specbench:{categories}", output_len=str(self.output_len), seed=self.seed
        )

    @property
    def worker_args(self) -> list[str]:
        return [
            "--dtype",
            self.dtype,
            "--kv-memory-gib",
            str(self.kv_memory_gib),
            "--num-threads",
            str(self.cores),
        ]


SPEC_SIDES = ("off", "on")


def spec_deployments(cost_aware: bool = True) -> dict[str, Deployment]:
    spec = ("--spec", "ngram", *(() if cost_aware else ("--no-spec-cost-aware",)))
    return {
        "off": Deployment("spec off", "0P1D, no speculation", 0),
        "on": Deployment("spec on", f"0P1D, {' '.join(spec)} on the decode worker", 0, (), spec),
    }


@dataclass
class SpecPoint:
    workload: str
    concurrency: int
    round: int
    side: str  # off | on
    result: PointResult


def rotated(pool: Sequence[BenchRequest], offset: int) -> list[BenchRequest]:
    k = offset % len(pool)
    return [*pool[k:], *pool[:k]]


async def spec_points(
    config: SpecExperimentConfig, addresses: dict[str, RouterAddress], console: Console
) -> tuple[list[SpecPoint], dict[str, list[BenchRequest]]]:
    base = config.workload(config.workloads[0][1])
    sessions = {side: serve_config(addresses[side], base, config.timeout_s) for side in SPEC_SIDES}
    points: list[SpecPoint] = []
    pools: dict[str, list[BenchRequest]] = {}
    async with open_session(sessions["off"]) as off, open_session(sessions["on"]) as on:
        by_side = {"off": off, "on": on}
        for label, categories in config.workloads:
            pools[label] = build_workload(config.workload(categories))
        spare = pools[config.workloads[-1][0]][-1:]  # the last of a pool: sent last, if ever
        for session in by_side.values():
            await warm_up(session, spare)
        per_round = sum(map(config.requests_at, config.concurrencies))
        with Progress(console=console, transient=True) as progress:
            for round_ in range(config.rounds):
                offsets = dict.fromkeys(pools, round_ * per_round)
                for label, _ in config.workloads:
                    for c in config.concurrencies:
                        n = config.requests_at(c)
                        pool = rotated(pools[label], offsets[label])
                        offsets[label] += n
                        for side in SPEC_SIDES:
                            session = by_side[side]
                            serve = replace(session.config, max_requests=n)
                            load_before = os.getloadavg()
                            result = await run_point(
                                serve,
                                pool,
                                LoadPoint(concurrency=c),
                                session.client,
                                session.server,
                                progress,
                            )
                            result.report["label"] = f"{label} conc {c} {side} r{round_}"
                            result.report["loadavg_before"] = load_before
                            result.report["loadavg_after"] = os.getloadavg()
                            console.print(
                                f"  {result.report['label']}: "
                                f"{result.summary.output_throughput:.1f} tok/s"
                            )
                            points.append(SpecPoint(label, c, round_, side, result))
    return points, pools


def same_outputs(off: PointResult, on: PointResult) -> tuple[int, int]:
    """(identical, compared): greedy outputs of the same inputs, token for token."""
    a = {s.request.index: s.extra.get("token_ids") for s in off.sents if s.timeline.ok}
    b = {s.request.index: s.extra.get("token_ids") for s in on.sents if s.timeline.ok}
    common = sorted(set(a) & set(b))
    return sum(a[i] == b[i] for i in common), len(common)


def _acceptance(result: PointResult) -> dict[str, Any]:
    totals = (result.report.get("server") or {}).get("totals") or {}
    return {
        "acceptance_rate": totals.get("acceptance_rate"),
        "mean_acceptance_length": totals.get("mean_acceptance_length"),
        "draft_tokens": totals.get("spec_draft_tokens"),
        "accepted_tokens": totals.get("spec_accepted_tokens"),
    }


def spec_rows(points: Sequence[SpecPoint]) -> list[dict[str, Any]]:
    """One row per (workload, concurrency, round): both sides and the on/off ratios."""
    pairs: dict[tuple[str, int, int], dict[str, PointResult]] = {}
    for p in points:
        pairs.setdefault((p.workload, p.concurrency, p.round), {})[p.side] = p.result
    rows = []
    for (workload, c, round_), sides in pairs.items():
        off, on = sides["off"].summary, sides["on"].summary
        same, compared = same_outputs(sides["off"], sides["on"])
        tpot_off, tpot_on = _ms(off.tpot, "mean"), _ms(on.tpot, "mean")
        rows.append(
            {
                "workload": workload,
                "concurrency": c,
                "round": round_,
                "n": on.num_requests,
                "ok": min(off.num_ok, on.num_ok),
                "off_tok_s": off.output_throughput,
                "on_tok_s": on.output_throughput,
                "tok_s_ratio": _ratio(on.output_throughput, off.output_throughput),
                "off_tpot_mean_ms": tpot_off,
                "on_tpot_mean_ms": tpot_on,
                "off_tpot_p50_ms": _ms(off.tpot, "p50"),
                "on_tpot_p50_ms": _ms(on.tpot, "p50"),
                "off_tpot_p99_ms": _ms(off.tpot, "p99"),
                "on_tpot_p99_ms": _ms(on.tpot, "p99"),
                "tpot_speedup": _ratio(tpot_off, tpot_on),
                "off_ttft_p50_ms": _ms(off.ttft, "p50"),
                "on_ttft_p50_ms": _ms(on.ttft, "p50"),
                "identical_outputs": same,
                "compared_outputs": compared,
                **_acceptance(sides["on"]),
            }
        )
    return rows


def spec_table(rows: Sequence[dict[str, Any]]) -> Table:
    table = Table(
        title="spec: n-gram speculation off vs on (0P1D, greedy; TPOT: mean of requests, ms)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        collapse_padding=True,
        pad_edge=False,
    )
    table.add_column("workload", no_wrap=True)
    for name in ("conc", "tok/s off/on", "ratio", "TPOT off/on", "ratio", "accept", "len", "same"):
        table.add_column(name, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(
            r["workload"] + (f" r{r['round']}" if r["round"] else ""),
            str(r["concurrency"]),
            f"{_fmt(r['off_tok_s'])} / {_fmt(r['on_tok_s'])}",
            _fmt(r["tok_s_ratio"], ".2f") + "x",
            f"{_fmt_ms(r['off_tpot_mean_ms'])} / {_fmt_ms(r['on_tpot_mean_ms'])}",
            _fmt(r["tpot_speedup"], ".2f") + "x",
            _fmt(r["acceptance_rate"], ".0%"),
            _fmt(r["mean_acceptance_length"], ".2f"),
            f"{r['identical_outputs']}/{r['compared_outputs']}",
        )
    return table


def spec_medians(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """Per (workload, concurrency): the median over rounds of the on/off ratios."""
    keys = sorted({(r["workload"], r["concurrency"]) for r in rows}, key=lambda k: (k[0], k[1]))
    out = {}
    for key in keys:
        group = [r for r in rows if (r["workload"], r["concurrency"]) == key]
        out[key] = {
            "tok_s_ratio": _median([r["tok_s_ratio"] for r in group]),
            "tpot_speedup": _median([r["tpot_speedup"] for r in group]),
            "rounds": len(group),
        }
    return out


def spec_targets(
    config: SpecExperimentConfig, rows: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The BENCHMARKS.md target this experiment can check: n-gram speculation at batch 1 on the
    input-grounded prompts >= 2x Tandem without it (on output tok/s; TPOT given beside)."""
    medians = spec_medians(rows)
    out = []
    for (workload, c), m in medians.items():
        if workload == "input-grounded" and c == 1:
            ratio = m["tok_s_ratio"]
            out.append(
                {
                    "target": "speculative, batch 1, input-grounded prompts, n-gram: >= 2x "
                    "without speculation (output tok/s)",
                    "tok_s_ratio": ratio,
                    "tpot_speedup": m["tpot_speedup"],
                    "at_least": SPEC_BATCH1_TARGET,
                    "meets": ratio is not None and ratio >= SPEC_BATCH1_TARGET,
                }
            )
    return out


def plot_spec(path: Path, rows: Sequence[dict[str, Any]], dtype: str) -> Path:
    plt = pyplot()
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(2, len(workloads), figsize=(6 * len(workloads), 7.5), squeeze=False)
    for col, workload in enumerate(workloads):
        group = [r for r in rows if r["workload"] == workload and r["round"] == 0]
        xs = list(range(len(group)))
        labels = [str(r["concurrency"]) for r in group]
        panels = (("tok_s", "output tok/s"), ("tpot_mean_ms", "TPOT mean (ms)"))
        for row, (key, title) in enumerate(panels):
            ax = axes[row][col]
            for k, side in enumerate(SPEC_SIDES):
                ys = [r[f"{side}_{key}"] or float("nan") for r in group]
                ax.bar([x + (k - 0.5) * 0.38 for x in xs], ys, 0.38, label=f"spec {side}")
            for x, r in zip(xs, group, strict=True):
                top = max(r[f"off_{key}"] or 0.0, r[f"on_{key}"] or 0.0)
                note = (
                    f"{r['tok_s_ratio']:.2f}x"
                    if key == "tok_s" and r["tok_s_ratio"]
                    else f"acc {r['acceptance_rate']:.0%}"
                    if r["acceptance_rate"] is not None
                    else ""
                )
                ax.annotate(note, (x, top), ha="center", va="bottom", fontsize=8)
            ax.set_xticks(xs, labels)
            ax.set_xlabel("concurrency")
            ax.set_title(f"{workload}: {title}", fontsize=10)
            ax.grid(axis="y", alpha=0.3)
            ax.legend(fontsize=8)
    title = f"n-gram speculative decoding on vs off (0P1D, greedy, {dtype})"
    save_chart(fig, title, path, dpi=110)
    return path


def run_spec(config: SpecExperimentConfig, out: Path | None, console: Console) -> dict[str, Any]:
    """Start the spec-off and spec-on clusters, run every point on both (A B A B), print the
    tables, write the outputs."""
    deployments = spec_deployments(config.cost_aware)
    console.print(
        f"[bold]experiment spec[/bold] {config.model}: concurrencies {config.concurrencies}, "
        f"workloads {[w for w, _ in config.workloads]}, <= {config.output_len} new tokens, "
        f"{config.rounds} round(s)"
    )
    args, timeout = config.worker_args, config.startup_timeout_s
    with (
        local_cluster(config.model, deployments["off"], args, timeout) as off,
        local_cluster(config.model, deployments["on"], args, timeout) as on,
    ):
        try:
            points, pools = asyncio.run(spec_points(config, {"off": off, "on": on}, console))
        except (grpc.aio.AioRpcError, WorkloadError) as e:
            raise BenchError(f"{type(e).__name__}: {e}") from None
    rows = spec_rows(points)
    report = {
        "benchmark": "experiment-spec",
        "config": asdict(config),
        "machine": {**machine_info(), "loadavg_end": os.getloadavg()},
        "model": config.model,
        "percentiles": PERCENTILES,
        "deployments": {
            side: {**d.to_json(), "worker_args": args} for side, d in deployments.items()
        },
        "points": [
            {
                "workload": p.workload,
                "concurrency": p.concurrency,
                "round": p.round,
                "side": p.side,
                **{k: v for k, v in p.result.report.items() if k != "requests"},
            }
            for p in points
        ],
        "rows": rows,
        "medians": [
            {"workload": w, "concurrency": c, **m} for (w, c), m in spec_medians(rows).items()
        ],
        "targets": spec_targets(config, rows),
    }
    console.print(spec_table(rows))
    _print_leaks(console, [p.result for p in points])
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        _write_jsonl(
            out / "inputs.jsonl",
            [json.dumps({"workload": w, **r.to_json()}) for w, pool in pools.items() for r in pool],
        )
        lines = [
            line
            for p in points
            for line in _requests_lines(
                {
                    "workload": p.workload,
                    "concurrency": p.concurrency,
                    "round": p.round,
                    "side": p.side,
                },
                p.result,
            )
        ]
        _write_jsonl(out / "requests.jsonl", lines)
        plot_spec(out / "spec.png", rows, config.dtype)
        console.print(f"[dim]wrote {out}[/dim]")
    return report
