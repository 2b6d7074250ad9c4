"""A simulated cluster on one machine: many sim-engine workers, the real registry and router.

Workers are real WorkerServers (gRPC, KV receiver/sender, registration, heartbeats) around a
sim engine (`engine="sim"`, tandem/engine/sim.py); `procs` host processes each run a share of
them as threads (one OS process per worker is too heavy for 128 workers on a few cores). The
registry is embedded Redis (or a given URL); the router is a `tandem router` process of its own,
so a load generator in this process does not share its interpreter.

    python -m tandem.bench.sim_cluster host --prefill 32 --decode 32 --redis URL ...

is the host-process entry point (SIGTERM: stop every worker, which deregisters it).
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import grpc

from tandem.cluster.lifetime import arm_parent_death_signal, die_with_parent
from tandem.cluster.workers import build_worker
from tandem.config import EngineConfig, WorkerConfig, child_environment
from tandem.drain_signal import drain_signal
from tandem.registry import Registry
from tandem.supervisor import stop_processes
from tandem.worker_server import WorkerServer


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start_sim_workers(
    model: str,
    profile: str | None,
    registry_url: str,
    num_prefill: int,
    num_decode: int,
    host: str = "127.0.0.1",
    ttl_s: float = 5.0,
    memory_gib: float = 1.0,
    max_num_seqs: int = 64,
    idle_s: float = 0.005,
) -> list[WorkerServer]:
    """Start sim workers in this process (each: engine loop thread, gRPC server, registration)."""
    engine = EngineConfig.create(
        model, engine="sim", sim_profile=profile, memory_gib=memory_gib, max_num_seqs=max_num_seqs
    )
    config = WorkerConfig(engine, host=host, registry_url=registry_url, heartbeat_ttl_s=ttl_s)
    roles = ["prefill"] * num_prefill + ["decode"] * num_decode
    servers = [build_worker(role, config) for role in roles]
    for s in servers:
        s.worker.idle_s = idle_s  # type: ignore[attr-defined]  # EngineLoop's idle poll
    return servers


@dataclass
class SimCluster:
    model: str
    profile: str | None = None  # a SimProfile JSON; None: zero costs
    num_prefill: int = 1
    num_decode: int = 1
    procs: int = 1  # worker host processes
    redis_url: str | None = None
    host: str = "127.0.0.1"
    http_port: int = 0  # 0: a free port
    grpc_port: int = 0
    local_prefill_tokens: int = 32
    memory_gib: float = 1.0
    max_num_seqs: int = 64
    ttl_s: float = 5.0
    router_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.registry: Registry | None = None
        self.hosts: list[subprocess.Popen[bytes]] = []
        self.router: subprocess.Popen[bytes] | None = None
        self.http_url = ""
        self.grpc_target = ""

    def start(self, timeout_s: float = 300.0) -> None:
        self.registry = Registry(self.redis_url)
        procs = max(1, min(self.procs, self.num_prefill + self.num_decode))
        for i in range(procs):
            n_p = self.num_prefill // procs + (i < self.num_prefill % procs)
            n_d = self.num_decode // procs + (i < self.num_decode % procs)
            cmd = [
                sys.executable, "-m", "tandem.bench.sim_cluster", "host",
                "--model", self.model, "--redis", self.registry.url, "--host", self.host,
                "--prefill", str(n_p), "--decode", str(n_d), "--ttl", str(self.ttl_s),
                "--memory-gib", str(self.memory_gib), "--max-num-seqs", str(self.max_num_seqs),
            ]  # fmt: skip
            if self.profile:
                cmd += ["--profile", self.profile]
            env = die_with_parent(child_environment(OMP_NUM_THREADS="1"))
            self.hosts.append(subprocess.Popen(cmd, env=env))
        self.wait_for_workers(timeout_s)
        http_port = self.http_port or free_port(self.host)
        grpc_port = self.grpc_port or free_port(self.host)
        self.router = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tandem.cli",
                "router",
                "--model",
                self.model,
                "--redis",
                self.registry.url,
                "--host",
                self.host,
                "--http-port",
                str(http_port),
                "--grpc-port",
                str(grpc_port),
                "--local-prefill-tokens",
                str(self.local_prefill_tokens),
                *self.router_args,
            ],
            env=die_with_parent(child_environment(OMP_NUM_THREADS="1")),
        )
        self.http_url = f"http://{self.host}:{http_port}"
        self.grpc_target = f"{self.host}:{grpc_port}"
        deadline = time.monotonic() + timeout_s
        while True:
            if self.router.poll() is not None:
                raise RuntimeError(f"the router exited with {self.router.returncode}")
            try:
                with grpc.insecure_channel(self.grpc_target) as ch:
                    grpc.channel_ready_future(ch).result(timeout=1.0)
                break
            except grpc.FutureTimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError("the router did not start") from None

    def wait_for_workers(self, timeout_s: float) -> None:
        assert self.registry is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            roles = [w.role for w in self.registry.workers(model=self.model)]
            if roles.count("prefill") >= self.num_prefill and (
                roles.count("decode") >= self.num_decode
            ):
                return
            for p in self.hosts:
                if p.poll() is not None:
                    raise RuntimeError(f"a worker host exited with {p.returncode}")
            time.sleep(0.2)
        raise TimeoutError(f"sim workers did not register within {timeout_s:.0f} s")

    def stop(self, grace_s: float = 20.0) -> None:
        procs = [p for p in (self.router, *self.hosts) if p is not None]
        stop_processes(procs, grace_s)
        if self.registry is not None:
            self.registry.close()

    def __enter__(self) -> SimCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _host_main(argv: list[str]) -> None:
    arm_parent_death_signal()  # the host ends with the benchmark that started it
    ap = argparse.ArgumentParser(prog="tandem.bench.sim_cluster host")
    ap.add_argument("--model", required=True)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--redis", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--prefill", type=int, default=0)
    ap.add_argument("--decode", type=int, default=0)
    ap.add_argument("--ttl", type=float, default=5.0)
    ap.add_argument("--memory-gib", type=float, default=1.0)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    stop = drain_signal()
    servers = start_sim_workers(
        args.model,
        args.profile,
        args.redis,
        args.prefill,
        args.decode,
        args.host,
        args.ttl,
        args.memory_gib,
        args.max_num_seqs,
    )
    stop.wait()
    threads = [threading.Thread(target=s.stop) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15.0)


if __name__ == "__main__":
    if sys.argv[1:2] != ["host"]:
        sys.exit("usage: python -m tandem.bench.sim_cluster host --model M --redis URL ...")
    _host_main(sys.argv[2:])
