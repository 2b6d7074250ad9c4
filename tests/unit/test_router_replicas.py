"""Router replicas behave as one for aborts: an Abort that reaches a replica not holding the
request is forwarded through the registry (Redis pub/sub), and the replica holding it ends it
(finish_reason "abort", the decode worker's call cancelled); after a Redis restart the replicas
subscribe again. Two real routers (gRPC on loopback) over one embedded registry; the decode
worker is a scripted one that streams a token every 20 ms until its call is cancelled.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from router.router_server import RouterServer
from tandem.config import RouterConfig
from tandem.registry import Registry, WorkerRecord
from tandem.v1 import api_pb2, api_pb2_grpc, kv_transfer_pb2, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.timeout(60)


class EndlessDecode(worker_pb2_grpc.DecodeWorkerServicer):
    """Test double of a decode worker: prefills locally, then streams token 65 every 20 ms
    until the call is cancelled (counted in `cancelled`, by gRPC's termination callback: a
    generator cancelled while its response is being sent is never resumed)."""

    def __init__(self) -> None:
        self.cancelled = 0

    def _count_cancel(self) -> None:
        self.cancelled += 1  # the stream is endless: its call ends only when it is cancelled

    def Decode(self, request: Any, context: Any) -> Iterator[worker_pb2.DecodeResponse]:
        context.add_callback(self._count_cancel)
        key = request.request.request_id
        yield worker_pb2.DecodeResponse(ticket=kv_transfer_pb2.KVTicket(request_key=key))
        while context.is_active():
            yield worker_pb2.DecodeResponse(tokens=worker_pb2.TokenChunk(token_ids=[65]))
            time.sleep(0.02)


@dataclass
class Replicas:
    decode: EndlessDecode
    servers: list[RouterServer]
    record: WorkerRecord  # the decode worker's


@pytest.fixture
def replicas(tiny_llama_path: Path) -> Iterator[Replicas]:
    decode = EndlessDecode()
    worker = grpc.server(futures.ThreadPoolExecutor(4))
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(decode, worker)
    port = worker.add_insecure_port("127.0.0.1:0")
    worker.start()
    with Registry() as registry:
        now = time.time()
        record = WorkerRecord(
            "d1", "decode", str(tiny_llama_path), f"127.0.0.1:{port}", "", "", 100, 100, 0, 0,
            False, (), now, now,
        )  # fmt: skip
        registry.register(record, ttl_s=300)
        config = RouterConfig(str(tiny_llama_path))
        servers = [RouterServer(config, registry.url, http_port=0, grpc_port=0) for _ in "ab"]
        try:
            for s in servers:
                s.start()
            yield Replicas(decode, servers, record)
        finally:
            for s in servers:
                s.stop()
            worker.stop(None)


def target(server: RouterServer) -> str:
    assert server.address is not None
    return server.address.grpc_target


def subscribed(server: RouterServer) -> bool:
    listener = server._abort_listener
    return listener is not None and listener.subscribed.wait(10.0)


def abort_through(holder: RouterServer, other: RouterServer, request_id: str) -> None:
    """Start a request on `holder`, abort it through `other`: the stream ends as aborted."""
    request = api_pb2.GenerateRequest(
        request_id=request_id, sampling=api_pb2.SamplingOptions(max_tokens=400)
    )
    request.prompt_token_ids.ids.extend([5, 6, 7])
    ends: list[str] = []
    with grpc.insecure_channel(target(holder)) as channel:
        stream = api_pb2_grpc.TandemStub(channel).Generate(request, timeout=30.0)
        next(stream)  # running on `holder`
        reader = threading.Thread(target=lambda: ends.extend(m.finish_reason for m in stream))
        reader.start()
        with grpc.insecure_channel(target(other)) as other_channel:
            reply = api_pb2_grpc.TandemStub(other_channel).Abort(
                api_pb2.AbortRequest(request_id=request_id), timeout=5.0
            )
        assert reply.found
        reader.join(5.0)
    assert ends and ends[-1] == "abort"


def test_an_abort_reaches_the_replica_holding_the_request(
    replicas: Replicas,
) -> None:
    decode, (a, b) = replicas.decode, replicas.servers
    assert subscribed(a) and subscribed(b)
    abort_through(a, b, "req-on-a")
    deadline = time.monotonic() + 5.0
    while decode.cancelled < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert decode.cancelled == 1  # the decode worker's call ended too: its blocks are freed


def test_after_a_redis_restart_the_replicas_listen_again(
    replicas: Replicas,
) -> None:
    a, b = replicas.servers
    assert subscribed(a) and subscribed(b)
    pid = int(a.registry._client.info("server")["process_id"])
    os.kill(pid, signal.SIGKILL)  # its supervisor starts it again, empty, on the same socket
    deadline = time.monotonic() + 15.0
    while time.monotonic() < deadline:
        try:
            if int(a.registry._client.info("server")["process_id"]) != pid:
                break
        except Exception:
            pass
        time.sleep(0.1)
    a.registry.register(replicas.record, ttl_s=300)  # as the worker's next heartbeat would
    while a.registry.publish_abort(a.config.model, "no-such-request") < 2:  # both listen
        assert time.monotonic() < deadline, "the replicas did not subscribe again"
        time.sleep(0.05)
    abort_through(b, a, "req-on-b")
