"""Pieces every benchmark uses: the progress bar, the JSON + PNG report files, and the OpenMP
wait policy for child processes."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@contextmanager
def progress_bar(console: Console) -> Iterator[Progress]:
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        yield progress


def write_report(
    report: dict[str, Any],
    json_out: str | Path,
    write_chart: Callable[[dict[str, Any], Path], None],
    console: Console,
) -> None:
    """`report` as JSON at `json_out` and its chart beside it (same name, .png)."""
    path = Path(json_out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    chart = path.with_suffix(".png")
    write_chart(report, chart)
    console.print(f"[dim]wrote {path} and {chart}[/dim]")


@contextmanager
def passive_omp() -> Iterator[None]:
    """Child processes start with OMP_WAIT_POLICY=PASSIVE unless it is set: on a 2-core machine
    the spinning OpenMP threads of one process starve the other."""
    key = "OMP_WAIT_POLICY"
    had = key in os.environ
    os.environ.setdefault(key, "PASSIVE")
    try:
        yield
    finally:
        if not had:
            del os.environ[key]
