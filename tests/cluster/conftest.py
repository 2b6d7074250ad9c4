"""Fixtures of the end-to-end cluster tests: real worker processes on loopback, the registry and
the router, started once and stopped whatever happens.

- `smol`: SmolLM2 1P2D. The two decode workers differ: one runs n-gram speculative decoding.
  The router takes them in turn (`round_robin`), so any two consecutive requests cover both.
- `smol_llm`: the offline engine on the same model, the reference of the parity tests.
- `tiny`: 2P2D on the tiny random Llama with an 8192-token context (so one request can stream for
  seconds while a test kills its worker), heartbeat TTL 1.5 s, the router's default policies.

Clusters are module-scoped: each module that uses one starts it once, and it is gone (the worker
processes and their shared-memory KV caches) before the next module runs.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_helpers import SMOL, TINY_TTL_S, running

from tandem.cluster.local_cluster import LocalCluster, WorkerProcess
from tandem.config import RouterConfig
from tandem.engine import LLM


class SpecPairCluster(LocalCluster):
    """Its second and later decode workers run n-gram speculative decoding, drafting at every
    step (the cost-aware draft length would draft as this machine's step times say it pays)."""

    def add_worker(self, role: str) -> WorkerProcess:
        if role == "decode" and any(w.role == "decode" for w in self.workers):
            self.decode_args = ["--spec", "ngram", "--no-spec-cost-aware"]
        return super().add_worker(role)


@pytest.fixture(scope="module")
def smol(smollm2_path: Path) -> Iterator[LocalCluster]:
    cluster = SpecPairCluster(
        SMOL,
        num_prefill=1,
        num_decode=2,
        http_port=0,
        grpc_port=0,
        router=RouterConfig(SMOL, decode_policy="round_robin"),
        worker_args=["--kv-memory-gib", "0.25", "--num-threads", "1"],
    )
    with running(cluster):
        yield cluster


@pytest.fixture(scope="module")
def smol_llm(smollm2_path: Path) -> LLM:
    return LLM(str(smollm2_path), dtype="float32", memory_gib=0.25)


@pytest.fixture(scope="session")
def tiny_long_path(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-long")
    shutil.copytree(tiny_llama_path, path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 8192
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def tiny(tiny_long_path: Path) -> Iterator[LocalCluster]:
    cluster = LocalCluster(
        str(tiny_long_path),
        num_prefill=2,
        num_decode=2,
        http_port=0,
        grpc_port=0,
        heartbeat_ttl_s=TINY_TTL_S,
        # the default policies; a replacement decode worker may start slowly on a busy machine
        router=RouterConfig(str(tiny_long_path), decode_wait_s=120.0),
        worker_args=["--kv-memory-gib", "0.1", "--num-threads", "1"],
    )
    with running(cluster):
        yield cluster
