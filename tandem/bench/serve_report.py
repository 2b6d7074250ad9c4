"""Reports of `tandem bench serve` / `bench sla`: console tables, results.json, requests.jsonl,
inputs.jsonl, summary.csv and PNG plots (latency vs load, throughput vs TPOT, TTFT/TPOT CDFs,
acceptance by draft position when the workers export it)."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from tandem.bench.report import pyplot, save_chart
from tandem.bench.serve_config import PointResult, ServeConfig
from tandem.bench.serving_metrics import Stats
from tandem.bench.workloads import BenchRequest

# --- console ------------------------------------------------------------------------------


def _ms3(s: Stats | None) -> str:
    """p50/p90/p99 in ms."""
    if s is None:
        return "-"
    return "/".join(_ms(v) for v in (s.p50, s.p90, s.p99))


def _ms(v: float) -> str:
    ms = v * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}"


def _opt(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def throughput_table(config: ServeConfig, results: Sequence[PointResult]) -> Table:
    table = Table(
        title=f"{config.api.upper()}, {config.workload.name}: throughput (measured window)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for name in ("load", "reqs", "errors", "req/s", "out tok/s", "tot tok/s", "goodput"):
        table.add_column(name, justify="left" if name == "load" else "right")
    for r in results:
        s = r.summary
        errors = ", ".join(f"{k}:{v}" for k, v in sorted(s.errors.items())) or "0"
        table.add_row(
            r.point.label,
            str(s.num_requests),
            errors,
            f"{s.request_throughput:.2f}",
            f"{s.output_throughput:.1f}",
            f"{s.total_throughput:.1f}",
            _opt(s.goodput, ".2f"),
        )
    return table


LATENCY_ROWS = (
    ("TTFT", "ttft"),
    ("TPOT", "tpot"),
    ("ITL chunk", "itl_chunk"),
    ("ITL token", "itl_token"),
    ("E2E", "e2e"),
    ("client queue", "client_queue"),
)


def latency_table(results: Sequence[PointResult]) -> Table:
    table = Table(title="latency, ms", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("load")
    table.add_column("metric")
    for name in ("n", "mean", "p50", "p90", "p99", "max"):
        table.add_column(name, justify="right")
    for i, r in enumerate(results):
        if i:
            table.add_section()
        for j, (label, attr) in enumerate(LATENCY_ROWS):
            s: Stats | None = getattr(r.summary, attr)
            cells = (
                [str(s.count), *(_ms(v) for v in (s.mean, s.p50, s.p90, s.p99, s.max))]
                if s is not None
                else ["0", *["-"] * 5]
            )
            table.add_row(r.point.label if j == 0 else "", label, *cells)
    return table


def server_table(results: Sequence[PointResult]) -> Table | None:
    rows = [(r, r.report.get("server")) for r in results]
    if not any(server for _, server in rows):
        return None
    table = Table(
        title="server side (deltas): acceptance on the decode workers, KV transfers as they "
        "counted them, exposed transfer p50 from gRPC timings",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for name in ("load", "accept", "acc len", "xfers", "GB/s", "xfer ms", "exposed ms"):
        table.add_column(name, justify="left" if name == "load" else "right")
    for r, server in rows:
        if not server:
            continue
        tot = server["totals"]
        xfer_mean = (
            tot["kv_transfer_seconds"] / tot["kv_transfers"] if tot["kv_transfers"] else None
        )
        timings = r.report.get("server_timings") or {}
        exposed = (timings.get("exposed_transfer_s") or {}).get("p50")
        table.add_row(
            r.point.label,
            _opt(tot["acceptance_rate"], ".0%"),
            _opt(tot["mean_acceptance_length"], ".2f"),
            f"{tot['kv_transfers']:g}",
            _opt(tot["kv_transfer_gb_s"], ".2f"),
            _ms(xfer_mean) if xfer_mean is not None else "-",
            _ms(exposed) if exposed is not None else "-",
        )
    return table


def server_line(r: PointResult) -> str | None:
    """Router counts and the KV leak check of one point (worker details unless OK)."""
    server = r.report.get("server")
    if not server:
        return None
    router = server.get("router")
    if router is None:
        routed = f"router metrics unavailable ({server.get('router_error')})"
    else:
        outcomes = ", ".join(f"{k} {v:g}" for k, v in sorted(router["requests"].items()))
        routed = (
            f"router: {outcomes or 'none recorded'}, local prefills "
            f"{_opt(router['local_prefills'], 'g')}, prefill retries "
            f"{_opt(router['prefill_retries'], 'g')}"
        )
    check = r.report["kv_leak_check"]
    status = check["status"]
    color = {"OK": "green", "LEAK": "red"}.get(status, "yellow")
    workers = check["workers"]
    if status == "OK":
        detail = f"{len(workers)} workers idle, all KV blocks free"
    else:
        detail = "; ".join(
            f"{wid}: {_opt(w.get('blocks_free'), 'g')}/{_opt(w.get('blocks_total'), 'g')} "
            f"blocks free, {_opt(w.get('requests'), 'g')} requests"
            if "error" not in w
            else f"{wid}: unreadable"
            for wid, w in workers.items()
        )
    return f"{r.point.label}: {routed}; KV leak check [{color}]{status}[/{color}] ({detail})"


def sla_table(report: dict[str, Any], results: Sequence[PointResult]) -> Table:
    sla = report["sla"]
    table = Table(
        title=f"SLO: p99 TTFT <= {sla['ttft_p99_s'] * 1e3:g} ms, p99 TPOT <= "
        f"{sla['tpot_p99_s'] * 1e3:g} ms, no failed request",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for name in ("rate", "req/s", "errors", "p99 TTFT ms", "p99 TPOT ms", "meets"):
        table.add_column(name, justify="right")
    for r in results:
        s = r.summary
        ok = r.report.get("meets_slo")
        table.add_row(
            f"{r.point.rate:g}",
            f"{s.request_throughput:.2f}",
            str(s.num_requests - s.num_ok),
            _ms(s.ttft.p99) if s.ttft else "-",
            _ms(s.tpot.p99) if s.tpot else "-",
            "[green]yes[/green]" if ok else "[red]no[/red]",
        )
    return table


def tag_table(results: Sequence[PointResult]) -> Table | None:
    if not any("by_tag" in r.report for r in results):
        return None
    table = Table(title="by tag: ms p50/p90/p99", title_justify="left", box=box.SIMPLE_HEAD)
    for name in ("load", "tag", "reqs", "TTFT", "TPOT", "E2E", "accepted", "decode tok/s"):
        table.add_column(name, justify="left" if name in ("load", "tag") else "right")
    for r in results:
        for tag, s in r.report.get("by_tag", {}).items():
            share, rate = s.get("accepted_share"), s.get("decode_tok_s")
            table.add_row(
                r.point.label,
                tag,
                str(s["num_requests"]),
                *(_ms3(_stats(s[m])) for m in ("ttft", "tpot", "e2e")),
                "-" if share is None else f"{share:.0%}",
                "-" if rate is None else f"{rate:.1f}",
            )
    return table


def _stats(d: dict[str, float] | None) -> Stats | None:
    return Stats(**d) if d else None  # type: ignore[arg-type]


def print_tables(console: Console, config: ServeConfig, results: Sequence[PointResult]) -> None:
    console.print(throughput_table(config, results))
    console.print(latency_table(results))
    for table in (tag_table(results), server_table(results)):
        if table is not None:
            console.print(table)
    for r in results:
        line = server_line(r)
        if line is not None:
            console.print(line)
    for r in results:
        checks = r.report["checks"]
        if any(checks.values()):
            console.print(
                f"[yellow]{r.point.label}: client cross-check {checks} (streamed tokens vs "
                "usage; on HTTP each event counts as 1 token, so speculative decoding shows "
                "here)[/yellow]"
            )


# --- files --------------------------------------------------------------------------------

CSV_METRICS = ("ttft", "tpot", "itl_chunk", "itl_token", "e2e", "client_queue")
CSV_STATS = ("mean", "p50", "p90", "p95", "p99")


def summary_rows(results: Sequence[PointResult]) -> list[dict[str, Any]]:
    rows = []
    for r in results:
        s = r.summary
        row: dict[str, Any] = {
            "label": r.point.label,
            "rate": r.point.rate,
            "concurrency": r.point.concurrency,
            "burstiness": r.point.burstiness,
            "sent": len(r.sents),
            "measured": s.num_requests,
            "ok": s.num_ok,
            "errors": json.dumps(s.errors),
            "window_s": s.window_s,
            "request_throughput": s.request_throughput,
            "output_throughput": s.output_throughput,
            "total_throughput": s.total_throughput,
            "goodput": s.goodput,
        }
        for m in CSV_METRICS:
            stats = getattr(s, m)
            for k in CSV_STATS:
                row[f"{m}_{k}_s"] = getattr(stats, k) if stats is not None else None
        server = r.report.get("server") or {}
        tot = server.get("totals") or {}
        row["acceptance_rate"] = tot.get("acceptance_rate")
        row["kv_transfer_gb_s"] = tot.get("kv_transfer_gb_s")
        row["kv_leak_check"] = r.report.get("kv_leak_check", {}).get("status")
        if "meets_slo" in r.report:
            row["meets_slo"] = r.report["meets_slo"]
        rows.append(row)
    return rows


def write_outputs(
    out: Path,
    report: dict[str, Any],
    pool: Sequence[BenchRequest],
    results: Sequence[PointResult],
    plots: bool,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    with (out / "inputs.jsonl").open("w") as f:
        for request in pool:
            f.write(json.dumps(request.to_json()) + "\n")
    with (out / "requests.jsonl").open("w") as f:
        for i, r in enumerate(results):
            for record in r.report["requests"]:
                f.write(json.dumps({"point": i, "label": r.point.label, **record}) + "\n")
    rows = summary_rows(results)
    with (out / "summary.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["label"])
        writer.writeheader()
        writer.writerows(rows)
    if plots and results:
        write_plots(out, results)


def write_plots(out: Path, results: Sequence[PointResult]) -> list[Path]:
    paths = [
        _plot_latency_vs_load(out / "latency_vs_load.png", results),
        _plot_throughput_vs_tpot(out / "throughput_vs_tpot.png", results),
        _plot_distributions(out / "ttft_tpot_distributions.png", results),
    ]
    acceptance = _plot_acceptance(out / "acceptance_by_position.png", results)
    return paths + ([acceptance] if acceptance else [])


def _load_axis(results: Sequence[PointResult]) -> str:
    return "concurrency" if all(r.point.closed for r in results) else "offered rate (req/s)"


def _plot_latency_vs_load(path: Path, results: Sequence[PointResult]) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    xs = [r.point.load for r in results]
    for ax, name in zip(axes, ("ttft", "tpot", "e2e"), strict=True):
        for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ys = [_q(getattr(r.summary, name), q) for r in results]
            ax.plot(xs, ys, style, label=q)
        ax.set_title(name.upper())
        ax.set_xlabel(_load_axis(results))
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    save_chart(fig, "latency vs load (measured window)", path, dpi=110)
    return path


def _q(stats: Stats | None, q: str) -> float:
    return getattr(stats, q) * 1e3 if stats is not None else float("nan")


def _plot_throughput_vs_tpot(path: Path, results: Sequence[PointResult]) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    pts = [(_q(r.summary.tpot, "p50"), r.summary.output_throughput, r.point.label) for r in results]
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", color="tab:blue")
    for x, y, label in pts:
        ax.annotate(label, (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
    front = pareto([(x, y) for x, y, _ in pts])
    if front:
        ax.plot([p[0] for p in front], [p[1] for p in front], "-", color="tab:blue", alpha=0.5,
                label="Pareto front")  # fmt: skip
        ax.legend(fontsize=8)
    ax.set_xlabel("p50 TPOT (ms)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput vs TPOT", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def pareto(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points not beaten on both lower x (TPOT) and higher y (throughput), by increasing x."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(p for p in points if p[0] == p[0] and p[1] == p[1]):
        if not front or y > front[-1][1]:
            front.append((x, y))
    return front


def _plot_distributions(path: Path, results: Sequence[PointResult]) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, name in zip(axes, ("ttft", "tpot"), strict=True):
        for r in results:
            values = sorted(
                v * 1e3
                for s in r.kept
                if s.timeline.ok and (v := getattr(s.timeline, name)) is not None
            )
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ys, where="post", label=r.point.label)
        ax.set_title(f"{name.upper()} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_acceptance(path: Path, results: Sequence[PointResult]) -> Path | None:
    plt = pyplot()
    series = []
    for r in results:
        for wid, w in (r.report.get("server") or {}).get("workers", {}).items():
            rates = (w.get("spec") or {}).get("per_position")
            if rates:
                series.append((f"{r.point.label} {wid}", rates))
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, rates in series:
        ax.plot(range(1, len(rates) + 1), rates, "o-", label=label)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
