"""Deadlines under concurrent streaming load on a 1P1D --no-ray cluster of the tiny random Llama
whose decode worker gives a KV transfer TRANSFER_TIMEOUT_S, with a prefill worker slowed by the
fault injector ($TANDEM_FAULT_PREFILL_STEP_DELAY_S, read in tandem/config.py) or its transfers
stalled by it ($TANDEM_FAULT_KV_TRAILER_DELAY_S):

- every step slower than the transfer's deadline: each transfer times out on both sides and the
  request falls back (the decode worker prefills it) and completes, greedy equal to the offline
  engine; DEADLINE_EXCEEDED / 504 is the only error allowed, INVALID_ARGUMENT never;
- (`make chaos`) steps faster than the deadline but a queue of prompts longer than it (QUEUE
  at once, one prompt a step): the prefill worker renews each waiting transfer, so none times
  out and every prompt is prefilled there, none locally;
- (`make chaos`) every transfer stalled past its deadline after its last layer (the trailer
  held back, the prefill worker's loop running on): each times out, the request
  falls back and completes, greedy equal to the offline engine, and no KV block is left on
  either worker.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from chaos_load import (
    WORKER_ARGS,
    Load,
    Reference,
    check_no_process_left,
    check_outcomes,
    reference_of,
    running_clean,
)
from cluster_helpers import scrape, wait_for, wait_router_idle, wait_workers_idle, workers

from tandem.cluster.local_cluster import LocalCluster
from tandem.config import FAULT_KV_TRAILER_DELAY, FAULT_PREFILL_STEP_DELAY

pytestmark = pytest.mark.timeout(240)

TRANSFER_TIMEOUT_S = 1.0
QUEUE = 8  # prompts sent at once to a prefill worker that runs one at a time
# The renewal scenario's deadline and step: the last of the queue waits (QUEUE - 1) steps, well
# past the deadline, while a transfer's renewals come a step (or timeout / 4) apart. With a 1 s
# deadline and 0.3 s steps its receiver was seen renewed with only 0.4 s left (2 cores, load
# ~20): a stall of the loaded machine that long timed a transfer out, a flaky failure. With
# these, 0.95 s or more was left at every renewal there.
RENEWAL_TIMEOUT_S = 2.0
RENEWAL_STEP_S = 0.5
SERVER_TIMEOUTS = frozenset({"DEADLINE_EXCEEDED", "http 504", "timeout"})


def faulty_cluster(
    model: Path,
    fault: str,
    seconds: float,
    prefill_args: tuple[str, ...] = (),
    transfer_timeout_s: float = TRANSFER_TIMEOUT_S,
) -> Iterator[LocalCluster]:
    """The cluster, its worker processes started with the fault variable `fault` set."""
    local = LocalCluster(
        str(model),
        http_port=0,
        grpc_port=0,
        worker_args=[*WORKER_ARGS, "--transfer-timeout", str(transfer_timeout_s)],
        prefill_args=list(prefill_args),
    )
    with pytest.MonkeyPatch.context() as env:  # the worker processes inherit it
        env.setenv(fault, str(seconds))
        with running_clean(local):
            yield local


@pytest.fixture(scope="module")
def slowed(tiny_llama_path: Path) -> Iterator[LocalCluster]:
    yield from faulty_cluster(tiny_llama_path, FAULT_PREFILL_STEP_DELAY, 1.5 * TRANSFER_TIMEOUT_S)


def run_load(cluster: LocalCluster, reference: Reference, requests: int, clients: int) -> None:
    assert cluster.address is not None
    load = Load(cluster.address, clients).start()
    try:
        wait_for(lambda: load.ended(completed_only=False) >= requests, 120.0, "the requests")
    finally:
        outcomes = load.stop()
    check_outcomes(outcomes, reference, SERVER_TIMEOUTS)
    wait_router_idle(cluster, 10.0)
    wait_workers_idle(workers(cluster), 10.0)
    check_no_process_left(cluster)


def test_a_prefill_slowed_past_its_deadline_falls_back_and_completes(
    slowed: LocalCluster, offline_tokens: dict[int, list[int]]
) -> None:
    # The reference requests go through the slowed prefill worker too: they fall back already.
    reference = reference_of(slowed.address, offline_tokens)
    run_load(slowed, reference, requests=4, clients=2)
    (decode,) = workers(slowed, "decode")
    failures = scrape(decode.metrics_url)
    assert failures.get("tandem_kv_transfer_failures", 0) > 0, "no transfer timed out"


@pytest.mark.chaos
def test_a_prefill_queue_longer_than_the_deadline_is_renewed(
    tiny_llama_path: Path, offline_tokens: dict[int, list[int]]
) -> None:
    assert (QUEUE - 1) * RENEWAL_STEP_S > 1.5 * RENEWAL_TIMEOUT_S  # the queue outlasts it
    for cluster in faulty_cluster(
        tiny_llama_path,
        FAULT_PREFILL_STEP_DELAY,
        RENEWAL_STEP_S,
        ("--max-num-seqs", "1"),
        RENEWAL_TIMEOUT_S,
    ):
        reference = reference_of(cluster.address, offline_tokens)
        router = cluster.router_server.router  # type: ignore[union-attr]
        assert router is not None
        local_before = router.local_prefills
        run_load(cluster, reference, requests=QUEUE, clients=QUEUE)
        assert router.local_prefills == local_before
        (decode,) = workers(cluster, "decode")
        assert scrape(decode.metrics_url).get("tandem_kv_transfer_failures", 0) == 0


@pytest.mark.chaos
def test_a_kv_transfer_stalled_past_its_timeout_falls_back_and_completes(
    tiny_llama_path: Path, offline_tokens: dict[int, list[int]]
) -> None:
    for cluster in faulty_cluster(tiny_llama_path, FAULT_KV_TRAILER_DELAY, 3 * TRANSFER_TIMEOUT_S):
        reference = reference_of(cluster.address, offline_tokens)  # these fall back already
        run_load(cluster, reference, requests=4, clients=2)
        # The sender's side counts each: the router may end D's side first (an abort, not a
        # failure there) once the prefill worker's reply said the transfer timed out.
        (prefill,) = workers(cluster, "prefill")
        assert scrape(prefill.metrics_url).get("tandem_kv_transfer_failures", 0) > 0
