"""`python -m tandem.cli ...`: the `tandem` command (how the launchers start worker processes)."""

from tandem.cli import app

app()
