"""A local cluster as plain processes (`tandem serve --no-ray`): the registry (embedded Redis
unless a URL is given), N prefill and M decode worker processes, and the router in this process.

Start: registry -> workers (each registers itself) -> wait until all are registered -> router.
Stop: router -> SIGTERM to each worker (it drains and deregisters) -> SIGKILL after a grace.
Each worker process gets SIGTERM from the kernel when this process dies, even by SIGKILL
(`PR_SET_PDEATHSIG`, tandem/cluster/lifetime.py). With `restart_workers` (`tandem serve
--no-ray`), a worker process that dies is started again, as Ray restarts its actors: after a
crash backoff (1 s doubling to 30 s) when it died within 30 s of its start.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field

from router.router_server import RouterAddress, RouterServer
from tandem.cluster.lifetime import die_with_parent
from tandem.config import RouterConfig
from tandem.registry import Registry
from tandem.supervisor import ProcessSupervisor, stop_processes

RESTART_POLL_S = 1.0  # how often a supervised worker process is checked
RESTART_BACKOFF_S = (1.0, 30.0)  # a crash-looping worker's restart delay: first, at most
STABLE_S = 30.0  # a worker that lived this long restarts at once when it dies


@dataclass
class WorkerProcess:
    role: str
    process: subprocess.Popen[bytes]


@dataclass
class LocalCluster:
    model: str
    num_prefill: int = 1
    num_decode: int = 1
    redis_url: str | None = None
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    worker_args: list[str] = field(default_factory=list)  # extra `tandem worker` options
    prefill_args: list[str] = field(default_factory=list)
    decode_args: list[str] = field(default_factory=list)
    router: RouterConfig | None = None
    admin_token: str | None = None
    heartbeat_ttl_s: float = 3.0
    restart_workers: bool = False  # start a dead worker process again (`tandem serve --no-ray`)

    def __post_init__(self) -> None:
        self.registry: Registry | None = None
        self.workers: list[WorkerProcess] = []
        self.supervisors: list[ProcessSupervisor] = []
        self.router_server: RouterServer | None = None
        self.address: RouterAddress | None = None

    def start(self, timeout_s: float = 180.0) -> RouterAddress:
        self.registry = Registry(self.redis_url)
        for role, n in (("prefill", self.num_prefill), ("decode", self.num_decode)):
            for _ in range(n):
                self.add_worker(role)
        self.wait_for_workers(self.num_prefill, self.num_decode, timeout_s)
        config = self.router or RouterConfig(self.model)
        self.router_server = RouterServer(
            config,
            self.registry.url,
            self.host,
            self.http_port,
            self.grpc_port,
            self.admin_token,
        )
        self.address = self.router_server.start()
        if self.restart_workers:
            for worker in self.workers:
                self._supervise(worker)
        return self.address

    def add_worker(self, role: str) -> WorkerProcess:
        worker = WorkerProcess(role, self._spawn(role))
        self.workers.append(worker)
        return worker

    def _spawn(self, role: str) -> subprocess.Popen[bytes]:
        """A `tandem worker ROLE` process that dies with this one."""
        assert self.registry is not None
        extra = self.prefill_args if role == "prefill" else self.decode_args
        cmd = [
            sys.executable,
            "-m",
            "tandem.cli",
            "worker",
            role,
            "--model",
            self.model,
            "--redis",
            self.registry.url,
            "--host",
            self.host,
            "--ttl",
            str(self.heartbeat_ttl_s),
            *self.worker_args,
            *extra,
        ]
        return subprocess.Popen(cmd, env=die_with_parent())

    def _supervise(self, worker: WorkerProcess) -> None:
        def restart() -> None:
            worker.process = self._spawn(worker.role)

        first, most = RESTART_BACKOFF_S
        supervisor = ProcessSupervisor(
            f"{worker.role} worker process",
            lambda: worker.process.poll() is None,
            restart,
            poll_s=RESTART_POLL_S,
            backoff_s=first,
            max_backoff_s=most,
            stable_s=STABLE_S,
        )
        supervisor.start()
        self.supervisors.append(supervisor)

    def wait_for_workers(self, num_prefill: int, num_decode: int, timeout_s: float) -> None:
        assert self.registry is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            live = self.registry.workers(model=self.model)
            roles = [w.role for w in live]
            if roles.count("prefill") >= num_prefill and roles.count("decode") >= num_decode:
                return
            dead = [w for w in self.workers if w.process.poll() is not None]
            if dead:
                raise RuntimeError(
                    f"a {dead[0].role} worker exited with {dead[0].process.returncode}"
                )
            time.sleep(0.1)
        raise TimeoutError(f"workers did not register within {timeout_s:.0f} s")

    def stop(self, grace_s: float = 15.0) -> None:
        if self.router_server is not None:
            self.router_server.stop()
        # Before the workers: they stay stopped. (A restarted worker gets SIGTERM as its
        # supervisor's thread ends: PR_SET_PDEATHSIG follows the thread that started it.)
        for supervisor in self.supervisors:
            supervisor.stop()
        stop_processes([w.process for w in self.workers], grace_s)
        if self.registry is not None:
            self.registry.close()

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
