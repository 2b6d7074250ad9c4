"""`tandem models pull|list`: the local model store."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from tandem.cli.options import console
from tandem.config import DEFAULT_MODEL

models_app = typer.Typer(no_args_is_help=True, help="Manage local models.")


@models_app.command("pull")
def models_pull(
    name: Annotated[str, typer.Argument(help="Catalogue name.")] = DEFAULT_MODEL,
) -> None:
    """Download a catalogue model into $TANDEM_HOME/models."""
    from tandem import hub

    try:
        path = hub.pull(name)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="NAME") from None
    console.print(f"[green]ready:[/green] {path}")


@models_app.command("list")
def models_list() -> None:
    """Show the catalogue and what is already local."""
    from tandem import hub

    table = Table("catalogue name", "source", "local")
    local = set(hub.list_local())
    pulled = [hub.models_dir() / e.filename for e in hub.CATALOGUE.values()]
    for (name, entry), path in zip(hub.CATALOGUE.items(), pulled, strict=True):
        table.add_row(name, entry.requirement, "yes" if path in local else "-")
    console.print(table)
    for path in sorted(local):  # whole, on a line each: a table cell would cut a long path
        console.print(f"{'local' if path in pulled else 'also local'}: {path}", soft_wrap=True)
