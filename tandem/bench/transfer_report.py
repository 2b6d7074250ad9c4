"""Console tables and the PNG chart of `tandem bench transfer`, drawn from its report dict."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table

from tandem.bench.report import median_bar, pyplot, save_chart
from tandem.bench.transfer_config import REFERENCE_NAMES, TransferBenchConfig

_HATCHES = {"tcp": "//", "memcpy": "..", "device_copy": "xx"}  # the references in the chart


def _fmt(s: dict[str, float], scale: float = 1.0, spread: bool = True) -> str:
    """median (min-max) of a stats dict, times `scale`; 3 significant digits or so, to keep the
    tables within 80 columns."""
    values = [s[k] * scale for k in ("median", "min", "max")]
    d = 2 if values[0] < 10 else 1 if values[0] < 100 else 0
    med, lo, hi = (f"{v:.{d}f}" for v in values)
    return f"{med} [dim]({lo}-{hi})[/dim]" if spread else med


def _verdict(ok: bool | None) -> str:
    if ok is None:
        return ""
    return "[green]PASS[/green]" if ok else "[red]MISS[/red]"


def _table(title: str, columns: Sequence[str]) -> Table:
    table = Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 0, 0, 1),
        pad_edge=False,
        show_edge=False,
    )
    for name in columns:
        table.add_column(name, justify="left" if name == "channel" else "right", no_wrap=True)
    table.add_column("")
    return table


def throughput_table(config: TransferBenchConfig, report: dict[str, Any]) -> Table:
    layout, res = report["layout"], report["throughput"]
    table = _table(
        f"KV transfer throughput ({config.device}): {layout['num_layers']} layers x "
        f"{layout['num_kv_heads']} KV heads x {layout['head_dim']}, {layout['dtype']}, "
        f"{layout['bytes_per_token'] / 1e3:.1f} KB/token; median (min-max) of {config.reps}",
        ("channel", "tokens", "MB", "GB/s", "ref GB/s", "ratio", "target"),
    )
    cells = res["cells"]
    for row in res["rows"]:
        mine = cells[f"{row['channel']}/{row['tokens']}"]
        ref = cells[f"{row['reference']}/{row['tokens']}"]
        table.add_row(
            row["label"],
            str(row["tokens"]),
            f"{row['nbytes'] / 1e6:.1f}",
            _fmt(mine["gb_s"]),
            f"{REFERENCE_NAMES[row['reference']]} {_fmt(ref['gb_s'], spread=False)}",
            f"{row['ratio']:.0%}",
            "" if row["target"] is None else f">={row['target']:.0%}",
            _verdict(row["pass"]),
        )
    if res["pair_setup_s"] is not None:
        table.caption = (
            f"pair setup (OpenPair, rendezvous, group), once: {res['pair_setup_s'] * 1e3:.0f} ms"
        )
        table.caption_justify = "left"
    return table


def exposed_table(config: TransferBenchConfig, report: dict[str, Any]) -> Table:
    table = _table(
        f"exposed transfer time = decode admission - prefill's first token, real workers "
        f"({config.model}); median (min-max) of {config.exposed_reps}",
        ("channel", "tokens", "stream", "prefill s", "exposed ms", "step ms", "/ step"),
    )
    for row in report["exposed"]["rows"]:
        table.add_row(
            row["label"],
            str(row["tokens"]),
            "on" if row["stream"] else "off",
            _fmt(row["prefill_s"], spread=False),
            _fmt(row["exposed_s"], 1e3),
            _fmt(row["decode_step_s"], 1e3, spread=False),
            f"{row['exposed_of_step']:.2f}",
            _verdict(row["pass"]),
        )
    table.caption = (
        "step = one decode step (TPOT at batch 1 after the prompt); target with streaming: "
        "exposed < 1 step"
    )
    table.caption_justify = "left"
    return table


def write_chart(report: dict[str, Any], path: Path) -> None:
    """Left: GB/s by prompt length, channels beside their references (median, min-max; log
    scale). Right: exposed time with and without streaming per channel, and the decode step."""
    plt = pyplot()
    config = report["config"]
    exposed = report.get("exposed")
    fig, axes = plt.subplots(1, 2 if exposed else 1, figsize=(12 if exposed else 7, 4.8))
    _throughput_panel(axes[0] if exposed else axes, config, report["throughput"])
    if exposed:
        _exposed_panel(axes[1], config, exposed)
    save_chart(fig, f"tandem bench transfer: {config['model']}", path)


def _throughput_panel(ax: Any, config: dict[str, Any], res: dict[str, Any]) -> None:
    """GB/s per prompt length: each channel's bar, then each reference's (hatched)."""
    tokens = config["prompt_tokens"]
    whats = [r["channel"] for r in res["rows"] if r["tokens"] == tokens[0]]
    whats += sorted({r["reference"] for r in res["rows"]})
    labels = {r["channel"]: r["label"] for r in res["rows"]} | {
        k: f"{v} (reference)" for k, v in REFERENCE_NAMES.items()
    }
    colors = {"pair": "tab:blue", "grpc": "tab:orange", "shm": "tab:green"}
    width = 0.8 / len(whats)
    for j, what in enumerate(whats):
        for i, n in enumerate(tokens):
            median_bar(
                ax,
                i + (j - (len(whats) - 1) / 2) * width,
                res["cells"][f"{what}/{n}"]["gb_s"],
                width,
                capsize=2,
                color=colors.get(what, "lightgray"),
                hatch=_HATCHES.get(what, ""),
                edgecolor="black" if what not in colors else None,
                label=labels[what] if i == 0 else None,
            )
    ax.set_yscale("log")
    top = max(c["gb_s"]["max"] for c in res["cells"].values())
    ax.set_ylim(top=top * 12)  # room for the legend above the bars
    ax.set_xticks(range(len(tokens)), [f"{n} tokens" for n in tokens])
    ax.set_ylabel("GB/s")
    ax.set_title(f"throughput ({config['device']}), median of {config['reps']}")
    ax.legend(fontsize=8, ncols=2, loc="upper left")


def _exposed_panel(ax: Any, config: dict[str, Any], exposed: dict[str, Any]) -> None:
    """Exposed ms per (channel, prompt length), streaming on and off, under one decode step."""
    rows = exposed["rows"]
    groups = [(r["label"], r["tokens"]) for r in rows if r["stream"]]
    for i, (label, n) in enumerate(groups):
        for j, stream in enumerate((True, False)):
            key = (label, n, stream)
            row = next(r for r in rows if (r["label"], r["tokens"], r["stream"]) == key)
            _exposed_bar(ax, i + (j - 0.5) * 0.38, row["exposed_s"], stream, i == 0)
        step = next(r for r in rows if (r["label"], r["tokens"]) == (label, n))
        ax.hlines(
            step["decode_step_s"]["median"] * 1e3,
            i - 0.45,
            i + 0.45,
            colors="tab:red",
            linestyles="--",
            label="one decode step" if i == 0 else None,
        )
    ax.set_xticks(range(len(groups)), [f"{label}\n{n} tokens" for label, n in groups])
    ax.set_ylabel("exposed transfer time, ms")
    ax.set_title(f"exposed time, real workers, median of {config['exposed_reps']}")
    ax.legend(fontsize=8)


def _exposed_bar(ax: Any, x: float, s: dict[str, float], stream: bool, labelled: bool) -> None:
    """One exposed-time bar (median, min-max) in ms, its value written above it."""
    median_bar(
        ax,
        x,
        s,
        0.38,
        scale=1e3,
        capsize=3,
        color="tab:blue" if stream else "tab:gray",
        label=("layer-wise streaming" if stream else "after the prefill") if labelled else None,
    )
    ax.annotate(
        f"{s['median'] * 1e3:.1f}",
        (x, s["median"] * 1e3),
        ha="center",
        va="bottom",
        fontsize=8,
        xytext=(0, 2),
        textcoords="offset points",
    )
