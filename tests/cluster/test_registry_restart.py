"""The embedded Redis SIGKILLed under load on a 1P1D tiny-Llama cluster: its supervisor starts it
again on the same socket, the workers' next heartbeats list them again, and the cluster serves
again within 30 s. No request past admission is lost: each one completes, and a request refused
meanwhile is refused at admission (UNAVAILABLE, no token sent). No KV block leaks.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cluster_helpers import (
    grpc_stream,
    redis_pid,
    running,
    wait_for,
    wait_router_idle,
    wait_workers_idle,
    workers,
)

from tandem.cluster.local_cluster import LocalCluster

pytestmark = pytest.mark.timeout(180)

WORKER_ARGS = ["--kv-memory-gib", "0.05", "--num-threads", "1"]  # default TTL 3 s: a beat a second
MAX_TOKENS = 24
CLIENTS = 3


@pytest.fixture(scope="module")
def cluster(tiny_llama_path: Path) -> Iterator[LocalCluster]:
    local = LocalCluster(str(tiny_llama_path), http_port=0, grpc_port=0, worker_args=WORKER_ARGS)
    with running(local):
        yield local


def prompt(i: int) -> list[int]:
    """One of four prompts of 40 byte tokens (long enough for a prefill-worker hand-over)."""
    return list(f"{i % 4} a registry that comes back, again and again ".encode()[:40])


class Load:
    """CLIENTS threads sending greedy streaming requests back to back until `stop()`. Each
    request's outcome: ("ok", prompt index, tokens) or ("error", status code, tokens sent
    before the error)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.outcomes: list[tuple[str, object, tuple[int, ...]]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(c,)) for c in range(CLIENTS)]

    def _client(self, c: int) -> None:
        i = c
        while not self._stop.is_set():
            tokens: list[int] = []
            try:
                with grpc_stream(
                    self.target, ids=prompt(i), timeout=30.0, max_tokens=MAX_TOKENS,
                    temperature=0.0, ignore_eos=True,
                ) as call:  # fmt: skip
                    for msg in call:
                        tokens.extend(msg.token_ids)
                outcome: tuple[str, object, tuple[int, ...]] = ("ok", i % 4, tuple(tokens))
            except grpc.RpcError as e:
                outcome = ("error", e.code(), tuple(tokens))
                self._stop.wait(0.05)  # a refused client retries soon, not in a tight loop
            with self._lock:
                self.outcomes.append(outcome)
            i += CLIENTS

    def completed(self) -> int:
        with self._lock:
            return sum(1 for o in self.outcomes if o[0] == "ok")

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60.0)
        assert not any(t.is_alive() for t in self._threads), "a request never ended"


def test_a_killed_embedded_redis_comes_back_under_load(cluster: LocalCluster) -> None:
    assert cluster.address is not None and cluster.registry is not None
    registry = cluster.registry
    url = registry.url
    load = Load(cluster.address.grpc_target)
    load.start()
    try:
        wait_for(lambda: load.completed() >= 2 * CLIENTS, 60.0, "the load to run")
        old_pid = redis_pid(url)
        assert old_pid is not None
        os.kill(old_pid, signal.SIGKILL)
        killed = time.monotonic()
        done_before = load.completed()
        wait_for(lambda: redis_pid(url) not in (None, old_pid), 30.0, "a new redis-server")
        wait_for(
            lambda: sorted(w.role for w in registry.workers()) == ["decode", "prefill"],
            30.0,
            "both workers to heartbeat into the new Redis",
        )
        wait_for(lambda: load.completed() >= done_before + 2 * CLIENTS, 30.0, "serving again")
        recovered_s = time.monotonic() - killed
    finally:
        load.stop()
    assert recovered_s < 30.0
    counts = Counter((o[0], str(o[1]) if o[0] == "error" else "") for o in load.outcomes)
    print(f"recovered in {recovered_s:.2f} s; outcomes {dict(counts)}")
    for kind, detail, tokens in load.outcomes:
        if kind == "ok":
            assert len(tokens) == MAX_TOKENS
        else:  # refused at admission: a clear status, and not a token sent before it
            assert detail == grpc.StatusCode.UNAVAILABLE and not tokens, (detail, tokens)
    by_prompt: dict[object, set[tuple[int, ...]]] = {}
    for kind, detail, tokens in load.outcomes:
        if kind == "ok":
            by_prompt.setdefault(detail, set()).add(tokens)
    assert all(len(outputs) == 1 for outputs in by_prompt.values()), "greedy outputs differ"
    wait_router_idle(cluster, 5.0)
    wait_workers_idle(workers(cluster), 5.0)
