"""The front door and the whole cluster going away under concurrent streaming load (`make chaos`):

- a `tandem router` process SIGKILLed (a router pod lost): its clients see a clear error
  (UNAVAILABLE, a broken HTTP connection) and retry; the workers free every request and KV block
  its streams held; a router started again on the same ports serves the same greedy outputs;
- SIGTERM to `tandem serve --no-ray` (how Kubernetes and systemd stop it): every request ends
  (completed while the cluster drains, or refused once it stopped: `UNHANDLED_AT_STOP` is one
  way, gRPC's own), the launcher exits 0, and no
  process is left, checked by pid (every process naming the cluster's registry, the embedded
  redis-server included) and by process group.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import psutil
import pytest
from chaos_load import (
    CONNECTION_LOST,
    TTL_S,
    UNHANDLED_AT_STOP,
    WORKER_ARGS,
    Load,
    check_no_process_left,
    check_outcomes,
    cluster_processes,
    reference_of,
    running_clean,
    sigterm_under_load,
)
from cluster_helpers import wait_for, wait_printed, wait_workers_idle, workers

from router.router_server import RouterAddress
from tandem.cluster.lifetime import die_with_parent
from tandem.cluster.local_cluster import LocalCluster

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

CLIENTS = 4
START_TIMEOUT_S = 120.0
RECOVERY_S = 30.0
STOP_TIMEOUT_S = 45.0  # router drain (10 s) + workers' drain + redis-server shutdown, loaded
ROUTER_LOST = frozenset({"UNAVAILABLE", CONNECTION_LOST})
STOPPED = ROUTER_LOST | {"http 503", UNHANDLED_AT_STOP}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ready(http_url: str) -> bool:
    try:
        return httpx.get(f"{http_url}/ready", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def router_process(
    model: str, registry_url: str, address: RouterAddress, log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """`tandem router` on the registry and `address`'s ports, until it is ready; killed if the
    block leaves it running."""
    http_port = address.http_url.rsplit(":", 1)[1]
    grpc_port = address.grpc_target.rsplit(":", 1)[1]
    cmd = [
        sys.executable, "-m", "tandem.cli", "router", "--model", model, "--redis", registry_url,
        "--host", "127.0.0.1", "--http-port", http_port, "--grpc-port", grpc_port,
        "--decode-wait-s", "60",
    ]  # fmt: skip
    with log.open("ab") as out:
        router = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=die_with_parent())
    try:
        wait_for(
            lambda: ready(address.http_url) or router.poll() is not None,
            START_TIMEOUT_S,
            "the router",
        )
        assert router.poll() is None, log.read_text()
        yield router
    finally:
        router.kill()
        router.wait()


def test_a_router_killed_under_load_frees_everything_on_the_workers(
    tiny_llama_path: Path, offline_tokens: dict[int, list[int]], tmp_path: Path
) -> None:
    model = str(tiny_llama_path)
    local = LocalCluster(
        model, http_port=0, grpc_port=0, heartbeat_ttl_s=TTL_S, worker_args=WORKER_ARGS
    )
    address = RouterAddress(f"http://127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}")
    log = tmp_path / "router.log"
    with running_clean(local):
        assert local.registry is not None
        with router_process(model, local.registry.url, address, log) as router:
            reference = reference_of(address, offline_tokens)
            load = Load(address, CLIENTS).start()
            try:
                wait_for(lambda: load.ended() >= CLIENTS, 60.0, "the load to flow")
                router.kill()
                router.wait()
                # Its streams broke: the workers end them and free their blocks, router or not.
                wait_workers_idle(workers(local), 15.0)
                done = load.ended()
                with router_process(model, local.registry.url, address, log):
                    wait_for(lambda: load.ended() >= done + CLIENTS, RECOVERY_S, "serving again")
            finally:
                outcomes = load.stop()
        kinds = check_outcomes(outcomes, reference, ROUTER_LOST)
        assert kinds.keys() & ROUTER_LOST, f"no client saw the router go: {dict(kinds)}"
        wait_workers_idle(workers(local), 15.0)
        check_no_process_left(local)


@contextlib.contextmanager
def serving(model: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`tandem serve --no-ray` (real workers of the tiny model) in a session of its own, until it
    printed `ready`; its process group and Redis killed if the block leaves them running."""
    cmd = [
        sys.executable, "-m", "tandem.cli", "serve", "--no-ray", "--model", str(model),
        "--http-port", "0", "--grpc-port", "0", "--no-demo", "--kv-memory-gib", "0.05",
        "--num-threads", "1", "--decode-wait-s", "60",
    ]  # fmt: skip
    with log.open("wb") as out:
        launcher = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_printed(launcher, log, "ready", START_TIMEOUT_S)
        yield launcher
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


def registry_url_of(launcher: int) -> str:
    """The registry the launcher gave its worker processes (`--redis URL`)."""
    (cmdline, *_) = (
        p.cmdline() for p in psutil.Process(launcher).children() if "--redis" in p.cmdline()
    )
    return cmdline[cmdline.index("--redis") + 1]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_to_the_whole_cluster_under_load_ends_every_request_and_process(
    tiny_llama_path: Path, offline_tokens: dict[int, list[int]], tmp_path: Path
) -> None:
    log = tmp_path / "serve.log"
    with serving(tiny_llama_path, log) as launcher:
        text = log.read_text()
        http_url = re.search(r"HTTP (http://\S+)", text).group(1)  # type: ignore[union-attr]
        grpc_target = re.search(r"gRPC (\S+)", text).group(1)  # type: ignore[union-attr]
        address = RouterAddress(http_url, grpc_target)
        url = registry_url_of(launcher.pid)
        assert len(cluster_processes(url)) == 3  # 1P + 1D + the redis-server
        reference = reference_of(address, offline_tokens)
        load = Load(address, CLIENTS).start()
        outcomes = sigterm_under_load(launcher, load, STOP_TIMEOUT_S, log)
        check_outcomes(outcomes, reference, STOPPED)
        wait_for(lambda: not group_alive(launcher.pid), 5.0, "the launcher's process group")
        wait_for(lambda: not cluster_processes(url), 5.0, "the cluster's processes to end")
