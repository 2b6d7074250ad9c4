"""The engine loop's waits (tandem/engine/loop.py): with nothing in flight it rests (wakes every
REST_S, or at once for a call), and while a request waits on the network it polls every
`idle_s`. Counted in loop iterations over a window, not timed: a slow machine only runs fewer."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from decode_worker.decode_core import DecodeWorker
from tandem.config import EngineConfig
from tandem.engine.engine_core import EngineCore
from tandem.engine.loop import REST_S, EngineLoop
from tandem.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW_S = 0.5


class CountingLoop(EngineLoop):
    iterations = 0

    def before_step(self) -> None:
        self.iterations += 1


class CountingDecode(DecodeWorker):
    iterations = 0

    def before_step(self) -> None:
        self.iterations += 1
        super().before_step()


def iterations_in(loop: CountingLoop | CountingDecode, window_s: float = WINDOW_S) -> int:
    start = loop.iterations
    time.sleep(window_s)
    return loop.iterations - start


def test_an_idle_loop_rests_and_a_call_wakes_it(tiny_llama_path: Path) -> None:
    loop = CountingLoop(EngineCore(EngineConfig.create(str(tiny_llama_path), num_blocks=16)), "t")
    loop.start()
    try:
        assert iterations_in(loop) <= WINDOW_S / REST_S + 2  # it polled every 2 ms: ~250
        start = time.monotonic()
        for i in range(10):  # each would wait out a rest if calls did not wake it
            assert loop.call(lambda i=i: i).result(timeout=10) == i
        assert time.monotonic() - start < 10 * REST_S
    finally:
        loop.stop()


def test_a_request_waiting_for_its_kv_keeps_the_decode_loop_polling(
    tiny_llama_path: Path,
) -> None:
    worker = CountingDecode(EngineConfig.create(str(tiny_llama_path), num_blocks=16))
    worker.start()
    try:
        resting = iterations_in(worker)
        ticket, _ = worker.reserve("r", [5, 6, 7], SamplingParams(max_tokens=4))
        assert ticket.result(timeout=10) is not None  # parked, its blocks reserved
        assert worker.call(worker.in_flight).result(timeout=10)
        polling = iterations_in(worker)
        assert polling > 4 * max(resting, 1), (resting, polling)
        worker.cancel("r")
        deadline = time.monotonic() + 10
        while worker.call(worker.in_flight).result(timeout=10):  # the reservation ends
            assert time.monotonic() < deadline
            time.sleep(0.05)
        worker.engine.kv_cache.check_integrity()
    finally:
        worker.close()
