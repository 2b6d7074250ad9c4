"""Pieces every benchmark uses: its error, the JSON + PNG report files, the OpenMP wait policy
for child processes, and where two greedy outputs part. Torch-free, so that the commands stay
light."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from rich.console import Console

from tandem.config import environment_defaults


class BenchError(RuntimeError):
    """The benchmark cannot run or produced something it cannot compare (message says which)."""


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


def passive_omp() -> AbstractContextManager[None]:
    """Child processes start with OMP_WAIT_POLICY=PASSIVE unless it is set: on a 2-core machine
    the spinning OpenMP threads of one process starve the other."""
    return environment_defaults(OMP_WAIT_POLICY="PASSIVE")


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first token where a and b differ (or where the shorter ends); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
