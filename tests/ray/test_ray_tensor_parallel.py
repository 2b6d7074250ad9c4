"""Tensor-parallel workers on local Ray (CPU, Gloo): each worker of a TP 2 pool is its worker
actor (rank 0) and one rank actor, in the two bundles of the worker's placement group; the
cluster answers with the single-device engine's greedy tokens, with equal TP sizes and with
unequal ones (what `tandem serve --prefill-tp 2 --decode-tp 1` builds: the prefill worker's two
ranks' KV heads assembled into the one decode rank's cache); killing a rank actor takes its
worker out of the registry within the TTL, ends its in-flight requests with an error, and the
controller replaces the whole worker (its actors and placement group gone). A TP size larger than
a worker's bundles or GPUs is refused naming it.

One local Ray for the module and two clusters on it, one after the other: prefill TP 2 ->
decode TP 1, started and stopped within its test, then the module's prefill TP 2 (its KV read
from both ranks) -> decode TP 2 (a decode rank is the one killed: decoding requests are in
flight there); tiny random Llama, float32, one thread per rank.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import ray
import ray_helpers
import torch
from ray.util.placement_group import placement_group, placement_group_table
from ray_helpers import greedy_reference

from tandem.cluster.pools import NAMESPACE, PoolSpec
from tandem.cluster.rank_actors import RayActors
from tandem.cluster.ray_cluster import RayCluster
from tandem.config import RouterConfig
from tandem.v1 import api_pb2, api_pb2_grpc

pytestmark = pytest.mark.timeout(240)

ENGINE = {"num_blocks": 128, "block_size": 4, "num_threads": 1}
TTL_S = 3.0  # each TP worker's collectives time out at half of it
MAX_TOKENS = 8
PROMPTS = [[3 + (i * 7 + j * 13) % 250 for j in range(20 + 3 * i)] for i in range(3)]


@pytest.fixture(scope="module")
def local_ray() -> Iterator[str]:
    """Local Ray for the module's clusters (each joins it: stopping one leaves it up)."""
    ray.init(num_cpus=8, include_dashboard=False, logging_level=logging.WARNING)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def start_cluster(model: Path, address: str, prefill_tp: int, decode_tp: int) -> RayCluster:
    c = RayCluster(
        str(model),
        1,
        1,
        address,
        http_port=0,
        grpc_port=0,
        engine=ENGINE,
        prefill_pool=PoolSpec(0.5, tensor_parallel_size=prefill_tp),
        decode_pool=PoolSpec(0.5, tensor_parallel_size=decode_tp),
        # A request on the killed worker fails at once rather than wait for the replacement.
        router=RouterConfig(str(model), local_prefill_tokens=8, decode_wait_s=0.0),
        heartbeat_ttl_s=TTL_S,
    )
    try:
        c.start(timeout_s=180)
    except BaseException:
        c.stop()
        raise
    return c


@pytest.fixture(scope="module")
def cluster(tiny_llama_path: Path, local_ray: str) -> Iterator[RayCluster]:
    c = start_cluster(tiny_llama_path, local_ray, 2, 2)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def reference(tiny_llama_path: Path) -> list[list[int]]:
    return greedy_reference(tiny_llama_path, ENGINE, PROMPTS, MAX_TOKENS)


def generate(stub: api_pb2_grpc.TandemStub, prompt: list[int]) -> tuple[list[int], str]:
    """Greedy tokens and the decode worker that made them."""
    tokens, last = ray_helpers.generate(stub, prompt, MAX_TOKENS)
    return tokens, last.timings.decode_worker


def workers(cluster: RayCluster, role: str) -> set[str]:
    assert cluster.registry is not None
    return {w.worker_id for w in cluster.registry.workers(role=role)}


def worker_groups() -> dict[str, dict]:
    """The workers' live placement groups by name."""
    return {
        pg["name"]: pg
        for pg in placement_group_table().values()
        if pg["name"].startswith("tandem-") and pg["state"] == "CREATED"
    }


def ranks_placed_and_answering(
    cluster: RayCluster, reference: list[list[int]], tp: dict[str, int]
) -> None:
    """Each worker's ranks in its placement group (`tp`: each role's ranks), one bundle each;
    the cluster answers with the single-device engine's greedy tokens."""
    groups = worker_groups()
    assert sorted(name.split("-")[1] for name in groups) == ["decode", "prefill"]
    free = ray.available_resources()
    for name, pg in groups.items():
        size = tp[name.split("-")[1]]
        assert len(pg["bundles"]) == size
        assert size == 1 or pg["strategy"] == "STRICT_PACK"
        # Bundle 0 holds the worker actor (rank 0), bundle r the rank actor r: all taken.
        for bundle in range(size):
            assert free.get(f"CPU_group_{bundle}_{pg['placement_group_id']}", 0.0) == 0.0
        for rank in range(1, size):
            assert ray.get_actor(f"{name}-rank-{rank}", namespace=NAMESPACE) is not None
    assert cluster.router_address is not None
    stub = api_pb2_grpc.TandemStub(grpc.insecure_channel(cluster.router_address.grpc_target))
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        assert generate(stub, prompt)[0] == expected


def test_unequal_tp_sizes_answer_like_one_device(
    tiny_llama_path: Path, local_ray: str, reference: list[list[int]]
) -> None:
    """Prefill TP 2 -> decode TP 1; before the module's cluster starts (one at a time)."""
    c = start_cluster(tiny_llama_path, local_ray, 2, 1)
    try:
        ranks_placed_and_answering(c, reference, {"prefill": 2, "decode": 1})
    finally:
        c.stop()


def test_ranks_in_the_workers_placement_groups_answer_like_one_device(
    cluster: RayCluster, reference: list[list[int]]
) -> None:
    ranks_placed_and_answering(cluster, reference, {"prefill": 2, "decode": 2})


def test_a_killed_rank_takes_its_worker_out_and_the_worker_is_replaced(
    cluster: RayCluster, reference: list[list[int]]
) -> None:
    assert cluster.router_address is not None and cluster.router_server is not None
    stub = api_pb2_grpc.TandemStub(grpc.insecure_channel(cluster.router_address.grpc_target))
    (victim,) = workers(cluster, "decode")
    (group,) = [name for name in worker_groups() if name.startswith("tandem-decode-")]
    worker_actor = ray.get(cluster.controller.worker_actor.remote(victim))
    rank1 = ray.get_actor(f"{group}-rank-1", namespace=NAMESPACE)
    request = api_pb2.GenerateRequest(
        prompt_token_ids=api_pb2.TokenIds(ids=PROMPTS[0]),
        sampling=api_pb2.SamplingOptions(max_tokens=400, temperature=0.0, ignore_eos=True),
    )
    streams = [stub.Generate(request, timeout=60) for _ in range(2)]
    for stream in streams:
        next(stream)  # decoding on the victim
    ray.kill(rank1, no_restart=True)
    killed = time.monotonic()
    errors = []
    for stream in streams:  # each ends with an error, never hangs
        with pytest.raises(grpc.RpcError) as error:
            for _ in stream:
                pass
        errors.append(error.value)
    ended = time.monotonic() - killed
    while victim in workers(cluster, "decode") and time.monotonic() - killed < TTL_S:
        time.sleep(0.05)
    assert victim not in workers(cluster, "decode"), f"still registered {TTL_S} s after the kill"
    assert ended < TTL_S, f"the in-flight requests took {ended:.1f} s to end"
    codes = {e.code() for e in errors}
    assert codes == {grpc.StatusCode.UNAVAILABLE}, [e.details() for e in errors]

    deadline = time.monotonic() + 120
    while not (fresh := workers(cluster, "decode") - {victim}) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert fresh, "no replacement decode worker registered"
    # The whole worker went: its placement group, its worker actor and its rank actor.
    assert placement_group_table()[_group_id(group)]["state"] == "REMOVED"
    with pytest.raises(ValueError):
        ray.get_actor(f"{group}-rank-1", namespace=NAMESPACE)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(worker_actor.ping.remote(), timeout=10)
    assert cluster.router_server.snapshot.wait_for_refresh(5.0)
    tokens, decode_worker = generate(stub, PROMPTS[1])
    assert tokens == reference[1] and decode_worker in fresh


def _group_id(name: str) -> str:
    (pg_id,) = [k for k, pg in placement_group_table().items() if pg["name"] == name]
    return pg_id


@pytest.mark.usefixtures("cluster")
def test_more_ranks_than_bundles_or_gpus_refused() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 needs 4 GPUs.*per_worker=2"):
        PoolSpec(gpus_per_worker=2, tensor_parallel_size=4)
    pg = placement_group([{"CPU": 0.1}], name="tandem-test-one-bundle")
    ray.get(pg.ready(), timeout=30)
    try:
        launcher = RayActors(pg, "tandem-test-one-bundle", NAMESPACE)
        with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs 2 bundles .* has 1"):
            launcher.device(torch.device("cpu"), 0, 2)
    finally:
        ray.util.remove_placement_group(pg)
