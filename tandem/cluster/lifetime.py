"""How a launcher and the processes it starts end together.

- `die_with_parent()`: the environment of a child that must end with this process; the child
  calls `arm_parent_death_signal()` first thing, which arms the parent-death signal
  (`tandem/parent_death.py`), so a launcher killed by SIGKILL takes its worker processes with it.
  The child arms it itself rather than in a `preexec_fn`: Python code between fork and exec ran
  gRPC's fork handlers in the child, which abort it (SIGABRT) while other threads of the launcher
  use gRPC (its router; seen starting a cluster after a test's gRPC clients); without one,
  `subprocess` can vfork and exec at once.
- `interrupt_on_sigterm()`: SIGTERM (how Kubernetes and systemd stop a process) raises
  KeyboardInterrupt in the main thread, so the launcher stops its cluster as it does on Ctrl-C.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Mapping
from types import FrameType

from tandem import parent_death
from tandem.config import PARENT_PID_ENV, child_environment, take_parent_pid

log = logging.getLogger(__name__)


def die_with_parent(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's environment) for a child that must receive SIGTERM when
    this process dies, once it has called `arm_parent_death_signal()`. Start the child in the
    thread that outlives it: the kernel sends the signal when that *thread* ends."""
    return {**(child_environment() if env is None else env), PARENT_PID_ENV: str(os.getpid())}


def arm_parent_death_signal() -> None:
    """In a child started with `die_with_parent()`'s environment: SIGTERM when its launcher dies,
    at once if it has died already. The variable goes, so this process's own children do not
    take it for theirs. A no-op anywhere else, and off Linux."""
    parent = take_parent_pid()
    if parent is not None:
        parent_death.arm(parent)


def interrupt_on_sigterm() -> None:
    """SIGTERM raises KeyboardInterrupt in the main thread, once: a second SIGTERM while the
    cluster stops is logged and ignored (SIGKILL remains for an impatient supervisor). Install it
    again after `ray.init`, which puts its own handler in place."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, already_stopping)
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, interrupt)


def already_stopping(signum: int, frame: FrameType | None) -> None:
    log.warning("SIGTERM again: already stopping")
