"""How a launcher and the processes it starts end together.

- `die_with_parent()`: a `preexec_fn` that sets `PR_SET_PDEATHSIG` (SIGTERM) in the child between
  fork and exec (Linux), so a launcher killed by SIGKILL takes its worker processes with it. A
  process group alone does not: its members live on when the leader dies.
- `interrupt_on_sigterm()`: SIGTERM (how Kubernetes and systemd stop a process) raises
  KeyboardInterrupt in the main thread, so the launcher stops its cluster as it does on Ctrl-C.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> Callable[[], None] | None:
    """A `subprocess.Popen(preexec_fn=...)` that makes the child receive SIGTERM when this
    process dies (None off Linux). Call it in the thread that starts the child: the kernel sends
    the signal when that *thread* ends, so a child started from a short-lived thread would be
    stopped with it."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in the forked child
    parent = os.getpid()

    def set_parent_death_signal() -> None:
        prctl(ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGTERM))
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), signal.SIGTERM)

    return set_parent_death_signal


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
