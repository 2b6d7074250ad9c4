"""`tandem serve` on Ray stopped by SIGTERM under concurrent streaming load (`make chaos`):

- SIGTERM to a decode worker actor's process (how its pod's deletion reaches it): it drains
  (every request in flight completes: no client sees an error), deregisters and exits; the
  controller replaces it and the pool is back at its size;
- SIGTERM to `tandem serve` itself (how Kubernetes stops the head): every request ends
  (completed, or refused once the router stopped, `UNHANDLED_AT_STOP` included), the driver
  exits 0 within the drain deadline without Ray's fatal-signal handler (`*** SIGTERM received
  ...`, a stack dump, an abort), and no
  process it started is left: checked by pid (its session's processes: GCS, raylet, Ray's
  agents, the controller and worker actors) and the embedded redis-server, by its socket.

`tandem serve` runs in a session of its own (every Ray process it starts stays in it), with a
local Ray of the machine's CPUs and half a CPU per worker.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from chaos_load import (
    CONNECTION_LOST,
    UNHANDLED_AT_STOP,
    Load,
    check_outcomes,
    reference_of,
    sigterm_under_load,
)
from cluster_helpers import wait_for, wait_printed, wait_workers_idle

from router.router_server import RouterAddress
from tandem.registry import Registry, WorkerRecord

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(400)]

CLIENTS = 4
START_TIMEOUT_S = 180.0  # local Ray, then the worker actors load the model
REPLACE_TIMEOUT_S = 120.0  # the dead actor noticed (3 missed pings), a new one loads the model
DRAIN_TIMEOUT_S = 30.0  # a drained worker's process exits within this of its SIGTERM
STOP_TIMEOUT_S = 60.0  # router (10 s), the workers' drain, Redis, Ray's shutdown: loaded
STOPPED = frozenset({"UNAVAILABLE", CONNECTION_LOST, "http 503", UNHANDLED_AT_STOP})


@contextlib.contextmanager
def serving_on_ray(model: Path, log: Path, decode: int) -> Iterator[subprocess.Popen[bytes]]:
    """`tandem serve` (local Ray, 1 prefill + `decode` workers of the tiny model) in a session of
    its own, until it printed `ready`; every process of its session and its Redis killed if the
    block leaves them running."""
    cmd = [
        sys.executable, "-m", "tandem.cli", "serve", "--model", str(model),
        "--decode", str(decode), "--cpus-per-worker", "0.5",
        "--http-port", "0", "--grpc-port", "0", "--no-demo", "--kv-memory-gib", "0.05",
        "--num-threads", "1", "--decode-wait-s", "60",
    ]  # fmt: skip
    with log.open("wb") as out:
        launcher = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_printed(launcher, log, "serving; Ctrl-C", START_TIMEOUT_S)  # after every line
        yield launcher
    finally:
        for pid in started_processes(launcher.pid, registry_url(log)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        launcher.wait()


def address_of(log: Path) -> RouterAddress:
    text = log.read_text()
    http_url = re.search(r"HTTP (http://\S+)", text).group(1)  # type: ignore[union-attr]
    grpc_target = re.search(r"gRPC (\S+)", text).group(1)  # type: ignore[union-attr]
    return RouterAddress(http_url, grpc_target)


def registry_url(log: Path) -> str:
    """The embedded registry's URL, which `tandem serve` prints."""
    found = re.search(r"registry (unix://\S+)", log.read_text())
    return found.group(1) if found else "unix://(not printed)"


def started_processes(session: int, registry: str | None = None) -> set[int]:
    """The live processes of the launcher's session (Ray's included: none starts one of its
    own) and, given its URL, the embedded redis-server (in a session of its own, named
    by its socket)."""
    socket = registry.removeprefix("unix://") if registry else None
    found = set()
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        with contextlib.suppress(ProcessLookupError):
            if os.getsid(p.pid) == session:
                found.add(p.pid)
        if socket and any(socket in arg for arg in p.info["cmdline"] or []):
            found.add(p.pid)
    return found


def actor_process(session: int, record: WorkerRecord) -> psutil.Process:
    """The worker actor's process that serves `record` (it listens on the record's port)."""
    port = int(record.endpoint.rsplit(":", 1)[1])
    for pid in started_processes(session):
        p = psutil.Process(pid)
        with contextlib.suppress(psutil.Error):
            if any(c.laddr and c.laddr.port == port for c in p.net_connections("tcp")):
                return p
    raise AssertionError(f"no process listens on {record.endpoint}")


def test_a_worker_actor_sigterm_drains_its_streams_and_is_replaced(
    tiny_llama_path: Path, offline_tokens: dict[int, list[int]], tmp_path: Path
) -> None:
    log = tmp_path / "serve.log"
    with serving_on_ray(tiny_llama_path, log, decode=2) as launcher:
        address = address_of(log)
        registry = Registry(registry_url(log))
        try:
            reference = reference_of(address, offline_tokens)
            load = Load(address, CLIENTS).start()
            try:
                wait_for(lambda: load.ended() >= CLIENTS, 60.0, "the load to flow")
                victim_record = registry.workers(role="decode")[0]
                victim = actor_process(launcher.pid, victim_record)
                victim.send_signal(signal.SIGTERM)
                victim.wait(DRAIN_TIMEOUT_S)  # drained: its process exits
                assert victim_record.worker_id not in {w.worker_id for w in registry.workers()}
                wait_for(
                    lambda: len(registry.workers(role="decode")) == 2,
                    REPLACE_TIMEOUT_S,
                    "a replacement decode worker",
                )
                done = load.ended()
                wait_for(lambda: load.ended() >= done + CLIENTS, 60.0, "serving on the new one")
            finally:
                outcomes = load.stop()
            check_outcomes(outcomes, reference)  # no error at all: the drain lost nothing
            wait_workers_idle(registry.workers(), 15.0)
        finally:
            registry.close()
    text = log.read_text()
    assert "SIGTERM received" not in text, text


def test_sigterm_to_tandem_serve_on_ray_ends_every_request_and_process(
    tiny_llama_path: Path, offline_tokens: dict[int, list[int]], tmp_path: Path
) -> None:
    log = tmp_path / "serve.log"
    with serving_on_ray(tiny_llama_path, log, decode=1) as launcher:
        address = address_of(log)
        started = [psutil.Process(p) for p in started_processes(launcher.pid, registry_url(log))]
        names = {p.name() for p in started}
        assert {"gcs_server", "raylet", "redis-server"} <= names, names
        reference = reference_of(address, offline_tokens)
        load = Load(address, CLIENTS).start()
        outcomes = sigterm_under_load(launcher, load, STOP_TIMEOUT_S, log)
        check_outcomes(outcomes, reference, STOPPED)
        wait_for(
            lambda: not started_processes(launcher.pid, registry_url(log)),
            5.0,
            "every process it started to end",
        )
        assert not [p for p in started if alive(p)]
    text = log.read_text()
    assert "SIGTERM received" not in text and "Aborted" not in text, text


def alive(process: psutil.Process) -> bool:
    """Running and not a zombie (the same process: psutil checks its start time)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
