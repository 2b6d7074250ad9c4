"""Keeps a process up: a watcher thread that restarts it when it dies, with backoff.

The embedded Redis (`tandem.registry`) and the worker processes of `tandem serve --no-ray`
(`tandem.cluster.local_cluster`) run under one. Lifecycle:

    start() -> WATCHING: every poll_s, is_alive()? -> no: restart()
                 restart() raised -> wait backoff (doubling from backoff_s up to max_backoff_s),
                                     then check and restart again
                 restart() returned -> WATCHING, backoff reset
                 with stable_s: a process that died within stable_s of its (re)start is
                 restarted only after a crash backoff, doubling while it keeps doing so (a
                 crash loop slows down, as Ray's and systemd's restarts do)
            -> stop(): the thread ends after its current check or restart (never mid-restart)
    start(launch=True): the same, after a first restart() on the watcher's thread (its error is
                        the caller's, and nothing is watched then)

The thread sleeps on an Event between checks (no busy loop) and logs each death and each
restart. It knows nothing of Redis: the owner supplies `is_alive` and `restart`.
`stop_processes` ends such processes: SIGTERM, then SIGKILL past a grace.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

log = logging.getLogger(__name__)


class ProcessSupervisor:
    """Restarts a process through `restart()` whenever `is_alive()` says it died.

    `restarts` counts the successful restarts. `is_alive` and `restart` run on the watcher
    thread only; an exception from either is logged and retried after the backoff.
    """

    def __init__(
        self,
        name: str,
        is_alive: Callable[[], bool],
        restart: Callable[[], None],
        *,
        poll_s: float = 0.5,
        backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
        stable_s: float | None = None,
    ) -> None:
        if not poll_s > 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s}")
        if not 0 < backoff_s <= max_backoff_s:
            raise ValueError(
                f"need 0 < backoff_s <= max_backoff_s, got {backoff_s} and {max_backoff_s}"
            )
        self.name = name
        self.poll_s = poll_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.stable_s = stable_s  # None: every death is restarted at once
        self.restarts = 0
        self._is_alive = is_alive
        self._restart = restart
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, *, launch: bool = False) -> None:
        """Start watching. With `launch`, the watcher's thread first starts the process through
        `restart()`, and this returns once it has, or raises its error (nothing is watched then):
        a child armed with the parent-death signal (`tandem/parent_death.py`) ends with that
        thread, at `stop()` or when this process dies, not with the caller's thread."""
        if self._thread is not None:
            return
        self._stop.clear()
        launched: Future[None] | None = Future() if launch else None
        thread = threading.Thread(
            target=self._watch, args=(launched,), name=f"supervisor-{self.name}", daemon=True
        )
        self._thread = thread
        thread.start()
        if launched is not None:
            try:
                launched.result()
            except BaseException:  # the launch failed, or Ctrl-C while waiting for it
                self._stop.set()
                thread.join()
                self._thread = None
                raise

    def stop(self) -> None:
        """End the watcher; waits for a restart in flight (bounded by the owner's restart)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _watch(self, launched: Future[None] | None) -> None:
        if launched is not None:
            try:
                self._restart()
            except BaseException as error:
                launched.set_exception(error)
                return
            launched.set_result(None)
        backoff = crash_backoff = self.backoff_s
        wait = self.poll_s
        started = time.monotonic()
        while not self._stop.wait(wait):
            try:
                if self._is_alive():
                    wait = self.poll_s
                    continue
                lived = time.monotonic() - started
                if self.stable_s is not None and lived < self.stable_s:
                    log.warning(
                        "%s died %.1f s after its start; restarting it in %.1f s",
                        self.name, lived, crash_backoff,
                    )  # fmt: skip
                    if self._stop.wait(crash_backoff):
                        return
                    crash_backoff = min(crash_backoff * 2, self.max_backoff_s)
                else:
                    log.warning("%s died; restarting it", self.name)
                    crash_backoff = self.backoff_s
                began = time.monotonic()
                self._restart()
                started = time.monotonic()
            except Exception:
                log.exception("%s: restart failed; next try in %.1f s", self.name, backoff)
                wait, backoff = backoff, min(backoff * 2, self.max_backoff_s)
                continue
            self.restarts += 1
            log.warning("%s restarted in %.2f s", self.name, time.monotonic() - began)
            wait, backoff = self.poll_s, self.backoff_s


def stop_processes(processes: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    """SIGTERM each (a worker drains and deregisters), SIGKILL what still runs after `grace_s`."""
    for p in processes:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in processes:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            log.warning("process %d did not stop within %.0f s; killing it", p.pid, grace_s)
            p.kill()
            p.wait()
