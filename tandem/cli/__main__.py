"""`python -m tandem.cli ...`: the `tandem` command (how the launchers start worker processes)."""

from tandem.cli import app
from tandem.cluster.lifetime import arm_parent_death_signal

arm_parent_death_signal()  # a launcher's worker process ends with the launcher
app()
