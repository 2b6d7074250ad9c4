"""What every `tandem bench ...` command does around its benchmark: comma lists, a config error
as a usage error, `--quick`, and a failed run as a red message and exit status 1. Imports no
torch, so `tandem --help` stays light."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Protocol, TypeVar

import typer
from rich.console import Console

from tandem.bench.common import BenchError

JsonOutOpt = Annotated[
    str | None, typer.Option("--json", help="Write results here, and a .png beside them.")
]


class QuickConfig(Protocol):
    def quick(self) -> Any: ...


C = TypeVar("C", bound=QuickConfig)


def names(text: str) -> tuple[str, ...]:
    """A comma-separated option as its non-empty items."""
    return tuple(s.strip() for s in text.split(",") if s.strip())


def run_bench_command(
    build: Callable[[], C],
    quick: bool,
    run: Callable[[C, str | None, Console], object],
    json_out: str | None,
    console: Console,
) -> None:
    """Build the config (ValueError -> usage error), shrink it for --quick, run it (BenchError
    -> a red message and exit status 1)."""
    try:
        config = build()
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if quick:
        config = config.quick()
    try:
        run(config, json_out, console)
    except BenchError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1) from None
