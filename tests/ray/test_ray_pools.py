"""The cluster on local Ray (CPU): pools scale under load without failing a request, a killed
worker actor is replaced, and the requests it held end with an error rather than hang.

One module-scoped cluster on the tiny random model; greedy outputs are compared with the offline
engine's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import ray
import ray_helpers
from ray_helpers import greedy_reference

from tandem.cluster.pools import PoolSpec
from tandem.cluster.ray_cluster import RayCluster
from tandem.config import RouterConfig
from tandem.v1 import api_pb2, api_pb2_grpc

pytestmark = pytest.mark.timeout(300)

ENGINE = {"num_blocks": 256, "block_size": 4, "num_threads": 1}
MAX_TOKENS = 12
# Distinct from their first block on, so that prefix-aware routing does not pin them all to the
# prefill worker that cached them first.
PROMPTS = [[3 + (i * 7 + j * 13) % 250 for j in range(40 + 3 * (i % 6))] for i in range(48)]


@pytest.fixture(scope="module")
def cluster(tiny_llama_path: Path) -> Iterator[RayCluster]:
    c = RayCluster(
        str(tiny_llama_path),
        1,
        1,
        http_port=0,
        grpc_port=0,
        engine=ENGINE,
        prefill_pool=PoolSpec(0.5),
        decode_pool=PoolSpec(0.5),
        # decode_wait_s=0: a request whose only decode worker dies fails at once here (the
        # replacement takes a model load); waiting for it is tested on the local cluster
        # (tests/cluster/test_tiny_cluster.py).
        router=RouterConfig(str(tiny_llama_path), local_prefill_tokens=8, decode_wait_s=0.0),
        num_cpus=8,
        heartbeat_ttl_s=1.5,
    )
    c.start(timeout_s=240)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def reference(tiny_llama_path: Path) -> list[list[int]]:
    return greedy_reference(tiny_llama_path, ENGINE, PROMPTS, MAX_TOKENS)


def generate(stub: api_pb2_grpc.TandemStub, prompt: list[int], max_tokens: int = MAX_TOKENS,
             timeout: float = 30.0) -> tuple[list[int], api_pb2.GenerateResponse]:  # fmt: skip
    return ray_helpers.generate(stub, prompt, max_tokens, timeout)


class SteadyLoad:
    """Requests one after another on a thread, recording outputs and errors."""

    def __init__(self, stub: api_pb2_grpc.TandemStub) -> None:
        self.stub = stub
        self.results: list[tuple[int, list[int], str, str]] = []  # prompt, tokens, P, D
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            k = i % len(PROMPTS)
            try:
                tokens, last = generate(self.stub, PROMPTS[k])
                t = last.timings
                self.results.append((k, tokens, t.prefill_worker, t.decode_worker))
            except grpc.RpcError as e:
                self.errors.append(f"{e.code().name}: {e.details()}")
            i += 1

    def __enter__(self) -> SteadyLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


def workers(cluster: RayCluster, role: str) -> set[str]:
    assert cluster.registry is not None
    return {w.worker_id for w in cluster.registry.workers(role=role) if not w.draining}


def test_scale_to_2p2d_and_back_under_load_fails_nothing(
    cluster: RayCluster, reference: list[list[int]]
) -> None:
    assert cluster.router_address is not None
    stub = api_pb2_grpc.TandemStub(grpc.insecure_channel(cluster.router_address.grpc_target))
    before = workers(cluster, "prefill") | workers(cluster, "decode")
    with SteadyLoad(stub) as load:
        assert cluster.scale(prefill=2, decode=2) == {"prefill": 2, "decode": 2}
        cluster.wait_ready(180)
        added = (workers(cluster, "prefill") | workers(cluster, "decode")) - before
        assert len(added) == 2
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until both new workers have served a request
            used = {p for _, _, p, _ in load.results} | {d for _, _, _, d in load.results}
            if added <= used:
                break
            time.sleep(0.2)
        assert added <= used, "the new workers got no requests"
        assert cluster.scale(prefill=1, decode=1) == {"prefill": 1, "decode": 1}
        cluster.wait_ready(120)
        served = len(load.results)
        deadline = time.monotonic() + 30
        while len(load.results) < served + 3 and time.monotonic() < deadline:
            time.sleep(0.1)
    assert load.errors == []
    assert len(load.results) >= served + 3
    for k, tokens, _, _ in load.results:
        assert tokens == reference[k]
    assert len(workers(cluster, "prefill")) == 1 and len(workers(cluster, "decode")) == 1


def test_a_killed_worker_is_replaced_and_its_requests_fail_fast(
    cluster: RayCluster, reference: list[list[int]]
) -> None:
    assert cluster.router_address is not None
    stub = api_pb2_grpc.TandemStub(grpc.insecure_channel(cluster.router_address.grpc_target))
    (victim,) = workers(cluster, "decode")
    assert cluster.router_server is not None and cluster.router_server.router is not None
    longest = cluster.router_server.router.max_model_len - len(PROMPTS[0])
    request = api_pb2.GenerateRequest(
        prompt_token_ids=api_pb2.TokenIds(ids=PROMPTS[0]),
        sampling=api_pb2.SamplingOptions(max_tokens=longest, temperature=0.0, ignore_eos=True),
    )
    streams = [stub.Generate(request, timeout=120) for _ in range(4)]
    for stream in streams:
        next(stream)  # every request is decoding on the victim
    actor = ray.get(cluster.controller.worker_actor.remote(victim))
    killed = time.monotonic()
    ray.kill(actor, no_restart=True)
    codes = []
    for stream in streams:  # each ends: an error if the kill caught it mid-stream, never a hang
        try:
            for _ in stream:
                pass
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as e:
            codes.append(e.code())
    assert time.monotonic() - killed < 30
    assert grpc.StatusCode.UNAVAILABLE in codes
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        fresh = workers(cluster, "decode") - {victim}
        if fresh and victim not in workers(cluster, "decode"):
            break
        time.sleep(0.5)
    assert fresh, "no replacement decode worker registered"
    snapshot = cluster.router_server.snapshot
    assert snapshot.wait_for_refresh(5.0)  # the router has seen the replacement
    tokens, last = generate(stub, PROMPTS[1])
    assert tokens == reference[1]
    assert last.timings.decode_worker in fresh
