"""Console tables and the PNG chart of `tandem bench spec`, drawn from its report dict."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from tandem.bench.report import pyplot, save_chart, targets_table
from tandem.bench.spec_config import (
    ALL,
    GROUPS,
    HF_ASSISTED,
    HF_GREEDY,
    HF_LOOKUP,
    LARGE_BATCH,
    NO_SPEC,
    TARGET_LARGE_BATCH,
    TARGET_MODEL_B1_CHAT,
    TARGET_NGRAM_B1_GROUNDED,
)


def print_report(report: dict[str, Any], console: Console) -> None:
    rows, config = report["summary"], report["config"]
    for label, reason in report["skipped"].items():
        console.print(f"[yellow]skipped {label}:[/yellow] {reason}")
    for label in _spec_labels(rows):
        console.print(_method_table(config, label, [r for r in rows if r["side"] == label]))
        console.print(_category_table(label, [r for r in rows if r["side"] == label], config))
    if any(r["side"] == HF_GREEDY for r in rows):
        console.print(_reference_table(rows))
    console.print(targets_table(report["targets"]))


def _spec_labels(rows: Sequence[dict[str, Any]]) -> list[str]:
    refs = {NO_SPEC, HF_GREEDY, HF_LOOKUP, HF_ASSISTED}
    return list(dict.fromkeys(r["side"] for r in rows if r["side"] not in refs))


def _num(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _positions(rates: Sequence[float | None]) -> str:
    return " ".join("-" if r is None else f"{r:.0%}" for r in rates)


def _group_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    order = [ALL, *GROUPS]
    picked = [r for r in rows if r["scope"] in order]
    return sorted(picked, key=lambda r: (order.index(r["scope"]), r["batch_size"]))


def _method_table(config: dict[str, Any], label: str, rows: Sequence[dict[str, Any]]) -> Table:
    table = Table(
        title=f"{label} vs no speculation: {config['dtype']}, <= {config['new_tokens']} new "
        f"tokens, greedy, {config['threads']} threads; output tok/s, prefill included",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for name in ("scope", "batch", "no spec", "spec", "spec / no", "per run", "TPOT x"):
        table.add_column(name, justify="left" if name == "scope" else "right", no_wrap=True)
    for name in (
        "accept",
        "acc. len",
        "per position",
        "propose / verify s",
        "undrafted",
        "same",
        "/ HF lookup",
    ):
        table.add_column(name, justify="right", no_wrap=True)
    for r in _group_rows(rows) or rows:
        acc = r.get("acceptance", {})
        spread = r["vs_no_spec_per_run"]
        table.add_row(
            r["scope"],
            str(r["batch_size"]),
            _num(r["no_spec_tok_s"]),
            _num(r["tok_s"]),
            _num(r["vs_no_spec"], ".2f", "x"),
            f"{spread['min']:.2f}-{spread['max']:.2f}",
            _num(r["decode_speedup"], ".2f", "x"),
            _num(acc.get("acceptance_rate"), ".0%"),
            _num(acc.get("mean_acceptance_length"), ".2f"),
            _positions(acc.get("per_position", [])),
            f"{_num(acc.get('propose_s'), '.2f')} / {_num(acc.get('verify_s'), '.2f')}",
            str(acc.get("plain_by_cost", "-")),
            f"{r['same_output']}/{r['requests']}",
            _num(r["vs_hf_lookup"], ".2f", "x"),
        )
    return table


def _category_table(label: str, rows: Sequence[dict[str, Any]], config: dict[str, Any]) -> Table:
    table = Table(
        title=f"{label} per category: spec / no spec (mean acc. length)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    table.add_column("category")
    sizes = config["batch_sizes"]
    for b in sizes:
        table.add_column(f"batch {b}", justify="right", no_wrap=True)
    cells = {(r["scope"], r["batch_size"]): r for r in rows}
    for category in config["categories"]:
        row = [category]
        for b in sizes:
            r = cells.get((category, b))
            length = None if r is None else r.get("acceptance", {}).get("mean_acceptance_length")
            ratio = None if r is None else r["vs_no_spec"]
            row.append(f"{_num(ratio, '.2f', 'x')} ({_num(length, '.2f')})")
        table.add_row(*row)
    return table


def _reference_table(rows: Sequence[dict[str, Any]]) -> Table:
    """Batch 1: the engine without speculation and the transformers references, tok/s."""
    b1 = [r for r in rows if r["batch_size"] == 1]
    sides = [
        s for s in (NO_SPEC, HF_GREEDY, HF_LOOKUP, HF_ASSISTED) if any(r["side"] == s for r in b1)
    ]
    table = Table(
        title="batch 1 references: output tok/s (same output as the engine without speculation)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    table.add_column("scope")
    for side in sides:
        table.add_column(side, justify="right", no_wrap=True)
    table.add_column("HF lookup / HF greedy", justify="right", no_wrap=True)
    cells = {(r["scope"], r["side"]): r for r in b1}
    for scope in dict.fromkeys(r["scope"] for r in _group_rows(b1) + b1):
        row = [scope]
        for side in sides:
            r = cells.get((scope, side))
            same = "" if r is None or side == NO_SPEC else f" ({r['same_output']}/{r['requests']})"
            row.append(_num(None if r is None else r["tok_s"]) + same)
        lookup, greedy = cells.get((scope, HF_LOOKUP)), cells.get((scope, HF_GREEDY))
        ratio = lookup["tok_s"] / greedy["tok_s"] if lookup and greedy else None
        row.append(_num(ratio, ".2f", "x"))
        table.add_row(*row)
    return table


def write_chart(report: dict[str, Any], path: Path) -> None:
    """Left: spec / no spec output tok/s against batch size per method and group, with the
    targets; right: acceptance rate per draft position at batch 1."""
    plt = pyplot()
    rows, config = report["summary"], report["config"]
    fig, (ax_ratio, ax_pos) = plt.subplots(1, 2, figsize=(12, 4.8))
    scopes = [s for s in (*GROUPS, ALL) if any(r["scope"] == s for r in rows)]
    styles = ("-", "--", ":", "-.")
    for i, label in enumerate(_spec_labels(rows)):
        for j, scope in enumerate(scopes):
            mine = sorted(
                (r for r in rows if r["side"] == label and r["scope"] == scope),
                key=lambda r: r["batch_size"],
            )
            points = [(r["batch_size"], r["vs_no_spec"]) for r in mine if r["vs_no_spec"]]
            if points:
                xs, ys = zip(*points, strict=True)
                ax_ratio.plot(
                    xs, ys, styles[i % len(styles)], marker="o", color=f"C{j}",
                    label=f"{label}, {scope}",
                )  # fmt: skip
            b1 = next((r for r in mine if r["batch_size"] == 1 and "acceptance" in r), None)
            if b1 is not None:
                rates = b1["acceptance"]["per_position"]
                ax_pos.plot(
                    range(1, len(rates) + 1), [r if r is not None else float("nan") for r in rates],
                    styles[i % len(styles)], marker="o", color=f"C{j}", label=f"{label}, {scope}",
                )  # fmt: skip
    for value, name in (
        (1.0, "break-even"),
        (TARGET_NGRAM_B1_GROUNDED, "n-gram b1 grounded target"),
        (TARGET_MODEL_B1_CHAT, "model-based b1 chat target"),
        (TARGET_LARGE_BATCH, f"batch {LARGE_BATCH} target"),
    ):
        ax_ratio.axhline(value, color="tab:red" if value != 1.0 else "gray", lw=0.8, ls=":")
        ax_ratio.annotate(name, (1, value), fontsize=7, va="bottom")
    ax_ratio.set_xscale("log", base=2)
    ax_ratio.set_xticks(config["batch_sizes"], [str(b) for b in config["batch_sizes"]])
    ax_ratio.set_xlabel("batch size")
    ax_ratio.set_ylabel("output tok/s, spec / no spec")
    ax_ratio.legend(fontsize=7)
    ax_pos.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    ax_pos.set_xlabel("draft position")
    ax_pos.set_ylabel("acceptance rate, batch 1")
    ax_pos.set_ylim(0, 1)
    ax_pos.legend(fontsize=7)
    title = (
        f"{config['model']}: {config['dtype']}, <= {config['new_tokens']} new tokens, greedy, "
        f"{config['threads']} threads, k = {config['num_speculative_tokens']}"
    )
    save_chart(fig, title, path)
