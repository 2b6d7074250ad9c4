"""What every benchmark report holds and prints: sample statistics, target checks, and the
console tables and chart pieces shared by the benchmarks. Torch-free."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table


def stats(values: Sequence[float]) -> dict[str, float]:
    """n, median (`statistics.median`), min, max and mean of the samples."""
    return {
        "n": len(values),
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "mean": statistics.fmean(values),
    }


def fmt_stats(s: dict[str, float]) -> str:
    """median (min-max); whole numbers from 100 up, to keep the tables within 80 columns."""
    d = 0 if s["median"] >= 100 else 1
    return f"{s['median']:.{d}f} [dim]({s['min']:.{d}f}-{s['max']:.{d}f})[/dim]"


def target_result(name: str, value: float, at_least: float) -> dict[str, Any]:
    """One target check as the reports hold it: name, measured value, threshold, pass."""
    return {"name": name, "value": value, "at_least": at_least, "pass": value >= at_least}


def targets_table(targets: list[dict[str, Any]]) -> Table:
    table = Table(title="targets (BENCHMARKS.md)", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("target")
    table.add_column("measured", justify="right")
    table.add_column("at least", justify="right")
    table.add_column("")
    for t in targets:
        verdict = "[green]PASS[/green]" if t["pass"] else "[red]MISS[/red]"
        table.add_row(t["name"], f"{t['value']:.2f}", f"{t['at_least']:.2f}", verdict)
    return table


def routes_table(title: str, described: dict[str, str]) -> Table:
    """The kernel routes of a model's products (`routes.describe`), one shape class a row."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("layer (kind out x in)", no_wrap=True)
    table.add_column("route by rows")
    for key, text in described.items():
        table.add_row(key, text)
    return table


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend; imported when a chart is drawn, not
    with the benchmark."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def median_bar(
    ax: Any, x: float, s: dict[str, float], width: float, scale: float = 1.0, **style: Any
) -> None:
    """One bar at the median of a stats dict with its min-max as the error bar, times `scale`."""
    median = s["median"] * scale
    spread = [[(s["median"] - s["min"]) * scale], [(s["max"] - s["median"]) * scale]]
    ax.bar(x, median, width, yerr=spread, **style)


def rounds_title(config: dict[str, Any]) -> str:
    """The title of a chart of medians over rounds: model, new tokens, threads, rounds."""
    return (
        f"{config['model']}: {config['new_tokens']} new tokens, greedy, {config['threads']} "
        f"threads; median, bars min-max over {config['rounds']} rounds"
    )


def save_chart(fig: Any, title: str, path: Path, dpi: int = 120) -> None:
    """A benchmark's figure under its title, written to `path` as a PNG and closed."""
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
