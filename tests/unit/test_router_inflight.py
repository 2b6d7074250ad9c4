"""The router's in-flight counts per worker, against scripted worker doubles (in-process gRPC
servers that answer Decode and Prefill as a test tells them): a request counts on a worker
from its pick to its end, the counts the policies see while a request is being placed are the
ones they always saw (P counted before D is picked; the first P still counted while another
retries its prefill), and every count returns to zero however the request ends: served, a
prefill that fails once or everywhere, a decode worker that refuses, or dies (the request
migrates to another one), an abort, a client that leaves, the deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import grpc
import pytest

from router.choices import Choice, derived_seed, merged, request_choices
from router.core import Router
from router.errors import ErrorKind, RouterError
from router.relay import Delta
from tandem.config import RouterConfig
from tandem.registry import WorkerRecord
from tandem.sampling_params import SamplingParams
from tandem.v1 import kv_transfer_pb2 as kvpb
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wpb_grpc

pytestmark = pytest.mark.timeout(60)

LONG = list(range(40, 80))  # over local_prefill_tokens (32): a prefill worker computes it
SHORT = list(range(40, 48))  # the decode worker prefills it
CHUNKS = 3  # token chunks a serving decode worker sends


class FakeSnapshot:
    """The registry snapshot as the router reads it: a fixed listing; marks are noted."""

    def __init__(self) -> None:
        self.records: list[WorkerRecord] = []
        self.marked: list[str] = []

    def workers(self, model: str | None = None, role: str | None = None) -> list[WorkerRecord]:
        return [w for w in self.records if role in (None, w.role) and model in (None, w.model)]

    def mark_down(self, worker_id: str, seconds: float) -> None:
        self.marked.append(worker_id)


class Cluster:
    """Fake workers, one gRPC server each, and the router under test. Each worker notes the
    router's in-flight counts (zeros dropped) when a call reaches it, in `seen`."""

    def __init__(self, router: Router, snapshot: FakeSnapshot) -> None:
        self.router = router
        self.snapshot = snapshot
        self.pushed = asyncio.Event()  # a prefill worker "pushed the KV": D may stream
        self.seen: list[tuple[str, dict[str, int]]] = []
        self.local_calls = 0
        self.decode_requests: list[wpb.WorkerRequest] = []  # each Decode call's, in order
        self.decode_aborts: list[str] = []  # each Abort call's request id, in order
        self._servers: list[grpc.aio.Server] = []

    def note(self, worker_id: str) -> None:
        self.seen.append((worker_id, dict(+self.router.inflight)))

    async def add(self, worker_id: str, role: str, behaviour: str) -> None:
        server = grpc.aio.server()
        if role == "decode":
            wpb_grpc.add_DecodeWorkerServicer_to_server(
                FakeDecode(self, worker_id, behaviour), server
            )
        else:
            wpb_grpc.add_PrefillWorkerServicer_to_server(
                FakePrefill(self, worker_id, behaviour), server
            )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self._servers.append(server)
        now = time.time()
        self.snapshot.records.append(
            WorkerRecord(
                worker_id=worker_id,
                role=role,
                model=self.router.model_name,
                endpoint=f"127.0.0.1:{port}",
                kv_endpoint="",
                metrics_url="",
                kv_blocks_total=100,
                kv_blocks_free=100,
                running=0,
                waiting=0,
                draining=False,
                prefix_hashes=(),
                started_at=now,
                heartbeat_at=now,
            )
        )

    async def stop(self) -> None:
        await self.router.close()
        for server in self._servers:
            await server.stop(None)


class FakeDecode(wpb_grpc.DecodeWorkerServicer):
    """`serve`: the ticket, then (once the KV is pushed, or at once for a local prefill)
    CHUNKS chunks of one token (fewer if max_tokens is lower); `refuse`: UNAVAILABLE before
    the ticket; `die`: UNAVAILABLE after the ticket and one chunk; `endless`: a chunk every
    10 ms, never the last. With n choices, each chunk goes out once per choice, with the token
    97 (a byte of a character, not a whole one) for choice 0 and 64 + i ("a", "b", ...) for
    choice i > 0."""

    def __init__(self, cluster: Cluster, worker_id: str, behaviour: str) -> None:
        self.cluster, self.worker_id, self.behaviour = cluster, worker_id, behaviour

    async def Decode(
        self, request: wpb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[wpb.DecodeResponse]:
        self.cluster.note(self.worker_id)
        self.cluster.decode_requests.append(request.request)
        if self.behaviour == "refuse":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "draining")
        yield wpb.DecodeResponse(ticket=kvpb.KVTicket(request_key=request.request.request_id))
        if request.local_prefill:
            self.cluster.local_calls += 1
        else:
            await self.cluster.pushed.wait()
        chunks = min(CHUNKS, request.request.sampling.max_tokens)
        for i in range(chunks if self.behaviour == "serve" else 1 << 30):
            last = self.behaviour == "serve" and i == chunks - 1
            for index in range(max(request.request.n, 1)):
                chunk = wpb.TokenChunk(
                    token_ids=[64 + index if index else 97],
                    finish_reason="length" if last else "",
                    index=index,
                )
                yield wpb.DecodeResponse(tokens=chunk)
            if self.behaviour == "die":
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker died")
            if self.behaviour == "endless":
                await asyncio.sleep(0.01)

    async def Abort(
        self, request: wpb.WorkerAbortRequest, context: grpc.aio.ServicerContext
    ) -> wpb.WorkerAbortResponse:
        self.cluster.decode_aborts.append(request.request_id)
        return wpb.WorkerAbortResponse()


class FakePrefill(wpb_grpc.PrefillWorkerServicer):
    """`push`: the KV reaches D; `fail`: UNAVAILABLE; `hang`: never answers."""

    def __init__(self, cluster: Cluster, worker_id: str, behaviour: str) -> None:
        self.cluster, self.worker_id, self.behaviour = cluster, worker_id, behaviour

    async def Prefill(
        self, request: wpb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> wpb.PrefillResponse:
        self.cluster.note(self.worker_id)
        if self.behaviour == "fail":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker died")
        if self.behaviour == "hang":
            await asyncio.Event().wait()
        self.cluster.pushed.set()
        return wpb.PrefillResponse(data_plane="shm", prefill_s=0.001)


def run(
    path: Path,
    workers: dict[str, str],
    scenario: Callable[[Cluster], Coroutine[Any, Any, None]],
    **config: Any,
) -> Cluster:
    """Start `workers` (id -> behaviour; ids starting with "p" are prefill workers), a router
    with round-robin picks (so the first of each pool, by id, is picked first), run the
    scenario, then check that every count has returned to zero."""

    async def main() -> Cluster:
        snapshot = FakeSnapshot()
        router_config = RouterConfig(
            str(path), prefill_policy="round_robin", decode_policy="round_robin", **config
        )
        cluster = Cluster(Router(router_config, snapshot), snapshot)
        try:
            for worker_id, behaviour in workers.items():
                role = "prefill" if worker_id.startswith("p") else "decode"
                await cluster.add(worker_id, role, behaviour)
            await scenario(cluster)
            await wait_idle(cluster.router)
        finally:
            await cluster.stop()
        return cluster

    return asyncio.run(main())


async def wait_idle(router: Router, timeout_s: float = 5.0) -> None:
    """Until no worker counts a request (a prefill task's lease ends when the task does, which
    may be a moment after the client's last message)."""
    deadline = time.monotonic() + timeout_s
    while any(router.inflight.values()) or router.admission.inflight:
        assert time.monotonic() < deadline, f"still in flight: {dict(+router.inflight)}"
        await asyncio.sleep(0.01)


async def generate(cluster: Cluster, ids: list[int], **kwargs: Any) -> list[Delta]:
    prep = await cluster.router.prepare(
        SamplingParams(max_tokens=8), prompt_token_ids=ids, **kwargs
    )
    return [d async for d in cluster.router.generate(prep)]


async def failure(cluster: Cluster, ids: list[int], **kwargs: Any) -> RouterError:
    with pytest.raises(RouterError) as e:
        await generate(cluster, ids, **kwargs)
    return e.value


async def abort_during_prefill(
    c: Cluster, stream: AsyncGenerator[Delta, None], request_id: str
) -> None:
    """Abort the request of `stream` once D is open and P reached; its only message says so."""
    first = asyncio.ensure_future(anext(stream))
    while len(c.seen) < 2:
        await asyncio.sleep(0.01)
    assert c.router.abort(request_id)
    assert (await first).finish_reason == "abort"
    await stream.aclose()


def test_served_request_counts_p_before_d_is_picked(tiny_llama_path: Path) -> None:
    async def scenario(c: Cluster) -> None:
        deltas = await generate(c, LONG)
        assert deltas[-1].finish_reason == "length" and deltas[-1].completion_tokens == CHUNKS
        assert deltas[-1].timings is not None
        assert deltas[-1].timings["prefill_worker"] == "p1"

    c = run(tiny_llama_path, {"p1": "push", "d1": "serve"}, scenario)
    assert c.seen == [("d1", {"p1": 1, "d1": 1}), ("p1", {"p1": 1, "d1": 1})]


def test_failed_prefill_is_retried_while_the_first_p_stays_counted(
    tiny_llama_path: Path,
) -> None:
    async def scenario(c: Cluster) -> None:
        deltas = await generate(c, LONG)
        assert deltas[-1].timings is not None
        assert deltas[-1].timings["prefill_worker"] == "p2"

    c = run(tiny_llama_path, {"p1": "fail", "p2": "push", "d1": "serve"}, scenario)
    assert c.seen == [
        ("d1", {"p1": 1, "d1": 1}),
        ("p1", {"p1": 1, "d1": 1}),
        ("p2", {"p1": 1, "p2": 1, "d1": 1}),
    ]
    assert (c.router.prefill_retries, c.router.local_prefills) == (1, 0)
    assert c.snapshot.marked == ["p1"]


def test_prefill_failing_everywhere_goes_local_on_d(tiny_llama_path: Path) -> None:
    async def scenario(c: Cluster) -> None:
        deltas = await generate(c, LONG)
        assert deltas[-1].finish_reason == "length"
        assert deltas[-1].timings is not None and deltas[-1].timings["prefill_worker"] == ""

    c = run(tiny_llama_path, {"p1": "fail", "p2": "fail", "d1": "serve"}, scenario)
    assert c.seen[-1] == ("d1", {"d1": 1}), c.seen  # both P leases ended before D reopened
    assert (c.router.prefill_retries, c.router.local_prefills, c.local_calls) == (1, 1, 1)
    # D's local prefill runs under an id of its own: the first call's cancel, which D learns
    # of on another thread, can neither refuse it as a duplicate nor cancel it
    first, local = [r.request_id for r in c.decode_requests]
    assert local == first + "/local"


def test_prefill_failure_under_fail_policy_is_unavailable(tiny_llama_path: Path) -> None:
    async def scenario(c: Cluster) -> None:
        e = await failure(c, LONG)
        assert e.kind == ErrorKind.UNAVAILABLE and "no prefill worker" in e.message

    c = run(tiny_llama_path, {"p1": "fail", "d1": "serve"}, scenario, on_prefill_failure="fail")
    assert c.router.prefill_retries == 0


def test_refusing_decode_worker_is_skipped_for_another(tiny_llama_path: Path) -> None:
    async def scenario(c: Cluster) -> None:
        deltas = await generate(c, SHORT)
        assert deltas[-1].timings is not None and deltas[-1].timings["decode_worker"] == "d2"

    c = run(tiny_llama_path, {"d1": "refuse", "d2": "serve"}, scenario)
    assert c.seen == [("d1", {"d1": 1}), ("d2", {"d2": 1})]
    assert c.snapshot.marked == ["d1"]


def test_no_decode_worker_opens_releases_the_picked_p(tiny_llama_path: Path) -> None:
    async def scenario(c: Cluster) -> None:
        assert (await failure(c, LONG)).kind == ErrorKind.UNAVAILABLE

    c = run(tiny_llama_path, {"p1": "push", "d1": "refuse"}, scenario)
    assert c.seen == [("d1", {"p1": 1, "d1": 1})]


def test_request_migrates_when_its_decode_worker_dies_mid_stream(tiny_llama_path: Path) -> None:
    async def scenario(c: Cluster) -> None:
        prep = await c.router.prepare(
            SamplingParams(max_tokens=CHUNKS, min_tokens=2, seed=7), prompt_token_ids=LONG
        )
        deltas = [d async for d in c.router.generate(prep)]
        assert [t for d in deltas for t in d.token_ids] == [97] * CHUNKS
        final = deltas[-1]
        assert final.finish_reason == "length"
        assert (final.prompt_tokens, final.completion_tokens) == (len(LONG), CHUNKS)
        assert final.timings is not None and final.timings["decode_worker"] == "d2"

    c = run(tiny_llama_path, {"p1": "push", "d1": "die", "d2": "serve"}, scenario)
    first, resumed = c.decode_requests
    # d2 resumes after the one token d1 sent: it ends the prompt, and the budgets shrink by it
    assert list(resumed.prompt_token_ids) == [*LONG, 97]
    assert (resumed.sampling.max_tokens, resumed.sampling.min_tokens) == (CHUNKS - 1, 1)
    assert (resumed.output_offset, resumed.sampling.seed) == (1, 7)
    assert resumed.request_id == first.request_id + "/m1"
    assert c.snapshot.marked == ["d1"] and c.router.migrations == 1
    # d1 and the first P ended before the resumed request was placed
    assert c.seen[2] == ("d2", {"p1": 1, "d2": 1}), c.seen


def test_choices_resume_each_on_its_own_when_their_decode_worker_dies(
    tiny_llama_path: Path,
) -> None:
    async def scenario(c: Cluster) -> None:
        prep = await c.router.prepare(
            SamplingParams(max_tokens=CHUNKS, seed=7), prompt_token_ids=SHORT
        )

        def deltas(choice: Choice) -> AsyncGenerator[Delta, None]:
            return choice.deltas(c.router)

        async with contextlib.aclosing(merged(deltas, request_choices(prep, 2))) as choices:
            got = [item async for item in choices]
        # d1 sent one token of each; each resumed choice is a request of its own on d2 (where
        # the fake's tokens are choice 0's)
        for index, tokens in ((0, [97, 97, 97]), (1, [65, 97, 97])):
            mine = [d for i, d in got if i == index]
            assert [t for d in mine for t in d.token_ids] == tokens
            assert mine[-1].finish_reason == "length"

    c = run(tiny_llama_path, {"d1": "die", "d2": "serve"}, scenario)
    first, *resumed = c.decode_requests
    assert first.n == 2
    rid = first.request_id
    assert sorted((r.request_id, r.n, r.sampling.seed, r.output_offset) for r in resumed) == [
        (f"{rid}/c1/m1", 1, 8, 1),
        (f"{rid}/m1", 1, 7, 1),
    ]
    assert c.router.migrations == 2


def test_migrations_are_bounded(tiny_llama_path: Path) -> None:
    async def scenario(c: Cluster) -> None:
        e = await failure(c, SHORT)
        assert e.kind == ErrorKind.UNAVAILABLE and "the worker died" in e.message

    workers = {"d1": "die", "d2": "die", "d3": "die", "d4": "serve"}
    c = run(tiny_llama_path, workers, scenario)
    assert sorted(c.snapshot.marked) == ["d1", "d2", "d3"] and c.router.migrations == 2
    assert [list(r.prompt_token_ids) for r in c.decode_requests] == [
        SHORT,
        [*SHORT, 97],
        [*SHORT, 97, 97],
    ]


def test_decode_worker_dying_with_no_other_left_is_unavailable(tiny_llama_path: Path) -> None:
    async def scenario(c: Cluster) -> None:
        assert (await failure(c, LONG)).kind == ErrorKind.UNAVAILABLE

    # No wait for a replacement decode worker (test_router_decode_wait.py covers the wait).
    run(tiny_llama_path, {"p1": "push", "d1": "die"}, scenario, decode_wait_s=0)


def test_abort_during_a_hanging_prefill(tiny_llama_path: Path) -> None:
    async def scenario(c: Cluster) -> None:
        prep = await c.router.prepare(SamplingParams(max_tokens=8), prompt_token_ids=LONG)
        await abort_during_prefill(c, c.router.generate(prep), prep.request_id)

    run(tiny_llama_path, {"p1": "hang", "d1": "serve"}, scenario)


def test_client_leaving_mid_stream(tiny_llama_path: Path) -> None:
    async def scenario(c: Cluster) -> None:
        prep = await c.router.prepare(SamplingParams(max_tokens=8), prompt_token_ids=LONG)
        async with contextlib.aclosing(c.router.generate(prep)) as stream:
            assert (await anext(stream)).finish_reason is None
            assert c.router.inflight["d1"] == 1

    run(tiny_llama_path, {"p1": "push", "d1": "endless"}, scenario)


def test_deadline_during_a_hanging_prefill(tiny_llama_path: Path) -> None:
    async def scenario(c: Cluster) -> None:
        assert (await failure(c, LONG, timeout_s=0.3)).kind == ErrorKind.DEADLINE

    run(tiny_llama_path, {"p1": "hang", "d1": "serve"}, scenario)


def test_n_choices_end_together(tiny_llama_path: Path) -> None:
    """n choices are one request upstream (one Decode call with n, one prefill), each choice
    with its own stream; an Abort of the request id ends every choice, and a consumer that
    leaves ends them all on their workers."""

    async def scenario(c: Cluster) -> None:
        prep = await c.router.prepare(SamplingParams(max_tokens=8, seed=5), prompt_token_ids=LONG)
        assert derived_seed(2**63 - 1, 1) == -(2**63)  # wrapped into int64
        finals, started = [], set()

        def deltas(choice: Choice) -> AsyncGenerator[Delta, None]:
            return choice.deltas(c.router)

        async with contextlib.aclosing(merged(deltas, request_choices(prep, 3))) as choices:
            async for index, d in choices:
                if len(started) < 3:
                    started.add(index)
                    if len(started) == 3:  # every choice streams: abort the request's own id
                        assert c.router.abort(prep.request_id)
                if d.finish_reason is not None:
                    finals.append((index, d.finish_reason))
        assert sorted(finals) == [(0, "abort"), (1, "abort"), (2, "abort")]
        (sent,) = c.decode_requests
        assert (sent.request_id, sent.n, sent.sampling.seed) == (prep.request_id, 3, 5)
        assert sorted(w for w, _ in c.seen) == ["d1", "p1"]  # one Decode call, one prefill
        async with contextlib.aclosing(merged(deltas, request_choices(prep, 2))) as two:
            await anext(two)
            assert c.router.admission.inflight == 1

    run(tiny_llama_path, {"p1": "push", "d1": "endless"}, scenario, max_inflight=8)


def test_a_stop_string_ends_its_choice_alone(tiny_llama_path: Path) -> None:
    """Choice 1's text hits the stop string: it ends as "stop" and D is asked to end that
    choice (an Abort of its id); choice 0 runs to its end."""

    async def scenario(c: Cluster) -> None:
        stop = c.router.tokenizer.decode([65])  # choice 1's token
        params = SamplingParams(max_tokens=8, stop=[stop])
        prep = await c.router.prepare(params, prompt_token_ids=SHORT)

        def deltas(choice: Choice) -> AsyncGenerator[Delta, None]:
            return choice.deltas(c.router)

        async with contextlib.aclosing(merged(deltas, request_choices(prep, 2))) as choices:
            finals = {i: d for i, d in [item async for item in choices] if d.finish_reason}
        assert finals[0].finish_reason == "length" and finals[0].completion_tokens == CHUNKS
        assert finals[1].finish_reason == "stop" and finals[1].stop_reason == stop
        for _ in range(100):  # the choice's Abort goes out in the background
            if c.decode_aborts:
                break
            await asyncio.sleep(0.01)
        assert c.decode_aborts == [f"{prep.request_id}/c1"]

    run(tiny_llama_path, {"d1": "serve"}, scenario)
