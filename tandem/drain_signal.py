"""What SIGTERM or SIGINT sets: a flag that a worker's main loop (or a watcher thread) waits for
before it drains. Its handler only sets the flag, and waiters look at it every SIGNAL_POLL_S: a
handler runs in the main thread between two bytecodes, maybe while that thread holds a lock of
`threading`'s (an Event's, inside its `wait` or `set`; the thread list's, inside
`Thread.start`), and taking that lock there waits forever.

Used by the `--no-ray` worker processes and the simulated cluster (`drain_signal`), and by a
Ray-hosted worker's actor, which installs `handle` itself (tandem/cluster/pools.py).
"""

from __future__ import annotations

import signal
import time
from types import FrameType

SIGNAL_POLL_S = 0.1  # how often a `DrainSignal` waiter looks whether the signal came


class DrainSignal:
    """Whether SIGTERM or SIGINT came, once `drain_signal` (or an owner's own handler) installed
    `handle`. Why the handler only sets a flag, seen: a worker whose launcher was SIGKILLed got a
    second signal inside the first one's `Event.set` and never exited (1 run in 5, Zen 4)."""

    def __init__(self) -> None:
        self.received = False

    def handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = True

    def wait(self, timeout_s: float | None = None) -> bool:
        """Whether a signal came, looking every SIGNAL_POLL_S until it did or `timeout_s`
        passed (None: until it did)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.received:
            left = SIGNAL_POLL_S if deadline is None else deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(left, SIGNAL_POLL_S))
        return self.received


def drain_signal() -> DrainSignal:
    """What SIGTERM or SIGINT sets, from now on. Install it before the server starts and
    registers, so a signal that arrives during startup still drains and deregisters."""
    stop = DrainSignal()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop.handle)
    return stop
