"""`tandem bench soak`: a local `--no-ray` cluster under mixed streaming load for a set duration,
while a seeded schedule kills its worker processes and its embedded Redis (SIGKILL), which the
cluster's supervisors start again, as `tandem serve --no-ray` does.

    start (2P2D, router in this process) -> load (client threads, back to back)
      -> steady_s -> per fault: kill -> wait until the cluster is whole again (replacement
         registered / Redis back and every worker re-listed: `ready`) -> recovery window
         -> leak check (new requests held back until the in-flight ones end; then every worker
         must run nothing and have every KV block free) -> the next fault at its time
      -> duration reached: load stops, a last leak check, the cluster stops.

The load: `clients` threads sending streaming `/v1/completions` (greedy, their own `timeout`
deadline), mostly short chats and a share of long prompts. Each request's outcome, TTFT, TPOT
and start time are kept; `soak_report` groups them by phase (steady, fault: kill -> ready,
recovery: ready -> + recovery_window_s) and by outcome, and measures each fault's recovery.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import httpx2 as httpx
import redis
from rich.console import Console

from tandem.bench.common import BenchError, passive_omp, write_report
from tandem.bench.machine import machine_info, machine_line
from tandem.cluster.local_cluster import LocalCluster
from tandem.config import DEFAULT_MODEL, RouterConfig
from tandem.registry import WorkerRecord
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wpb_grpc

FAULTS = ("kill_prefill", "kill_decode", "kill_redis")
HUNG_SLACK_S = 5.0  # a client still waiting this long past its deadline counts as hung
READY_TIMEOUT_S = 180.0  # a fault whose cluster is not whole again by then is "not recovered"
LEAK_TIMEOUT_S = 20.0
SHORT = "Question {i}: in two sentences, why does the sky look blue at noon?"
LONG = "Background, part {i}. " + "A cluster serves requests while its parts fail. " * 40


@dataclass(frozen=True)
class SoakConfig:
    model: str = DEFAULT_MODEL
    duration_s: float = 1800.0
    seed: int = 0
    num_prefill: int = 2
    num_decode: int = 2
    clients: int = 3
    steady_s: float = 60.0  # load before the first fault
    fault_interval_s: float = 90.0  # between two faults
    recovery_window_s: float = 10.0  # the phase after a fault's replacement is ready
    deadline_s: float = 60.0  # each request's own
    long_share: float = 0.15  # of requests with the long prompt
    short_tokens: int = 24
    long_tokens: int = 8
    kv_memory_gib: float = 0.25
    worker_threads: int = 1
    heartbeat_ttl_s: float = 1.5

    def __post_init__(self) -> None:
        if self.duration_s < self.steady_s + self.fault_interval_s:
            raise ValueError(
                f"duration_s ({self.duration_s}) must leave room for one fault: at least "
                f"steady_s + fault_interval_s = {self.steady_s + self.fault_interval_s}"
            )
        if self.num_prefill < 1 or self.num_decode < 2:
            raise ValueError("need num_prefill >= 1 and num_decode >= 2 (streams migrate)")
        if self.clients < 1:
            raise ValueError(f"clients must be >= 1, got {self.clients}")
        if not 0 <= self.long_share <= 1:
            raise ValueError(f"long_share must be in [0, 1], got {self.long_share}")

    def quick(self) -> SoakConfig:
        """A pipeline check: a fault of each kind in about a minute."""
        return replace(self, duration_s=60.0, steady_s=5.0, fault_interval_s=18.0)

    def schedule(self) -> list[tuple[float, str]]:
        """(seconds from the start, fault) for each fault: every `fault_interval_s` after
        `steady_s`, the last one an interval before the end; the kinds in seeded rounds of all
        three, so each comes up as often as the others."""
        rng = random.Random(self.seed)
        times = []
        at = self.steady_s
        while at + self.fault_interval_s <= self.duration_s:
            times.append(at)
            at += self.fault_interval_s
        kinds: list[str] = []
        while len(kinds) < len(times):
            kinds += rng.sample(FAULTS, len(FAULTS))
        return list(zip(times, kinds, strict=False))


@dataclass
class Request:
    start_s: float  # from the soak's start
    kind: str  # "short" | "long"
    outcome: str = "hung"  # completed | deadline_exceeded | refused (503|429) | lost | error: ...
    end_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    detail: str = ""  # an error's message


@dataclass
class Fault:
    kind: str
    at_s: float
    victim: str  # the worker id killed, or the Redis pid
    ready_s: float | None = None  # from the soak's start: the cluster whole again
    leak_check: dict[str, Any] = field(default_factory=dict)


class SoakLoad:
    """Client threads sending requests back to back; `hold()` keeps new ones back until the
    in-flight ones have ended (for a leak check), `release()` lets them go again."""

    def __init__(self, http_url: str, config: SoakConfig, t0: float) -> None:
        self.url = f"{http_url}/v1/completions"
        self.config = config
        self.t0 = t0
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._in_flight = 0
        self._stop = threading.Event()
        self._open = threading.Event()
        self._open.set()
        self._threads = [
            threading.Thread(target=self._client, args=(c,), daemon=True)
            for c in range(config.clients)
        ]

    def start(self) -> SoakLoad:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> list[Request]:
        self._stop.set()
        self._open.set()
        for t in self._threads:
            t.join(self.config.deadline_s + 2 * HUNG_SLACK_S)
        with self._lock:
            return list(self.requests)

    def hold(self, timeout_s: float) -> bool:
        """New requests wait; True once none is in flight (within `timeout_s`)."""
        with self._lock:
            self._open.clear()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if self._in_flight == 0:
                    return True
            time.sleep(0.05)
        return False

    def release(self) -> None:
        self._open.set()

    def _client(self, c: int) -> None:
        rng = random.Random(self.config.seed * 1000 + c)
        i = 0
        while not self._stop.is_set():
            self._open.wait()
            with self._lock:  # `hold` clears `_open` under the lock: no request slips past it
                if self._stop.is_set():
                    return
                if not self._open.is_set():
                    continue
                self._in_flight += 1
            try:
                request = self._send(rng, f"{c}.{i}")
            finally:
                with self._lock:
                    self._in_flight -= 1
            with self._lock:
                self.requests.append(request)
            if request.outcome != "completed":
                self._stop.wait(0.1)  # a refused client retries soon, not in a tight loop
            i += 1

    def _send(self, rng: random.Random, tag: str) -> Request:
        c = self.config
        long = rng.random() < c.long_share
        body = {
            "model": c.model,
            "prompt": (LONG if long else SHORT).format(i=tag),
            "max_tokens": c.long_tokens if long else c.short_tokens,
            "temperature": 0.0,
            "ignore_eos": True,  # every request streams its max_tokens: TPOT on equal terms
            "stream": True,
            "timeout": c.deadline_s,
        }
        start = time.monotonic()
        request = Request(start - self.t0, "long" if long else "short")
        chunks: list[float] = []
        try:
            with httpx.stream(
                "POST", self.url, json=body, timeout=c.deadline_s + HUNG_SLACK_S
            ) as r:
                request.outcome = _status_outcome(r.status_code)
                if r.status_code == 200:
                    request.outcome = "lost: no final chunk"
                    for event in _sse(r.iter_lines()):
                        if "error" in event:
                            request.outcome = _error_outcome(event["error"])
                            request.detail = str(event["error"].get("message", ""))[:300]
                            break
                        choice = event["choices"][0]
                        if choice["text"]:
                            chunks.append(time.monotonic())
                        if choice["finish_reason"] is not None:
                            request.outcome = "completed"
                else:
                    request.detail = r.read().decode(errors="replace")[:300]
        except httpx.TimeoutException:
            request.outcome = "hung"
        except httpx.TransportError:
            request.outcome = "lost: connection"
        end = time.monotonic()
        request.end_s = end - self.t0
        if chunks:
            request.ttft_s = chunks[0] - start
            if len(chunks) > 1:
                request.tpot_s = (chunks[-1] - chunks[0]) / (len(chunks) - 1)
        return request


def _status_outcome(status: int) -> str:
    return {200: "completed", 503: "refused (503)", 429: "refused (429)"}.get(
        status, "deadline_exceeded" if status == 504 else f"error: http {status}"
    )


def _error_outcome(error: dict[str, Any]) -> str:
    kind = str(error.get("type", "error"))
    return "deadline_exceeded" if "timeout" in kind or "deadline" in kind else f"error: {kind}"


def _sse(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line.removeprefix("data: "))


def run_soak(config: SoakConfig, json_out: str | None, console: Console) -> dict[str, Any]:
    """Run the soak, print its report, write it (JSON and the chart) when asked; the report."""
    from tandem.bench.soak_report import print_soak, summarize, write_chart

    worker_args = [
        "--kv-memory-gib", str(config.kv_memory_gib), "--num-threads", str(config.worker_threads),
    ]  # fmt: skip
    cluster = LocalCluster(
        config.model, config.num_prefill, config.num_decode, http_port=0, grpc_port=0,
        worker_args=worker_args, heartbeat_ttl_s=config.heartbeat_ttl_s,
        router=RouterConfig(config.model, decode_wait_s=config.deadline_s),
        restart_workers=True,
    )  # fmt: skip
    with passive_omp():
        console.print(f"starting {config.num_prefill}P{config.num_decode}D of {config.model}")
        address = cluster.start()
    try:
        t0 = time.monotonic()
        load = SoakLoad(address.http_url, config, t0).start()
        rng = random.Random(config.seed)
        faults = []
        try:
            for at_s, kind in config.schedule():
                _sleep_until(t0 + at_s)
                fault, before = _inject(cluster, kind, rng, at_s)
                _wait_whole(cluster, config, fault, before, t0)
                console.print(
                    f"[dim]{at_s:7.1f} s  {kind} {fault.victim}: whole again "
                    f"{_rel(fault.ready_s, at_s)}[/dim]"
                )
                _sleep_until(t0 + (fault.ready_s or at_s) + config.recovery_window_s)
                fault.leak_check = _leak_check(cluster, load, config)
                faults.append(fault)
            _sleep_until(t0 + config.duration_s)
            final_check = _leak_check(cluster, load, config)
        finally:
            requests = load.stop()
    finally:
        cluster.stop()
    report = {**summarize(config, requests, faults, final_check), "machine": machine_info()}
    print_soak(report, console)
    console.print(f"[dim]{machine_line(report['machine'])}[/dim]")
    if json_out is not None:
        write_report(report, json_out, write_chart, console)
    return report


def _rel(ready_s: float | None, at_s: float) -> str:
    return "never" if ready_s is None else f"after {ready_s - at_s:.1f} s"


def _sleep_until(t: float) -> None:
    time.sleep(max(t - time.monotonic(), 0.0))


def _listed(cluster: LocalCluster) -> list[WorkerRecord] | None:
    """The registry's listing; None while Redis does not answer."""
    assert cluster.registry is not None
    try:
        return cluster.registry.workers(model=cluster.model)
    except redis.RedisError:
        return None


def _inject(
    cluster: LocalCluster, kind: str, rng: random.Random, at_s: float
) -> tuple[Fault, set[str]]:
    """SIGKILL a worker process of the role (chosen by the seeded generator) or the Redis; the
    fault and the worker ids listed before it."""
    assert cluster.registry is not None
    if kind == "kill_redis":
        client = redis.Redis.from_url(cluster.registry.url, socket_timeout=2.0)
        try:
            pid = int(client.info("server")["process_id"])
        finally:
            client.close()
        os.kill(pid, signal.SIGKILL)
        return Fault(kind, at_s, f"redis pid {pid}"), set()
    role = kind.removeprefix("kill_")
    processes = [w for w in cluster.workers if w.role == role and w.process.poll() is None]
    if not processes:
        raise BenchError(f"no live {role} worker process to kill")
    victim = processes[rng.randrange(len(processes))]
    before = {w.worker_id for w in _listed(cluster) or []}
    victim.process.kill()
    victim.process.wait()
    return Fault(kind, at_s, f"a {role} worker process"), before


def _wait_whole(
    cluster: LocalCluster, config: SoakConfig, fault: Fault, before: set[str], t0: float
) -> None:
    """Until the registry lists every worker again (after a worker kill: a new id in place of
    the killed one, which names the victim); sets `fault.ready_s`, None past READY_TIMEOUT_S."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    sizes = {"prefill": config.num_prefill, "decode": config.num_decode}
    while time.monotonic() < deadline:
        listed = _listed(cluster)
        if listed is not None:
            roles = [w.role for w in listed]
            ids = {w.worker_id for w in listed}
            if all(roles.count(r) == n for r, n in sizes.items()) and (not before or ids - before):
                fault.ready_s = time.monotonic() - t0
                fault.victim = ", ".join(sorted(before - ids)) or fault.victim
                return
        time.sleep(0.1)


def _leak_check(cluster: LocalCluster, load: SoakLoad, config: SoakConfig) -> dict[str, Any]:
    """Hold the load until nothing is in flight, then every worker must run nothing and have
    every KV block free within LEAK_TIMEOUT_S; the load goes on either way."""
    start = time.monotonic()
    try:
        drained = load.hold(config.deadline_s + HUNG_SLACK_S)
        deadline = time.monotonic() + LEAK_TIMEOUT_S
        while True:
            stats = {w.worker_id: _stats(w) for w in _listed(cluster) or []}
            if (stats and all(_idle(s) for s in stats.values())) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        names = ("running", "waiting", "kv_free", "kv_total")
        return {
            "ok": drained and bool(stats) and all(_idle(s) for s in stats.values()),
            "seconds": time.monotonic() - start,
            "workers": {k: dict(zip(names, v, strict=True)) for k, v in stats.items()},
        }
    finally:
        load.release()


def _idle(stats: tuple[int, int, int, int]) -> bool:
    running, waiting, free, total = stats
    return running == waiting == 0 and free == total


def _stats(record: WorkerRecord) -> tuple[int, int, int, int]:
    """running, waiting, free and total KV blocks, from the worker's Stats RPC."""
    stub = wpb_grpc.PrefillWorkerStub if record.role == "prefill" else wpb_grpc.DecodeWorkerStub
    try:
        with grpc.insecure_channel(record.endpoint) as channel:
            s = stub(channel).Stats(wpb.StatsRequest(), timeout=5.0)
    except grpc.RpcError:
        return (-1, -1, 0, -1)
    return (s.running, s.waiting, s.kv_blocks_free, s.kv_blocks_total)
