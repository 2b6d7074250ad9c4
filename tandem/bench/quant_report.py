"""Console tables and the PNG chart of `tandem bench quant`, drawn from its report dict."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from tandem.bench.machine import machine_line
from tandem.bench.quant_config import LLAMA_CPP, NGRAM, SPEC_OFF
from tandem.bench.report import (
    fmt_stats,
    median_bar,
    pyplot,
    rounds_title,
    save_chart,
    targets_table,
)


def print_report(report: dict[str, Any], console: Console) -> None:
    for label, reason in report["skipped"].items():
        console.print(f"[yellow]skipped {label}:[/yellow] {reason}")
    console.print(machine_line(report["machine"]))
    console.print(_matrix_table(report["config"], report["summary"]))
    console.print(_floor_table(report["kernel_floor"]))
    console.print(_roofline_table(report["read_bandwidth_gb_s"], report["roofline"]))
    kv = report["kv_bytes_per_token"]
    console.print(
        f"KV bytes per token, scales included (what a transfer moves): bf16 cache "
        f"{kv['bf16']:,}, int8 cache {kv['int8']:,} ({kv['int8'] / kv['bf16']:.2f}x)\n"
    )
    console.print(targets_table(report["targets"]))


def _num(value: float | None, spec: str = ".2f", suffix: str = "x") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _matrix_table(config: dict[str, Any], rows: Sequence[dict[str, Any]]) -> Table:
    table = Table(
        title=f"decode tok/s (prefill excluded), median (min-max) of {config['rounds']} rounds: "
        f"{config['model']}, {config['new_tokens']} new tokens, greedy, "
        f"{config['threads']} threads, k = {config['num_speculative_tokens']}",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for name in ("batch", "weights", "spec", "decode tok/s", "/ bf16", "/ llama.cpp"):
        table.add_column(name, justify="left" if name in ("weights", "spec") else "right")
    for name in ("/ no spec", "acc. len", "same output", "output tok/s"):
        table.add_column(name, justify="right", no_wrap=True)
    batch = None
    for r in rows:
        if batch is not None and r["batch_size"] != batch:
            table.add_section()
        batch = r["batch_size"]
        table.add_row(
            str(r["batch_size"]),
            r["format"],
            "" if r["format"] == LLAMA_CPP else r["spec"],
            fmt_stats(r["decode_tok_s"]),
            _num(r["vs_bf16"]),
            _num(r["vs_llama_cpp"]),
            _num(r.get("vs_off")),
            _num(r.get("mean_acceptance_length"), ".2f", ""),
            _same(r),
            fmt_stats(r["output_tok_s"]),
        )
    table.caption = (
        "same output: requests whose tokens equal the run without speculation (llama.cpp: the "
        "int4 engine's), with the earliest difference; output tok/s: all output tokens / wall "
        "time of the run, prefill included"
    )
    return table


def _same(row: dict[str, Any]) -> str:
    if row["format"] == LLAMA_CPP:
        firsts = row.get("first_difference_int4", [])
        same, total, diffs = firsts.count(None), len(firsts), [d for d in firsts if d is not None]
    elif "same_output" in row:
        (same, total), diffs = row["same_output"], row["first_differences"]
    else:
        return ""
    return f"{same}/{total}" + (f" (from {min(diffs)})" if diffs else "") if total else ""


def _floor_table(floors: Sequence[dict[str, Any]]) -> Table:
    table = Table(
        title="kernel floor: the engine's linear layers and LM head alone, batch 1, back to back",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for name in ("weights", "steps/s", "/ bf16", "engine b1 / floor"):
        table.add_column(name, justify="left" if name == "weights" else "right")
    for f in floors:
        table.add_row(
            f["format"],
            fmt_stats(f["steps_s"]),
            _num(f["vs_bf16"]),
            _num(f["engine_b1_of_floor"], ".0%", ""),
        )
    return table


def _roofline_table(bandwidth: dict[str, float], rows: Sequence[dict[str, Any]]) -> Table:
    table = Table(
        title=f"memory roofline: read bandwidth {fmt_stats(bandwidth)} GB/s over the bytes of a "
        "batch-1 decode step",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for name in (
        "weights",
        "weight MB",
        "KV MB",
        "context",
        "roofline tok/s",
        "engine b1 / roofline",
    ):
        table.add_column(name, justify="left" if name == "weights" else "right")
    for r in rows:
        table.add_row(
            r["format"],
            f"{r['weight_bytes'] / 1e6:.1f}",
            f"{r['kv_bytes'] / 1e6:.1f}",
            f"{r['context_tokens']:.0f}",
            f"{r['roofline_tok_s']:.1f}",
            _num(r["engine_b1_of_roofline"], ".0%", ""),
        )
    return table


def write_chart(report: dict[str, Any], path: Path) -> None:
    """Per batch size, decode tok/s of each format without and with n-gram (median, min-max);
    at batch 1 the kernel floors (steps/s) and llama.cpp as lines."""
    plt = pyplot()
    config, rows = report["config"], report["summary"]
    formats = list(config["formats"])
    sizes = list(config["batch_sizes"])
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4.8), squeeze=False)
    floors = {f["format"]: f["steps_s"]["median"] for f in report["kernel_floor"]}
    by_key = {(r["format"], r["spec"], r["batch_size"]): r for r in rows}
    width = 0.38
    for ax, b in zip(axes[0], sizes, strict=True):
        for j, (spec, color) in enumerate(((SPEC_OFF, "tab:blue"), (NGRAM, "tab:green"))):
            for i, fmt in enumerate(formats):
                row = by_key.get((fmt, spec, b))
                if row is None:
                    continue
                label = f"spec {spec}" if i == 0 else None
                x = i + (j - 0.5) * width
                median_bar(ax, x, row["decode_tok_s"], width, capsize=3, color=color, label=label)
                if b == 1 and spec == SPEC_OFF and fmt in floors:
                    ax.hlines(
                        floors[fmt],
                        i - 0.45,
                        i + 0.45,
                        colors="tab:red",
                        linestyles=":",
                        label="kernel floor (steps/s)" if i == 0 else None,
                    )
        llama = by_key.get((LLAMA_CPP, LLAMA_CPP, 1))
        if llama is not None:
            ax.axhline(
                llama["decode_tok_s"]["median"],
                color="tab:gray",
                linestyle="--",
                label="llama.cpp, one stream",
            )
        ax.set_xticks(range(len(formats)), formats)
        ax.set_title(f"batch {b}: decode tok/s")
        ax.set_ylabel("tokens/s")
        ax.legend(fontsize=8, loc="upper left")
        ax.margins(y=0.15)
    save_chart(fig, rounds_title(config), path)
