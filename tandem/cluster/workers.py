"""Start a prefill or decode worker from its config: the one place a role becomes a server
(`tandem worker`, the Ray pools' actors and the simulated clusters of the benchmarks)."""

from __future__ import annotations

from decode_worker.decode_servicer import build_decode_server
from prefill_worker.prefill_servicer import build_prefill_server
from tandem.config import WorkerConfig
from tandem.engine.tp.ranks import RankLauncher
from tandem.registry import ROLES
from tandem.worker_server import WorkerServer


def build_worker(
    role: str, config: WorkerConfig, launcher: RankLauncher | None = None
) -> WorkerServer:
    """A started worker of `role`: engine loop, gRPC server, metrics, registration; its
    tensor-parallel ranks 1.. where `launcher` runs them (default: local processes)."""
    if role == "prefill":
        return build_prefill_server(config, launcher)
    if role == "decode":
        return build_decode_server(config, launcher)
    raise ValueError(f"role must be one of {ROLES}, got {role!r}")
