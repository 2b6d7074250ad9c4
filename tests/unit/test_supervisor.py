"""The process supervisor: restarts with backoff, and the liveness check it relies on."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from tandem.supervisor import ProcessSupervisor, process_alive


def test_a_dead_process_is_restarted_after_failed_tries_with_backoff() -> None:
    alive = threading.Event()
    tries: list[float] = []
    restarted = threading.Event()

    def restart() -> None:
        tries.append(time.monotonic())
        if len(tries) < 3:
            raise OSError("redis-server: address in use")
        alive.set()
        restarted.set()

    supervisor = ProcessSupervisor(
        "proc", alive.is_set, restart, poll_s=0.01, backoff_s=0.05, max_backoff_s=0.1
    )
    supervisor.start()
    try:
        assert restarted.wait(10)
        assert len(tries) == 3 and supervisor.restarts == 1
        assert tries[1] - tries[0] >= 0.05 and tries[2] - tries[1] >= 0.1  # doubled
        alive.clear()  # dies again: restarted again, the backoff reset
        restarted.clear()
        assert restarted.wait(10)
        assert supervisor.restarts == 2
    finally:
        supervisor.stop()
    count = len(tries)
    alive.clear()
    time.sleep(0.05)  # five polls' worth: a stopped supervisor restarts nothing
    assert len(tries) == count


@pytest.mark.parametrize(
    ("poll_s", "backoff_s", "max_backoff_s", "field"),
    [(0, 0.1, 1, "poll_s"), (0.5, 0, 1, "backoff_s"), (0.5, 2, 1, "max_backoff_s")],
)
def test_bad_timings_are_refused(
    poll_s: float, backoff_s: float, max_backoff_s: float, field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        ProcessSupervisor(
            "p", lambda: True, lambda: None, poll_s=poll_s, backoff_s=backoff_s,
            max_backoff_s=max_backoff_s,
        )  # fmt: skip


def test_process_alive_counts_a_zombie_as_dead() -> None:
    assert process_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while process_alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.01)  # exited, not yet reaped: a zombie
    assert not process_alive(child.pid)
    assert child.wait(10) == 0
    assert not process_alive(child.pid)  # reaped: gone
