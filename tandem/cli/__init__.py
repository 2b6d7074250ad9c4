"""`tandem` command line: models, generate, serve, router, worker, admin, bench, spec.

One module per command group; `app` puts them together (the `tandem` entry point).
"""

from __future__ import annotations

import typer

from tandem.cli.admin_cli import drain, scale, status
from tandem.cli.bench_cli import bench_app
from tandem.cli.cluster_cli import router_cmd, serve, worker
from tandem.cli.generate_cli import generate
from tandem.cli.models_cli import models_app
from tandem.cli.spec_cli import spec_train

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="Tandem: disaggregated prefill/decode LLM serving with speculative decoding.",
)
app.add_typer(models_app, name="models")
app.command()(generate)
app.command()(serve)
app.command("router")(router_cmd)
app.command()(worker)
app.command()(scale)
app.command()(status)
app.command()(drain)
app.add_typer(bench_app, name="bench")
spec_app = typer.Typer(no_args_is_help=True, help="Speculative decoding: train draft heads.")
spec_app.command("train")(spec_train)
app.add_typer(spec_app, name="spec")

__all__ = ["app"]
