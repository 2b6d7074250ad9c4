"""The parent-death signal (Linux `PR_SET_PDEATHSIG`): SIGTERM (or another signal) to a process
when the thread that started it ends, or its whole launcher dies (SIGKILL and the OOM killer
included). A process group alone does not do that: its members live on when the leader dies.

- `arm(parent)`: in a child running our code, first thing (`tandem/cluster/lifetime.py`).
- `command(argv, signum)`: `argv` run through `python -I .../parent_death.py PARENT SIGNUM
  PROGRAM ARGS...`, which arms it, then execs PROGRAM (the signal survives `exec`): for a
  program that is not ours, such as the embedded redis-server (`tandem/registry.py`), which
  keeps nothing to flush and so gets SIGKILL: that also ends it while it is stopped (SIGSTOP),
  where a SIGTERM would wait for a SIGCONT that may never come.

The signal follows the *thread* that started the child: start it from a thread that lives as long
as the child should. Neither way runs Python between fork and exec in the launcher's child: a
`preexec_fn` there runs gRPC's fork handlers, which abort the child while other threads of the
launcher use gRPC. Off Linux, nothing is armed.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def arm(parent: int, signum: int = signal.SIGTERM) -> None:
    """`signum` to this process when the thread of process `parent` that started it ends; at
    once if `parent` has died already."""
    if not sys.platform.startswith("linux"):
        return
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    if prctl(ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(signum)) != 0:
        error = ctypes.get_errno()  # a seccomp profile that forbids it, say
        log.warning("PR_SET_PDEATHSIG failed (%s): this process may outlive its launcher",
                    os.strerror(error))  # fmt: skip
    if os.getppid() != parent:  # the launcher died before the signal was armed
        os.kill(os.getpid(), signum)


def command(argv: Sequence[str], signum: int = signal.SIGTERM) -> list[str]:
    """`argv` as a command whose process gets `signum` when the thread of this process that
    starts it ends. This file runs as a script in isolated mode: it needs the standard library
    only."""
    return [
        sys.executable,
        "-I",
        os.path.abspath(__file__),
        str(os.getpid()),
        str(int(signum)),
        *argv,
    ]


def _exec(args: Sequence[str]) -> NoReturn:
    parent, signum, program, *rest = args
    arm(int(parent), int(signum))
    os.execvp(program, [program, *rest])


if __name__ == "__main__":
    _exec(sys.argv[1:])
