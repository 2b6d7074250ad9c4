"""The process supervisor: restarts with backoff, and a first start on its own thread."""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from types import FrameType

import pytest

from tandem.supervisor import ProcessSupervisor


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


def test_a_launch_runs_on_the_watcher_thread_and_its_error_is_the_caller_s() -> None:
    threads: list[threading.Thread] = []
    supervisor = ProcessSupervisor(
        "launched", lambda: True, lambda: threads.append(threading.current_thread())
    )
    supervisor.start(launch=True)
    try:
        assert len(threads) == 1 and threads[0] is not threading.current_thread()
        assert threads[0].name == "supervisor-launched" and threads[0].is_alive()
    finally:
        supervisor.stop()
    assert not threads[0].is_alive()  # a child armed with the parent-death signal ends now

    def fail() -> None:
        raise OSError("redis-server: no such file")

    failing = ProcessSupervisor("failing", lambda: False, fail, poll_s=0.01)
    with pytest.raises(OSError, match="no such file"):
        failing.start(launch=True)
    failing.stop()  # nothing to stop: the failed launch watched nothing


class Interrupted(Exception):
    """As Ctrl-C's KeyboardInterrupt, raised by a test's signal handler."""


def test_an_interrupted_wait_for_a_launch_stops_the_watcher() -> None:
    """Ctrl-C while the caller waits for the launch: the launch finishes (its process then
    ends with the thread), and the watcher stops instead of running on unowned."""
    release = threading.Event()
    supervisor = ProcessSupervisor("slow", lambda: True, lambda: release.wait(10), poll_s=0.01)

    def interrupt() -> None:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.1)
        release.set()  # the launch succeeds after the interrupt

    def raise_interrupted(signum: int, frame: FrameType | None) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGUSR1, raise_interrupted)
    timer = threading.Timer(0.1, interrupt)
    try:
        timer.start()
        with pytest.raises(Interrupted):
            supervisor.start(launch=True)  # returns: the watcher was told to stop
    finally:
        timer.join()
        signal.signal(signal.SIGUSR1, previous)
    assert supervisor._thread is None and release.is_set()


def test_a_process_that_keeps_dying_at_once_is_restarted_ever_more_slowly() -> None:
    starts: list[float] = []
    done = threading.Event()

    def restart() -> None:  # the process "dies" again as soon as it starts
        starts.append(time.monotonic())
        if len(starts) == 4:
            done.set()

    supervisor = ProcessSupervisor(
        "crash-loop", lambda: done.is_set(), restart, poll_s=0.01, backoff_s=0.05,
        max_backoff_s=1.0, stable_s=10.0,
    )  # fmt: skip
    supervisor.start()
    try:
        assert done.wait(10)
    finally:
        supervisor.stop()
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert gaps[0] >= 0.1 and gaps[1] >= 0.2, gaps  # 0.05 doubled on each quick death
