"""Helpers of the cluster tests: bounded gRPC/HTTP calls, worker Stats and metrics, waits.

Every call here has a timeout, so a broken cluster fails a test instead of hanging it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import httpx2 as httpx
import psutil
import redis

from tandem.cluster.local_cluster import LocalCluster
from tandem.registry import WorkerRecord
from tandem.v1 import api_pb2, api_pb2_grpc
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wpb_grpc

RPC_TIMEOUT_S = 60.0
SMOL = "smollm2-135m"  # the `smol` cluster's model
TINY_TTL_S = 1.5  # the `tiny` cluster's heartbeat TTL
T = TypeVar("T")


# -- gRPC ------------------------------------------------------------------------------------


def generate_request(
    prompt: str | None = None,
    *,
    ids: list[int] | None = None,
    chat: list[dict[str, str]] | None = None,
    model: str = "",
    speculative: bool | None = None,
    **sampling: Any,
) -> api_pb2.GenerateRequest:
    """A tandem.v1 GenerateRequest; `sampling` are SamplingOptions fields."""
    req = api_pb2.GenerateRequest(model=model, sampling=api_pb2.SamplingOptions(**sampling))
    if speculative is not None:
        req.speculative = speculative
    if prompt is not None:
        req.prompt = prompt  # also "": the oneof is set either way
    elif ids is not None:
        req.prompt_token_ids.ids.extend(ids)
    elif chat is not None:
        for m in chat:
            req.chat.messages.add(role=m["role"], content=m["content"])
    return req


def grpc_generate(
    target: str, prompt: str | None = None, *, timeout: float = RPC_TIMEOUT_S, **kwargs: Any
) -> tuple[list[int], api_pb2.GenerateResponse]:
    """Run tandem.v1.Tandem/Generate to the end: (all token ids, the last message)."""
    tokens: list[int] = []
    last = None
    with grpc.insecure_channel(target) as channel:
        stub = api_pb2_grpc.TandemStub(channel)
        for msg in stub.Generate(generate_request(prompt, **kwargs), timeout=timeout):
            tokens.extend(msg.token_ids)
            last = msg
    assert last is not None and last.finish_reason, "the stream ended without a final message"
    return tokens, last


def grpc_error(target: str, prompt: str | None = None, **kwargs: Any) -> grpc.RpcError:
    """The error a Generate call ends with (fails the test if it succeeds)."""
    try:
        grpc_generate(target, prompt, timeout=30.0, **kwargs)
    except grpc.RpcError as e:
        return e
    raise AssertionError("Generate succeeded; expected an error")


@contextlib.contextmanager
def grpc_stream(
    target: str, prompt: str | None = None, *, timeout: float = RPC_TIMEOUT_S, **kwargs: Any
) -> Iterator[Any]:
    """An open Generate call (iterate it for messages; `.cancel()` it); closed on exit."""
    with grpc.insecure_channel(target) as channel:
        call = api_pb2_grpc.TandemStub(channel).Generate(
            generate_request(prompt, **kwargs), timeout=timeout
        )
        try:
            yield call
        finally:
            call.cancel()


def worker_stats(record: WorkerRecord) -> wpb.WorkerStats:
    """The worker's Stats RPC (tandem.v1.PrefillWorker/Stats or DecodeWorker/Stats)."""
    stub_type = (
        wpb_grpc.PrefillWorkerStub if record.role == "prefill" else wpb_grpc.DecodeWorkerStub
    )
    with grpc.insecure_channel(record.endpoint) as channel:
        return stub_type(channel).Stats(wpb.StatsRequest(), timeout=5.0)


def idle(stats: wpb.WorkerStats) -> bool:
    return (
        stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_free == stats.kv_blocks_total
    )


def wait_workers_idle(workers: list[WorkerRecord], timeout_s: float = 2.0) -> float:
    """Seconds until every worker runs nothing and has all its KV blocks free (fails the test
    past `timeout_s`, showing the last Stats)."""
    start = time.monotonic()
    while True:
        stats = {w.worker_id: worker_stats(w) for w in workers}
        if all(idle(s) for s in stats.values()):
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            shown = {
                k: (s.running, s.waiting, s.kv_blocks_free, s.kv_blocks_total)
                for k, s in stats.items()
            }
            raise AssertionError(
                f"workers not idle after {timeout_s} s: (running, waiting, free, total) {shown}"
            )
        time.sleep(0.05)


def wait_router_idle(cluster: LocalCluster, timeout_s: float = 2.0) -> None:
    """Until the router holds no dispatch slot and counts nothing in flight on any worker."""
    assert cluster.router_server is not None
    router = cluster.router_server.router
    assert router is not None
    wait_for(
        lambda: router.admission.inflight == 0 and not any(router.inflight.values()),
        timeout_s,
        f"the router to end its requests (in flight per worker: {dict(router.inflight)})",
    )


# -- HTTP ------------------------------------------------------------------------------------


def http_post(url: str, body: Any = None, *, raw: bytes | None = None) -> httpx.Response:
    """POST JSON (or raw bytes as JSON) with a bounded timeout."""
    if raw is not None:
        headers = {"content-type": "application/json"}
        return httpx.post(url, content=raw, headers=headers, timeout=RPC_TIMEOUT_S)
    return httpx.post(url, json=body, timeout=RPC_TIMEOUT_S)


def sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """The JSON payloads of an SSE stream's `data:` lines, until `[DONE]`."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def scrape(metrics_url: str) -> dict[str, float]:
    """A worker's /metrics as {sample name: value} (labels summed over; counters are also
    listed without their `_total` suffix)."""
    text = httpx.get(metrics_url, timeout=5.0).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if m is None:
            continue
        name, value = m.group(1), float(m.group(3))
        values[name] = values.get(name, 0.0) + value
        if name.endswith("_total"):
            values.setdefault(name[: -len("_total")], values[name])
    return values


# -- processes and waits ---------------------------------------------------------------------


@contextlib.contextmanager
def running(cluster: LocalCluster, timeout_s: float = 180.0) -> Iterator[LocalCluster]:
    """Start the cluster; stop it (router, then every worker process) however the block ends."""
    try:
        cluster.start(timeout_s)
        yield cluster
    finally:
        cluster.stop()  # SIGTERM; SIGKILL (which leaks a /dev/shm KV cache) only past 15 s


def redis_pid(url: str) -> int | None:
    """The pid the Redis at `url` reports, None while nothing answers there."""
    client = redis.Redis.from_url(url, socket_timeout=1.0)
    try:
        return int(client.info("server")["process_id"])
    except redis.ConnectionError:
        return None
    finally:
        client.close()


def wait_for(predicate: Callable[[], T], timeout_s: float, what: str, every_s: float = 0.05) -> T:
    """Poll until `predicate()` is truthy; return it, or fail the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)


def wait_printed(process: subprocess.Popen[bytes], log: Path, text: str, timeout_s: float) -> None:
    """Until `process` has written `text` into `log`; fails the test, showing the log, if it
    exits first or takes longer than `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text(errors="replace"):
        assert process.poll() is None, f"exited:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {text!r} in {timeout_s} s:\n{log.read_text()}"
        time.sleep(0.2)


def workers(cluster: LocalCluster, role: str | None = None) -> list[WorkerRecord]:
    """The registry's listing. A read the registry times out (1 s) is tried twice more: a
    machine loaded by other test processes can starve the embedded Redis that long."""
    assert cluster.registry is not None
    for _ in range(2):
        with contextlib.suppress(redis.TimeoutError):
            return cluster.registry.workers(role=role)
    return cluster.registry.workers(role=role)


def worker_process(cluster: LocalCluster, record: WorkerRecord) -> subprocess.Popen[bytes]:
    """The cluster's live worker process that serves `record` (found by its listening port)."""
    port = int(record.endpoint.rsplit(":", 1)[1])
    for w in cluster.workers:
        if w.process.poll() is not None:
            continue
        with contextlib.suppress(psutil.NoSuchProcess):
            for conn in psutil.Process(w.process.pid).net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port:
                    return w.process
    raise AssertionError(f"no worker process listens on {record.endpoint}")


def sigkill(cluster: LocalCluster, record: WorkerRecord) -> float:
    """SIGKILL the worker's process; returns time.monotonic() of the kill. Removes the /dev/shm
    KV cache a decode worker leaves behind when it cannot clean up."""
    process = worker_process(cluster, record)
    maps = psutil.Process(process.pid).memory_maps()
    caches = {m.path for m in maps if m.path.startswith("/dev/shm/tandem-kv-")}
    process.kill()
    killed = time.monotonic()
    process.wait(10.0)
    for path in caches:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return killed
