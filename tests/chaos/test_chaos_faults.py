"""Faults under concurrent streaming load (gRPC and SSE clients) on a 2P2D --no-ray cluster of
the tiny random Llama whose dead worker processes are started again, as `tandem serve --no-ray`
does: a prefill worker SIGKILLed (its prefills retried on the other one), a decode worker
SIGKILLed (its streams migrate), a storm of client cancels over both APIs, and (`make chaos`)
a decode worker stopped (SIGSTOP) past its heartbeat TTL, then continued (its streams migrate
though its connections stay open), the embedded Redis SIGKILLed or paused past the heartbeat
TTL. The checks every scenario ends
with (no process left behind among them) are in `chaos_load.py`; `test_chaos_stop.py` has the
router restart and the SIGTERM of a whole `tandem serve --no-ray`.

Each scenario asserts: every request ends, completed or with an error the fault allows, and no
client waits past its deadline; each completed greedy output equals the offline engine's; the
cluster serves again within RECOVERY_S of the fault; once the load stops and the dead worker is
back, no worker holds a request or a KV block, the router holds nothing, and the cluster's
processes are exactly its live workers and Redis.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from chaos_load import (
    TTL_S,
    WORKER_ARGS,
    Load,
    Reference,
    check_no_process_left,
    check_outcomes,
    reference_of,
    running_clean,
)
from cluster_helpers import (
    redis_pid,
    sigkill,
    wait_for,
    wait_router_idle,
    wait_workers_idle,
    worker_process,
    workers,
)

from tandem.cluster.local_cluster import LocalCluster
from tandem.config import RouterConfig

pytestmark = pytest.mark.timeout(240)

CLIENTS = 4
RECOVERY_S = 30.0  # the cluster completes requests again within this of a fault
REFUSED = frozenset({"UNAVAILABLE", "http 503"})  # refused at admission: no worker listed


@pytest.fixture(scope="module")
def cluster(tiny_llama_path: Path) -> Iterator[LocalCluster]:
    local = LocalCluster(
        str(tiny_llama_path),
        num_prefill=2,
        num_decode=2,
        http_port=0,
        grpc_port=0,
        heartbeat_ttl_s=TTL_S,
        worker_args=WORKER_ARGS,
        router=RouterConfig(str(tiny_llama_path), decode_wait_s=60.0),
        restart_workers=True,
    )
    with running_clean(local):
        yield local


@pytest.fixture(scope="module")
def reference(cluster: LocalCluster, offline_tokens: dict[int, list[int]]) -> Reference:
    return reference_of(cluster.address, offline_tokens)


def under_load(
    cluster: LocalCluster,
    reference: Reference,
    fault: Callable[[], str | None],
    allowed: frozenset[str] = frozenset(),
    cancel_rate: float = 0.0,
    after: int = 2 * CLIENTS,
) -> Counter[str]:
    """Run the load, inject `fault` once it flows (it returns the id of the worker it killed,
    if any), run `after` more requests to their end, and check the scenario's promises."""
    assert cluster.address is not None
    load = Load(cluster.address, CLIENTS, cancel_rate, seed=len(cluster.workers)).start()
    try:
        wait_for(lambda: load.ended() >= CLIENTS, 60.0, "the load to flow")
        done = load.ended()
        victim = fault()
        wait_for(lambda: load.ended() > done, RECOVERY_S, "serving again")
        total = load.ended(completed_only=False)
        wait_for(lambda: load.ended(completed_only=False) >= total + after, 120.0, "the requests")
    finally:
        outcomes = load.stop()
    kinds = check_outcomes(outcomes, reference, allowed)

    def whole() -> bool:
        try:
            listed = workers(cluster)
        except redis.ConnectionError:  # a killed Redis is not back yet
            return False
        roles = Counter(w.role for w in listed)
        return roles == {"prefill": 2, "decode": 2} and victim not in {w.worker_id for w in listed}

    wait_for(whole, 60.0, "the killed worker's replacement to be listed in its place")
    wait_router_idle(cluster, 10.0)
    wait_workers_idle(workers(cluster), 10.0)  # no request, no KV block held anywhere
    check_no_process_left(cluster)
    return kinds


def kill_one(cluster: LocalCluster, role: str) -> Callable[[], str]:
    def kill() -> str:
        victim = random.Random(0).choice(workers(cluster, role))
        sigkill(cluster, victim)
        return victim.worker_id

    return kill


def test_a_killed_prefill_worker_costs_no_request(
    cluster: LocalCluster, reference: Reference
) -> None:
    kinds = under_load(cluster, reference, kill_one(cluster, "prefill"))
    assert kinds["completed"] >= 3 * CLIENTS


def test_a_killed_decode_worker_costs_no_request(
    cluster: LocalCluster, reference: Reference
) -> None:
    kinds = under_load(cluster, reference, kill_one(cluster, "decode"))
    assert kinds["completed"] >= 3 * CLIENTS


@pytest.mark.parametrize(
    "storm", [40, pytest.param(400, marks=pytest.mark.chaos)], ids=["40", "400"]
)
def test_a_cancel_storm_leaks_nothing(
    cluster: LocalCluster, reference: Reference, storm: int
) -> None:
    """Requests cancelled by their clients at random points (before the first token, or after
    a few), over gRPC and HTTP, among requests that complete."""
    kinds = under_load(cluster, reference, lambda: None, cancel_rate=0.7, after=storm)
    assert kinds["cancelled by the client"] >= storm // 2


@pytest.mark.chaos
def test_a_stalled_decode_worker_costs_no_request(
    cluster: LocalCluster, reference: Reference
) -> None:
    """SIGSTOP a decode worker with requests running: its process and connections stay, its
    heartbeats stop; the router resumes its streams on the other one (UNLISTED_S after its
    TTL), and once it continues it frees every block of the requests it was cancelled."""
    router = cluster.router_server.router if cluster.router_server else None
    assert router is not None
    migrations = router.migrations

    def stall() -> None:
        victim = random.Random(0).choice(workers(cluster, "decode"))
        process = worker_process(cluster, victim)
        process.send_signal(signal.SIGSTOP)
        try:
            wait_for(lambda: router.migrations > migrations, 20.0, "the streams to migrate")
            time.sleep(TTL_S)  # requests keep going to the other decode worker meanwhile
        finally:
            process.send_signal(signal.SIGCONT)

    kinds = under_load(cluster, reference, stall)
    assert kinds["completed"] >= 3 * CLIENTS


def signal_redis(cluster: LocalCluster, signum: signal.Signals) -> int:
    """Send `signum` to the embedded redis-server; its pid."""
    assert cluster.registry is not None
    pid = redis_pid(cluster.registry.url)
    assert pid is not None
    os.kill(pid, signum)
    return pid


@pytest.mark.chaos
def test_a_killed_embedded_redis_loses_no_admitted_request(
    cluster: LocalCluster, reference: Reference
) -> None:
    def kill() -> None:
        signal_redis(cluster, signal.SIGKILL)  # its supervisor starts it again, empty

    under_load(cluster, reference, kill, REFUSED)


@pytest.mark.chaos
def test_redis_paused_past_the_heartbeat_ttl(cluster: LocalCluster, reference: Reference) -> None:
    def pause() -> None:
        pid = signal_redis(cluster, signal.SIGSTOP)
        try:
            time.sleep(3 * TTL_S)
        finally:
            os.kill(pid, signal.SIGCONT)

    under_load(cluster, reference, pause, REFUSED)
