"""An engine on its own thread. The engine is single-threaded; other threads (gRPC handlers,
transfer threads) hand it work with `call`, which runs a function on the loop thread between
steps and returns a future.

Loop: run queued calls -> `before_step()` (poll transfers) -> `step()` when there is work ->
`after_step(deltas)`; when no step is due it keeps the executor alive (a tensor-parallel engine's
ranks get a keep-alive now and then) and sleeps until a call arrives, or `idle_s` passes while
something is in flight (`in_flight`: requests waiting on the network, transfers that end without
a call, so polling goes on), or REST_S with nothing at all. An exception in an iteration aborts
the requests in flight (`fail_all`) and the loop goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from tandem.engine.engine_core import EngineCore, RequestDelta
from tandem.engine.request import Request

log = logging.getLogger(__name__)

T = TypeVar("T")

# With nothing in flight, the loop wakes this often (keep-alives: under a tensor-parallel rank's
# KEEPALIVE_S) unless a call comes; an idle worker's loop then costs ~0 of a core, against ~3.5%
# when it polled every idle_s (2 ms; Zen 4, SmolLM2, 7 December).
REST_S = 0.1


class EngineLoop:
    def __init__(self, engine: EngineCore, name: str, idle_s: float = 0.002) -> None:
        self.engine = engine
        self.idle_s = idle_s
        self.draining = False  # set by the server: take no new requests
        self.on_finished: Callable[[Request], None] | None = None  # e.g. latency histograms
        self._calls: queue.Queue[tuple[Callable[[], object], Future[object]]] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._calls.put((lambda: None, Future()))  # wake it
        self._thread.join(timeout_s)

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the loop thread before the next step."""
        future: Future[T] = Future()
        self._calls.put((fn, future))  # type: ignore[arg-type]
        return future

    def num_in_flight(self) -> int:
        """Requests this worker still owes an answer to (read from any thread; approximate)."""
        sched = self.engine.scheduler
        return len(sched.waiting) + len(sched.running) + len(sched.parked) + self._calls.qsize()

    def in_flight(self) -> bool:
        """Whether anything may progress without a call, which `before_step` polls for: requests
        in the engine here; subclasses add their transfers."""
        return bool(self.engine.scheduler.requests)

    def before_step(self) -> None:
        """Hook: runs every iteration on the loop thread."""

    def after_step(self, deltas: list[RequestDelta]) -> None:
        """Hook: what the step produced."""

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.engine.has_unfinished():
                wait_s = 0.0
            else:
                wait_s = self.idle_s if self.in_flight() else REST_S
            try:
                fn, future = self._calls.get(timeout=wait_s)
                self._run_call(fn, future)
                while True:
                    fn, future = self._calls.get_nowait()
                    self._run_call(fn, future)
            except queue.Empty:
                pass
            try:
                self.before_step()
                if self.engine.has_unfinished():
                    deltas = self.engine.step()
                    self.after_step(deltas)
                    if self.on_finished is not None:
                        for d in deltas:
                            if d.finished:
                                self.on_finished(d.request)
                else:
                    self.engine.executor.keep_alive()
            except Exception as e:  # a bug must cost the requests in flight, not the worker
                log.exception("engine step failed; aborting the requests in flight")
                self.fail_all(e)

    def fail_all(self, error: Exception) -> None:
        """Abort every request in the engine; subclasses also tell their callers why."""
        for request_id in list(self.engine.scheduler.requests):
            self.engine.abort(request_id)

    @staticmethod
    def _run_call(fn: Callable[[], object], future: Future[object]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except Exception as e:  # the caller gets it; the loop goes on
            future.set_exception(e)
