"""A worker the cluster cannot place is a state, not a silence: on local Ray with 2 CPUs, a decode
pool of 64-CPU workers leaves its worker `pending` with the reason (infeasible: which resource,
how much, what the cluster has), then drops it past the placement timeout with an error event,
the pool's desired size lowered. The reason's wording for a resource taken for now is checked
on the pure function."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import ray

from tandem.cluster.autoscaler import AutoscalerConfig, ClusterMetrics, Decision
from tandem.cluster.pools import (
    ClusterSpec,
    ControllerLoop,
    PoolController,
    PoolSpec,
    placement_reason,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.usefixtures("local_ray")
def test_a_worker_beyond_the_clusters_cpus_is_pending_then_dropped() -> None:
    spec = ClusterSpec("no-model", "redis://unused", decode=PoolSpec(64.0), placement_timeout_s=3.0)
    controller = PoolController(spec, prefill=0, decode=1)
    controller.reconcile()  # starts the slot
    controller.reconcile()  # looks at its placement
    (row,) = controller.status()
    assert row["role"] == "decode" and row["state"] == "pending"
    assert row["reason"] == "infeasible on this cluster: needs CPU 64, the cluster has CPU 2"
    deadline = time.monotonic() + 30.0
    while controller.slots and time.monotonic() < deadline:
        time.sleep(0.5)
        controller.reconcile()
    assert controller.status() == []
    assert controller.desired == {"prefill": 0, "decode": 0}  # not started again
    (event,) = controller.events
    assert event["role"] == "decode" and "infeasible on this cluster" in event["error"]


def test_a_resource_taken_for_now_is_waited_for() -> None:
    bundles = [{"GPU": 1.0, "CPU": 2.0}, {"GPU": 1.0}]
    reason = placement_reason(bundles, {"CPU": 8.0, "GPU": 4.0}, {"CPU": 8.0, "GPU": 1.0})
    assert reason == "waiting for resources: needs GPU 2, free GPU 1"
    assert placement_reason(bundles, {"CPU": 8.0, "GPU": 4.0}, {"CPU": 8.0, "GPU": 4.0}) == (
        "placing"
    )


@pytest.mark.usefixtures("local_ray")
def test_the_controller_counts_pending_workers_and_holds_a_manual_size() -> None:
    """The autoscaler sees the pending worker, and a size set by `scale` (the operator's) stops
    it from growing the pool; `apply` (its own decisions) holds nothing."""
    spec = ClusterSpec("no-model", "redis://unused", decode=PoolSpec(64.0))
    loop = ControllerLoop(
        spec, prefill=0, decode=0, interval_s=3600.0, autoscale=AutoscalerConfig()
    )
    try:
        loop.apply(Decision(0.0, "prefill", 0, 0, "test", overloaded(0.0)))
        loop.scale(decode=1)
        loop.reconcile()
        loop.reconcile()
        assert loop.pending("decode") == 1 and loop.pending("prefill") == 0
        assert loop.autoscaler is not None
        now = time.monotonic()
        decisions = [d for t in (now, now + 60.0) for d in loop.autoscaler.observe(overloaded(t))]
        assert [d.pool for d in decisions] == ["prefill"]  # decode is held, prefill is not
    finally:
        loop.shutdown()


def overloaded(t: float) -> ClusterMetrics:
    """Both pools far over their SLOs."""
    return ClusterMetrics(
        t, 1, 1, ttft_p90_s=9.0, tpot_p90_s=9.0, prefill_queue=50, decode_kv_usage=0.99
    )
