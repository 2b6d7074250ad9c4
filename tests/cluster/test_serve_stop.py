"""`tandem serve --no-ray` ends with everything it started: SIGTERM stops it as Ctrl-C does
(router, worker processes, embedded redis-server), its worker processes and its redis-server die
with it even when it is SIGKILLed (the parent-death signal), and a worker process that dies is
started again. Sim workers on the tiny model: they start fast."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import psutil
import pytest
from cluster_helpers import wait_printed

START_TIMEOUT_S = 90.0
RESTART_TIMEOUT_S = 60.0  # a dead worker's process is noticed in 1 s, then starts and registers
STOP_TIMEOUT_S = 20.0  # the workers drain (nothing in flight) and the redis-server shuts down


@contextlib.contextmanager
def serving(model: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`tandem serve --no-ray --engine sim` on free ports, until it printed `ready`; killed (and
    what it left) if the test leaves it running."""
    cmd = [
        sys.executable, "-m", "tandem.cli", "serve", "--no-ray", "--engine", "sim",
        "--model", str(model), "--http-port", "0", "--grpc-port", "0", "--no-demo",
        "--kv-memory-gib", "0.05",
    ]  # fmt: skip
    with log.open("wb") as out:
        launcher = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    started = [launcher.pid]
    try:
        wait_printed(launcher, log, "ready", START_TIMEOUT_S)
        started += [p.pid for p in started_processes(launcher.pid)]
        yield launcher
    finally:
        for pid in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        launcher.wait()


def started_processes(launcher: int) -> list[psutil.Process]:
    """The launcher's children: its two worker processes and its embedded redis-server."""
    children = psutil.Process(launcher).children()
    assert sorted(p.name() == "redis-server" for p in children) == [False, False, True], [
        p.cmdline() for p in children
    ]
    return children


def worker_processes(launcher: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(launcher).children() if p.name() != "redis-server"]


def alive_after(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    return [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.timeout(180)
def test_sigterm_stops_the_launcher_its_workers_and_redis(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    with serving(tiny_llama_path, tmp_path / "serve.log") as launcher:
        children = started_processes(launcher.pid)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(STOP_TIMEOUT_S) == 0, (tmp_path / "serve.log").read_text()
        assert alive_after(children, 2.0) == []


@pytest.mark.timeout(180)
def test_workers_and_redis_die_with_a_sigkilled_launcher(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    with serving(tiny_llama_path, tmp_path / "serve.log") as launcher:
        children = started_processes(launcher.pid)
        launcher.kill()
        launcher.wait()
        assert alive_after(children, STOP_TIMEOUT_S) == []


@pytest.mark.timeout(180)
def test_a_killed_worker_is_started_again(tiny_llama_path: Path, tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with serving(tiny_llama_path, log) as launcher:
        url = re.search(r"HTTP (http://\S+)", log.read_text()).group(1)  # type: ignore[union-attr]
        (victim, *_) = worker_processes(launcher.pid)
        victim.kill()
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while True:  # a new process in its place, registered and serving
            pids = {p.pid for p in worker_processes(launcher.pid)}
            if victim.pid not in pids and len(pids) == 2 and answers(url):
                break
            assert time.monotonic() < deadline, f"no worker came back:\n{log.read_text()}"
            time.sleep(0.5)
        assert "restarted" in log.read_text()


def answers(url: str) -> bool:
    body = {"prompt": "Hello", "max_tokens": 2}
    try:
        return httpx.post(f"{url}/v1/completions", json=body, timeout=10.0).status_code == 200
    except httpx.HTTPError:
        return False
