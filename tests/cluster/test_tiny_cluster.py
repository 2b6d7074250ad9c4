"""2P2D on the tiny random Llama, default routing policies: concurrent requests spread over both
pools, a repeated prefix goes to the prefill worker that has it cached, and a decode worker killed
with SIGKILL leaves the registry within its TTL while its requests migrate to the other decode
worker (the client's stream goes on, token for token the unmigrated output) and new ones go there;
with every decode worker killed, streams and new requests wait for a replacement.

The last two tests kill workers: they stay last in this module.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import pytest
from cluster_helpers import TINY_TTL_S as TTL_S
from cluster_helpers import (
    grpc_generate,
    grpc_stream,
    http_post,
    scrape,
    sigkill,
    sse_events,
    wait_for,
    wait_router_idle,
    wait_workers_idle,
    worker_stats,
    workers,
)

from tandem.cluster.local_cluster import LocalCluster
from tandem.prefix_hash import block_hashes, prefix_key
from tandem.registry import WorkerRecord

pytestmark = pytest.mark.timeout(240)

BLOCK = 16
LONG = {"max_tokens": 8000, "temperature": 0.0, "ignore_eos": True}  # streams for seconds


def prompt_ids(i: int, n: int = 80) -> list[int]:
    """A distinct prompt (its first block differs from every other i's) of n byte tokens."""
    text = f"{i:03d} the quick brown fox jumps over the lazy dog " * 4
    return list(text.encode()[:n])


def test_concurrent_requests_spread_over_both_pools(tiny: LocalCluster) -> None:
    assert tiny.address is not None
    target = tiny.address.grpc_target

    def run(i: int) -> tuple[str, str]:
        _, last = grpc_generate(target, ids=prompt_ids(i, 192), max_tokens=16, temperature=0.0)
        return last.timings.prefill_worker, last.timings.decode_worker

    with ThreadPoolExecutor(8) as pool:
        served = list(pool.map(run, range(8)))
    prefills = {p for p, _ in served}
    decodes = {d for _, d in served}
    assert prefills == {w.worker_id for w in workers(tiny, "prefill")}, served
    assert decodes == {w.worker_id for w in workers(tiny, "decode")}, served
    wait_router_idle(tiny)
    wait_workers_idle(workers(tiny))


def published(snapshot_workers: list[WorkerRecord], ids: list[int]) -> str | None:
    """The prefill worker whose published prefix summary holds all of the prompt's full blocks."""
    keys = [prefix_key(h) for h in block_hashes(ids, BLOCK)]
    for w in snapshot_workers:
        if w.prefix_hit_blocks(keys) == len(keys):
            return w.worker_id
    return None


def test_a_cached_prefix_goes_to_the_prefill_worker_that_holds_it(tiny: LocalCluster) -> None:
    """Each prefill worker gets a long prompt; after a heartbeat publishes the prefix summaries,
    prompts that extend one of them all go to the worker holding it, and hit its cache."""
    assert tiny.address is not None and tiny.router_server is not None
    target = tiny.address.grpc_target
    snapshot = tiny.router_server.snapshot
    prefills = {w.worker_id: w for w in workers(tiny, "prefill")}
    # Two long prompts at once: least-loaded puts them on different prefill workers (up to ten
    # tries, in case one prefill ends before the other request is routed: a tiny model's
    # 160-token prefill takes milliseconds, and three tries once fell short in CI).
    for attempt in range(10):
        bases = [prompt_ids(100 + 2 * attempt + i, 160) for i in range(2)]
        with ThreadPoolExecutor(2) as pool:
            first = list(
                pool.map(lambda ids: grpc_generate(target, ids=ids, max_tokens=2)[1].timings, bases)
            )
        holder = {tuple(ids): t.prefill_worker for ids, t in zip(bases, first, strict=True)}
        if set(holder.values()) == set(prefills):
            break
    else:
        raise AssertionError(f"both long prompts went to one prefill worker: {holder}")
    # Wait for a heartbeat (ttl/3) to publish the summaries and the router to read them.
    for ids in bases:
        wait_for(
            lambda ids=ids: published(snapshot.workers(role="prefill"), ids) == holder[tuple(ids)],
            3 * TTL_S,
            "the prefix summary to reach the router",
        )
    hits = {w: scrape(r.metrics_url)["tandem_prefix_cache_hit_tokens"] for w, r in prefills.items()}
    for n, ids in enumerate(bases):
        for k in range(3):
            extended = ids + list(f" and then {n}{k} more".encode())
            _, last = grpc_generate(target, ids=extended, max_tokens=2, temperature=0.0)
            assert last.timings.prefill_worker == holder[tuple(ids)]
    for worker_id, record in prefills.items():
        grown = scrape(record.metrics_url)["tandem_prefix_cache_hit_tokens"] - hits[worker_id]
        # Three prompts, each finding the base prompt's 10 full blocks cached.
        assert grown >= 3 * (160 // BLOCK) * BLOCK, (worker_id, grown)
    wait_router_idle(tiny)


def test_killed_decode_worker_leaves_and_its_request_migrates(tiny: LocalCluster) -> None:
    assert tiny.address is not None and tiny.registry is not None
    target = tiny.address.grpc_target
    decodes = workers(tiny, "decode")
    wait_workers_idle(workers(tiny), 5.0)
    ids = prompt_ids(7)
    reference, _ = grpc_generate(target, ids=ids, timeout=60.0, **LONG)  # unmigrated
    with grpc_stream(target, ids=ids, timeout=60.0, **LONG) as call:
        first = next(call)
        assert not first.finish_reason
        (victim,) = [w for w in decodes if worker_stats(w).running]
        (survivor,) = [w for w in decodes if w.worker_id != victim.worker_id]
        killed = sigkill(tiny, victim)
        rest = list(call)
    tokens = [t for msg in [first, *rest] for t in msg.token_ids]
    last = rest[-1]
    assert last.finish_reason == "length" and last.timings.decode_worker == survivor.worker_id
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(ids), len(reference))
    assert tokens == reference  # no token lost, none repeated, the greedy continuation
    wait_for(
        lambda: victim.worker_id not in {w.worker_id for w in tiny.registry.workers()},
        killed + TTL_S + 1.0 - time.monotonic(),
        "the killed worker to leave the registry",
    )
    for i in range(3):
        _, last = grpc_generate(target, ids=prompt_ids(200 + i), max_tokens=4, temperature=0.0)
        assert last.timings.decode_worker == survivor.worker_id
    wait_router_idle(tiny)


def test_with_every_decode_worker_killed_streams_wait_for_a_replacement(
    tiny: LocalCluster,
) -> None:
    """The SSE stream of a request whose decode worker dies goes on on another one; once no
    decode worker is left, it and new requests wait in the router (not 503 at once) and go on
    when a replacement registers."""
    assert tiny.address is not None and tiny.router_server is not None
    router = tiny.router_server.router
    assert router is not None
    snapshot = tiny.router_server.snapshot
    tiny.add_worker("decode")  # in place of the one the test above killed
    wait_for(lambda: len(snapshot.workers(role="decode")) == 2, 60.0, "a second decode worker")
    url = tiny.address.http_url
    body = {"prompt": bytes(prompt_ids(9)).decode(), "stream": True, **LONG}
    with (
        httpx.Client(timeout=120.0) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as r,
        ThreadPoolExecutor(1) as pool,
    ):
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
        assert next(events)["choices"][0]["finish_reason"] is None
        decodes = workers(tiny, "decode")
        (victim,) = [w for w in decodes if worker_stats(w).running]
        sigkill(tiny, victim)
        (survivor,) = [w for w in decodes if w.worker_id != victim.worker_id]
        wait_for(lambda: worker_stats(survivor).running > 0, 10.0, "the request to migrate")
        assert next(events)["choices"][0]["finish_reason"] is None  # the stream goes on
        sigkill(tiny, survivor)
        wait_for(lambda: router.decode_waiters == 1, 10.0, "the stream to wait for a worker")
        short = {"prompt": bytes(prompt_ids(10)).decode(), "max_tokens": 4, "temperature": 0.0}
        waiting = pool.submit(http_post, f"{url}/v1/completions", short)
        wait_for(lambda: router.decode_waiters == 2, 10.0, "the new request to wait too")
        tiny.add_worker("decode")  # the replacement
        event = next(events)  # the stream goes on there
        assert "error" not in event and event["choices"][0]["finish_reason"] is None, event
        answer = waiting.result(60.0)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["finish_reason"] == "length"
    wait_router_idle(tiny, 10.0)
