"""`drain_signal` (tandem/drain_signal.py): SIGTERM and SIGINT set it, however many come and
whenever they come, and its `wait` ends with the signal or at its timeout. Its handler takes no
lock: a second signal inside the first one's `Event.set` once left a worker waiting on the
Event's lock forever (its launcher SIGKILLed, `tests/cluster/test_serve_stop.py`)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from tandem.drain_signal import drain_signal


@pytest.fixture(autouse=True)
def handlers() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_sets_it(signum: int) -> None:
    stop = drain_signal()
    assert signal.getsignal(signum) == stop.handle  # else the kill below ends pytest
    started = time.monotonic()
    assert not stop.wait(0.2)
    assert time.monotonic() - started >= 0.2
    os.kill(os.getpid(), signum)
    assert stop.wait(1.0) and stop.wait()


def test_signals_in_a_burst_while_the_main_thread_waits() -> None:
    stop = drain_signal()
    assert signal.getsignal(signal.SIGTERM) == stop.handle

    def send() -> None:
        time.sleep(0.1)
        for _ in range(20):
            os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=send)
    sender.start()
    started = time.monotonic()
    assert stop.wait(5.0)
    assert time.monotonic() - started < 2.0
    sender.join()  # every signal sent while the handler is still there
    time.sleep(0.1)  # and handled
