"""A decode worker that stops answering (router/core.py, "stall"): the router ends each request at
its deadline whatever the worker does (DEADLINE_EXCEEDED / 504, or the stream's timeout error
event once tokens went out), and resumes the request on another decode worker when the stalled
one leaves the registry or its stream makes no progress for `decode_stall_s`; either way the
stalled worker sees the request cancelled (it frees the blocks when it wakes).

A real router (HTTP and gRPC on loopback) over an embedded registry; the decode workers are test
doubles (`StalledDecode`: sends its ticket and one token, then nothing until cancelled), since a
real worker cannot be made to stall on cue in a unit test; `tests/chaos` SIGSTOPs a real one.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import httpx2 as httpx
import pytest

from router.router_server import RouterAddress, RouterServer
from tandem.config import RouterConfig
from tandem.registry import Registry, WorkerRecord
from tandem.v1 import api_pb2, api_pb2_grpc, kv_transfer_pb2, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.timeout(60)

PROMPT = [5, 6, 7]  # short: the decode worker prefills it
FIRST = 65  # the stalled worker's one token
REST = 66  # the healthy worker's tokens
DEADLINE_S = 1.0


class StalledDecode(worker_pb2_grpc.DecodeWorkerServicer):
    """Test double of a decode worker whose engine stops after one token (or, unless
    `answers`, before its ticket): its stream stays open, sending nothing, until the router
    cancels it (`cancelled` lists those requests)."""

    def __init__(self) -> None:
        self.answers = True
        self.started: list[str] = []
        self.cancelled: list[str] = []

    def Decode(self, request: Any, context: Any) -> Iterator[worker_pb2.DecodeResponse]:
        key = request.request.request_id
        self.started.append(key)
        if self.answers:
            yield worker_pb2.DecodeResponse(ticket=kv_transfer_pb2.KVTicket(request_key=key))
            yield worker_pb2.DecodeResponse(tokens=worker_pb2.TokenChunk(token_ids=[FIRST]))
        ended = threading.Event()
        context.add_callback(ended.set)
        ended.wait(30.0)
        if not context.is_active():
            self.cancelled.append(key)


class HealthyDecode(worker_pb2_grpc.DecodeWorkerServicer):
    """Test double of a decode worker that answers REST until the request's max_tokens."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    def Decode(self, request: Any, context: Any) -> Iterator[worker_pb2.DecodeResponse]:
        wreq = request.request
        self.prompts.append(list(wreq.prompt_token_ids))
        ticket = kv_transfer_pb2.KVTicket(request_key=wreq.request_id)
        yield worker_pb2.DecodeResponse(ticket=ticket)
        n = wreq.sampling.max_tokens
        chunk = worker_pb2.TokenChunk(token_ids=[REST] * n, finish_reason="length")
        yield worker_pb2.DecodeResponse(tokens=chunk)


def serve(servicer: worker_pb2_grpc.DecodeWorkerServicer) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(8))
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def registry() -> Iterator[Registry]:
    with Registry() as r:
        yield r


@pytest.fixture
def stalled() -> Iterator[tuple[StalledDecode, str]]:
    double = StalledDecode()
    server, endpoint = serve(double)
    yield double, endpoint
    server.stop(None)


@pytest.fixture
def healthy() -> Iterator[tuple[HealthyDecode, str]]:
    double = HealthyDecode()
    server, endpoint = serve(double)
    yield double, endpoint
    server.stop(None)


def register(
    registry: Registry, model: Path, worker_id: str, endpoint: str, running: int = 0
) -> None:
    """A decode worker record; `running` makes the pick policy avoid it while others serve."""
    now = time.time()
    record = WorkerRecord(
        worker_id, "decode", str(model), endpoint, "", "", 100, 100, running, 0, False, (), now, now
    )
    registry.register(record, ttl_s=300)


def start_router(model: Path, registry: Registry, **options: Any) -> RouterServer:
    config = RouterConfig(str(model), **options)
    server = RouterServer(config, registry.url, http_port=0, grpc_port=0)
    server.start()
    return server


def grpc_generate(address: RouterAddress, max_tokens: int, timeout_s: float = 0.0) -> list[Any]:
    """Every message of a Generate; the client's own deadline is far past the request's."""
    request = api_pb2.GenerateRequest(
        sampling=api_pb2.SamplingOptions(max_tokens=max_tokens, temperature=0.0),
        timeout_s=timeout_s,
    )
    request.prompt_token_ids.ids.extend(PROMPT)
    with grpc.insecure_channel(address.grpc_target) as channel:
        return list(api_pb2_grpc.TandemStub(channel).Generate(request, timeout=30.0))


def wait_until(predicate: Any, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_the_router_ends_a_stalled_request_at_its_deadline(
    tiny_llama_path: Path, registry: Registry, stalled: tuple[StalledDecode, str]
) -> None:
    """gRPC (the worker stalls before its ticket), a whole answer over HTTP and SSE (after one
    token): each ends at its deadline (not the client's), as a server-side timeout, and the
    stalled worker sees each request cancelled."""
    double, endpoint = stalled
    register(registry, tiny_llama_path, "d1", endpoint)
    server = start_router(tiny_llama_path, registry)
    assert server.address is not None
    url = f"{server.address.http_url}/v1/completions"
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0.0, "timeout": DEADLINE_S}
    try:
        start = time.monotonic()
        double.answers = False
        with pytest.raises(grpc.RpcError) as error:
            grpc_generate(server.address, 4, DEADLINE_S)
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - start < DEADLINE_S + 2.0
        double.answers = True

        start = time.monotonic()
        r = httpx.post(url, json=body, timeout=30.0)
        assert r.status_code == 504, r.text
        assert time.monotonic() - start < DEADLINE_S + 2.0

        start = time.monotonic()
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30.0) as r:
            events = [
                json.loads(line.removeprefix("data: "))
                for line in r.iter_lines()
                if line.startswith("data: {")
            ]
        assert time.monotonic() - start < DEADLINE_S + 2.0
        assert server.router is not None
        first = server.router.tokenizer.decode([FIRST])
        assert events[0]["choices"][0]["text"] == first  # the token before the stall
        assert events[-1]["error"]["type"] == "timeout", events[-1]
        wait_until(lambda: len(double.cancelled) == 3)
    finally:
        server.stop()


@pytest.mark.parametrize("how", ["silent", "unlisted"])
def test_a_stalled_decode_worker_s_request_resumes_on_another(
    tiny_llama_path: Path,
    registry: Registry,
    stalled: tuple[StalledDecode, str],
    healthy: tuple[HealthyDecode, str],
    how: str,
) -> None:
    """The stalled worker sends the first token; "silent": it stays listed, and after
    `decode_stall_s` without a message the request resumes elsewhere; "unlisted": it leaves the
    registry (its TTL passed), and the request resumes once that has lasted UNLISTED_S past
    one heartbeat interval. The
    client sees one stream, the stalled worker a cancel."""
    (stalled_double, stalled_at), (healthy_double, healthy_at) = stalled, healthy
    register(registry, tiny_llama_path, "d1", stalled_at)
    register(registry, tiny_llama_path, "d2", healthy_at, running=50)  # picked second
    stall_s = 0.5 if how == "silent" else 60.0
    server = start_router(tiny_llama_path, registry, decode_stall_s=stall_s)
    assert server.address is not None
    address = server.address
    try:
        got: list[Any] = []
        client = threading.Thread(target=lambda: got.extend(grpc_generate(address, 4, 20.0)))
        start = time.monotonic()
        client.start()
        wait_until(lambda: stalled_double.started)
        if how == "unlisted":
            registry.deregister("d1")
        client.join(20.0)
        assert [t for m in got for t in m.token_ids] == [FIRST, REST, REST, REST]
        assert got[-1].finish_reason == "length"
        assert time.monotonic() - start < 10.0
        assert healthy_double.prompts == [[*PROMPT, FIRST]]
        wait_until(lambda: stalled_double.cancelled == stalled_double.started)
        assert server.router is not None and server.router.migrations == 1
    finally:
        server.stop()


def test_decode_stall_s_must_be_positive(tiny_llama_path: Path) -> None:
    with pytest.raises(ValueError, match="decode_stall_s"):
        RouterConfig(str(tiny_llama_path), decode_stall_s=0.0)
