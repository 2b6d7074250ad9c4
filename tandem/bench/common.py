"""Pieces every benchmark uses: the progress bar, and the OpenMP wait policy for child processes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

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
