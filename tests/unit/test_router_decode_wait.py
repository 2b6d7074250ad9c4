"""With no decode worker serving, a request waits in the router for a replacement (router/core.py
`_decode_workers`): it completes once one registers; past `decode_wait_s` it is UNAVAILABLE /
503, past its own deadline DEADLINE_EXCEEDED / 504, and beyond `max_decode_waiters` waiting ones
it is refused at once with RESOURCE_EXHAUSTED / 429. A real router (HTTP and gRPC on loopback)
over an embedded registry; the decode worker is a scripted one (one token, prefilled locally).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import httpx2 as httpx
import pytest
from typer.testing import CliRunner

from router.router_server import RouterAddress, RouterServer
from tandem.cli import app
from tandem.config import RouterConfig
from tandem.registry import Registry, WorkerRecord
from tandem.v1 import api_pb2, api_pb2_grpc, kv_transfer_pb2, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.timeout(60)

PROMPT = [5, 6, 7]  # short: the decode worker prefills it


class OneTokenDecode(worker_pb2_grpc.DecodeWorkerServicer):
    """Test double of a decode worker: prefills locally, answers with token 65 ("A")."""

    def Decode(self, request: Any, context: Any) -> Iterator[worker_pb2.DecodeResponse]:
        key = request.request.request_id
        yield worker_pb2.DecodeResponse(ticket=kv_transfer_pb2.KVTicket(request_key=key))
        chunk = worker_pb2.TokenChunk(token_ids=[65], finish_reason="stop")
        yield worker_pb2.DecodeResponse(tokens=chunk)


@pytest.fixture
def registry() -> Iterator[Registry]:
    with Registry() as r:
        yield r


@pytest.fixture
def decode_endpoint() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(OneTokenDecode(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def start_router(model: Path, registry: Registry, **options: Any) -> tuple[RouterServer, Any]:
    config = RouterConfig(str(model), **options)
    server = RouterServer(config, registry.url, http_port=0, grpc_port=0)
    return server, server.start()


def register(registry: Registry, model: Path, endpoint: str) -> None:
    now = time.time()
    record = WorkerRecord(
        "d1", "decode", str(model), endpoint, "", "", 100, 100, 0, 0, False, (), now, now
    )
    registry.register(record, ttl_s=300)


def generate(address: RouterAddress, timeout_s: float = 0.0) -> api_pb2.GenerateResponse:
    with grpc.insecure_channel(address.grpc_target) as channel:
        request = api_pb2.GenerateRequest(
            sampling=api_pb2.SamplingOptions(max_tokens=1), timeout_s=timeout_s
        )
        request.prompt_token_ids.ids.extend(PROMPT)
        *_, last = api_pb2_grpc.TandemStub(channel).Generate(request, timeout=30.0)
        return last


def test_a_request_waits_for_a_replacement_decode_worker(
    tiny_llama_path: Path, registry: Registry, decode_endpoint: str
) -> None:
    server, address = start_router(tiny_llama_path, registry, max_decode_waiters=2)
    try:
        outcomes: list[Any] = []
        waiting = [
            threading.Thread(target=lambda: outcomes.append(generate(address))) for _ in range(2)
        ]
        for t in waiting:
            t.start()
        router = server.router
        assert router is not None
        deadline = time.monotonic() + 10.0
        while router.decode_waiters < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert router.decode_waiters == 2
        body = {"prompt": "abc", "max_tokens": 1}
        r = httpx.post(f"{address.http_url}/v1/completions", json=body, timeout=10.0)
        assert r.status_code == 429, r.text  # a third one: the waiting room is full
        with pytest.raises(grpc.RpcError) as refused:
            generate(address)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        register(registry, tiny_llama_path, decode_endpoint)  # the replacement
        for t in waiting:
            t.join(10.0)
        assert [m.finish_reason for m in outcomes] == ["stop", "stop"]
        assert [list(m.token_ids) for m in outcomes] == [[65], [65]]
        assert router.decode_waiters == 0
    finally:
        server.stop()


def test_no_replacement_in_time_is_unavailable_and_a_deadline_first_is_504(
    tiny_llama_path: Path, registry: Registry
) -> None:
    server, address = start_router(tiny_llama_path, registry, decode_wait_s=0.5)
    try:
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as unavailable:
            generate(address)
        assert unavailable.value.code() == grpc.StatusCode.UNAVAILABLE
        assert 0.5 <= time.monotonic() - start < 5.0
        body = {"prompt": "abc", "max_tokens": 1, "timeout": 0.2}
        r = httpx.post(f"{address.http_url}/v1/completions", json=body, timeout=10.0)
        assert r.status_code == 504, r.text
    finally:
        server.stop()


@pytest.mark.parametrize("command", ["serve", "router"])
@pytest.mark.parametrize(
    ("flag", "field"),
    [("--decode-wait-s", "decode_wait_s"), ("--max-decode-waiters", "max_decode_waiters")],
)
def test_the_wait_is_a_serve_and_router_option(command: str, flag: str, field: str) -> None:
    """The flags reach RouterConfig: a bad value is refused naming the field, before anything
    starts (`serve --no-ray` builds the router's config first)."""
    args = [command, flag, "-1"] + (["--no-ray"] if command == "serve" else [])
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, ValueError) and field in str(result.exception)
