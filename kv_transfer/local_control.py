"""Host-local control stream: the Push protocol over a Unix socket, for same-host transfers.

On the shared-memory plane the sender writes the KV into the receiver's memory itself, so all
that crosses between the two processes is control: the header, ACCEPTED, a marker, the trailer
and DONE. On a gRPC call these cost milliseconds (the call's creation, HTTP/2 and its thread
hand-offs), a third of a 512-token transfer; on a Unix socket kept open between transfers a
round trip costs tens of microseconds. The messages and their order are the Push stream's
(`KVReceiver.serve`), in frames

    kind (1 byte) | payload length (4 bytes, little-endian) | payload

sender -> receiver: MESSAGE (a serialized KVChunk), END (the sender's messages are over, as a
gRPC half-close); receiver -> sender: READY (once, on a new connection; a receiver at its bound
sends STATUS instead and closes, and the sender goes to gRPC), REPLY (a serialized PushReply),
STATUS (the transfer ends with a gRPC status: its code's name, a newline, the details).
A connection carries one transfer at a time and is kept for the next only after one that ended
in DONE; any other end closes it, so no frame of a failed transfer can reach the next one. A
dead peer closes the socket, which the other side sees at once, as a broken gRPC stream.
Sockets live in Linux's abstract namespace: nothing on disk to clean up, reachable only from the
same network namespace (a sender that cannot connect uses the receiver's gRPC service).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from typing import Protocol

import grpc

from tandem.config import GRPC_MAX_MESSAGE_BYTES
from tandem.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

MESSAGE, END, REPLY, STATUS, READY = 1, 2, 3, 4, 5
_FRAME = struct.Struct("<BI")
_SMALL = 1 << 16  # payloads up to this size go out in one send with their frame header
MAX_FRAME_BYTES = GRPC_MAX_MESSAGE_BYTES  # as the gRPC stream's message bound
_PEER_CRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid

Reply = pb.PushReply | tuple[grpc.StatusCode, str]  # a reply, or the status to end with


class ControlCall(Protocol):
    """What a sender holds of a Push call: its replies, and a way to stop it."""

    def __iter__(self) -> Iterator[pb.PushReply]: ...

    def cancel(self) -> bool: ...


class LocalCallError(grpc.RpcError):
    """A local call's end other than DONE, shaped as the RpcError a gRPC call raises."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def send_frame(sock: socket.socket, kind: int, payload: bytes = b"") -> None:
    head = _FRAME.pack(kind, len(payload))
    if len(payload) <= _SMALL:
        sock.sendall(head + payload)
    else:
        sock.sendall(head)
        sock.sendall(payload)


def recv_frame(sock: socket.socket) -> tuple[int, bytes]:
    """The next frame; EOFError when the peer closed the socket."""
    kind, size = _FRAME.unpack(_recv_exactly(sock, _FRAME.size))
    if size > MAX_FRAME_BYTES:
        raise ConnectionError(f"a frame of {size} bytes, over {MAX_FRAME_BYTES}")
    return kind, _recv_exactly(sock, size)


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = sock.recv(size) if size else b""
    if len(data) == size:
        return data
    if not data:
        raise EOFError("the peer closed the connection")
    buf = bytearray(size)
    buf[: len(data)] = data
    view, got = memoryview(buf), len(data)
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError(f"the peer closed the connection after {got} of {size} bytes")
        got += n
    return bytes(buf)


def _shutdown(sock: socket.socket) -> None:
    """Both ways: a thread blocked in recv on the socket wakes up (close alone does not)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _close(sock: socket.socket) -> None:
    _shutdown(sock)
    sock.close()


# -- receiver side -------------------------------------------------------------------------------


class _Requests:
    """One transfer's messages as they arrive on a connection (what a gRPC handler iterates)."""

    def __init__(self, conn: socket.socket, first: bytes) -> None:
        self.conn = conn
        self.first: bytes | None = first
        self.ended = False  # END was read: the connection is at the next transfer's start

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        if self.first is not None:
            first, self.first = self.first, None
            return first
        if self.ended:
            raise StopIteration
        try:
            kind, payload = recv_frame(self.conn)
        except (OSError, EOFError) as e:
            raise LocalCallError(grpc.StatusCode.CANCELLED, f"the sender's connection: {e}") from e
        if kind == END:
            self.ended = True
            raise StopIteration
        if kind != MESSAGE:
            raise LocalCallError(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected frame {kind}")
        return payload

    def drain(self, timeout_s: float) -> bool:
        """Read on to END (the sender's messages after DONE); False when they do not end."""
        self.conn.settimeout(timeout_s)
        try:
            for _ in self:
                pass
        except (grpc.RpcError, OSError):
            return False
        finally:
            self.conn.settimeout(None)
        return self.ended


class LocalControlServer:
    """A receiver's Unix socket: each connection's transfers go through `serve` (the Push
    handler: requests in, replies out, a status tuple to end otherwise), one at a time."""

    def __init__(
        self,
        serve: Callable[[Iterator[bytes]], Generator[Reply, None, None]],
        max_connections: int = 1024,
    ) -> None:
        self.serve = serve
        self.max_connections = max_connections
        self.address = f"tandem-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + self.address)
        self._sock.listen(64)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="kv-local-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError as e:  # closed, or out of file descriptors for a moment
                if not self._closed:
                    log.warning("local control: accept failed: %s", e)
                    time.sleep(0.05)
                continue
            refusal = self._refusal(conn)
            if refusal is None:
                try:
                    threading.Thread(
                        target=self._connection, args=(conn,), name="kv-local-conn", daemon=True
                    ).start()
                    continue
                except RuntimeError as e:  # no thread to be had
                    with self._lock:
                        self._conns.discard(conn)
                    refusal = f"RESOURCE_EXHAUSTED\n{e}"
            log.warning("local control: refusing a connection: %s", refusal.replace("\n", ": "))
            with contextlib.suppress(OSError):
                send_frame(conn, STATUS, refusal.encode())
            _close(conn)

    def _refusal(self, conn: socket.socket) -> str | None:
        """Why this connection is refused (a STATUS payload), or None: it is counted in."""
        _, uid, _ = _PEER_CRED.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEER_CRED.size)
        )
        if uid != os.getuid():  # the shared cache is this user's alone, too
            return f"PERMISSION_DENIED\npeer uid {uid}, this worker's {os.getuid()}"
        with self._lock:
            if self._closed or len(self._conns) >= self.max_connections:
                return f"RESOURCE_EXHAUSTED\n{self.max_connections} connections"
            self._conns.add(conn)
        return None

    def _connection(self, conn: socket.socket) -> None:
        try:
            send_frame(conn, READY)
            while self._transfer(conn):
                pass
        except OSError:
            pass  # the sender left before READY
        finally:
            with self._lock:
                self._conns.discard(conn)
            _close(conn)

    def _transfer(self, conn: socket.socket) -> bool:
        """Serve one transfer; True when it ended in DONE and the connection carries on."""
        try:
            kind, first = recv_frame(conn)  # idle until the sender's next transfer
        except (OSError, EOFError):
            return False
        if kind != MESSAGE:
            return False
        requests = _Requests(conn, first)
        done = False
        replies = self.serve(requests)
        try:
            for item in replies:
                if isinstance(item, tuple):
                    code, details = item
                    send_frame(conn, STATUS, f"{code.name}\n{details}".encode())
                    return False
                send_frame(conn, REPLY, item.SerializeToString())
                done = item.kind == pb.PushReply.DONE
        except OSError:
            return False  # the sender is gone; closing the socket stops the transfer's reader
        finally:
            replies.close()  # a transfer left mid-way fails its reservation (KVReceiver.serve)
        return done and requests.drain(timeout_s=5.0)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        _close(self._sock)
        for conn in conns:
            _close(conn)


# -- sender side ---------------------------------------------------------------------------------


class LocalConnection:
    """A sender's connection to one receiver, with the thread that writes its transfers'
    messages (a gRPC call iterates its requests on a thread of its own, too)."""

    def __init__(self, address: str, timeout_s: float) -> None:
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.settimeout(timeout_s)
            self.sock.connect("\0" + address)
            kind, payload = recv_frame(self.sock)
            if kind != READY:
                raise ConnectionRefusedError(payload.decode(errors="replace").replace("\n", ": "))
        except (OSError, EOFError) as e:
            self.sock.close()
            raise ConnectionError(f"local control socket {address}: {e}") from e
        self.idle_since = time.monotonic()
        self._work: queue.SimpleQueue[Iterator[bytes] | None] = queue.SimpleQueue()
        self.written = threading.Event()  # the current transfer's messages are all out (END)
        threading.Thread(target=self._write, name="kv-local-write", daemon=True).start()

    def start(self, requests: Iterator[bytes]) -> None:
        self.written.clear()
        self._work.put(requests)

    def _write(self) -> None:
        while (requests := self._work.get()) is not None:
            try:
                for message in requests:
                    send_frame(self.sock, MESSAGE, message)
                send_frame(self.sock, END)
                self.written.set()
            except OSError:
                pass  # the reading side sees the broken connection (or the receiver's status)
            except Exception:  # the messages failed: end the call, as gRPC cancels one
                log.exception("local control: a transfer's messages failed")
                _shutdown(self.sock)

    def stale(self) -> bool:
        """An idle connection is never readable: readable means closed by the receiver."""
        poller = select.poll()  # not select(): it refuses descriptors past 1023
        poller.register(self.sock, select.POLLIN)
        return bool(poller.poll(0))

    def close(self) -> None:
        self._work.put(None)
        _close(self.sock)


class LocalCall:
    """A Push call on a LocalConnection: iterating gives the replies and raises LocalCallError
    where a gRPC call raises its RpcError. The call gives its connection back to the pool before
    it hands out DONE, and after that neither reads from it nor cancels it: another transfer
    may have it by then."""

    def __init__(
        self,
        pool: LocalControlPool,
        conn: LocalConnection,
        requests: Iterator[bytes],
        timeout: float,
    ) -> None:
        self._pool = pool
        self._conn = conn
        self._owned = True  # False once given back
        self._lock = threading.Lock()
        self._cancelled = False
        self._deadline = time.monotonic() + timeout  # the call's, as a gRPC call has one
        conn.sock.settimeout(max(timeout, 1e-3))
        conn.start(requests)

    def __iter__(self) -> Iterator[pb.PushReply]:
        try:
            while True:
                kind, payload = self._recv()
                if kind == STATUS:
                    name, _, details = payload.decode().partition("\n")
                    code = grpc.StatusCode[name] if name in grpc.StatusCode.__members__ else None
                    raise LocalCallError(code or grpc.StatusCode.UNKNOWN, details)
                if kind != REPLY:
                    raise LocalCallError(grpc.StatusCode.INTERNAL, f"unexpected frame {kind}")
                reply = pb.PushReply.FromString(payload)
                if reply.kind == pb.PushReply.DONE:
                    self._give_back(self._conn.written.wait(1.0))  # END is out: reusable
                    yield reply
                    return
                yield reply
        finally:
            self._give_back(False)

    def _give_back(self, reusable: bool) -> None:
        with self._lock:
            if not self._owned:
                return
            self._owned = False
            reusable = reusable and not self._cancelled
        self._pool.release(self._conn, reusable)

    def _recv(self) -> tuple[int, bytes]:
        try:
            self._conn.sock.settimeout(max(self._deadline - time.monotonic(), 1e-3))
            return recv_frame(self._conn.sock)
        except TimeoutError as e:
            raise LocalCallError(grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline") from e
        except (OSError, EOFError) as e:
            if self._cancelled:
                raise LocalCallError(grpc.StatusCode.CANCELLED, "cancelled by the sender") from e
            raise LocalCallError(grpc.StatusCode.UNAVAILABLE, f"the receiver's socket: {e}") from e

    def cancel(self) -> bool:
        with self._lock:
            if not self._owned:
                return False  # the call ended; its connection may be another transfer's now
            self._cancelled = True
            _shutdown(self._conn.sock)  # wakes the reader; the connection is not reused
        return True


class LocalControlPool:
    """A sender's idle connections by receiver address, reused across transfers (idle ones
    closed after `idle_s`, or once their receiver closed them, looked at on each call), and the
    addresses that could not be reached lately (not tried again for `retry_s`)."""

    def __init__(
        self,
        max_idle: int = 16,
        idle_s: float = 60.0,
        connect_timeout_s: float = 2.0,
        retry_s: float = 60.0,
    ) -> None:
        self.max_idle = max_idle
        self.idle_s = idle_s
        self.connect_timeout_s = connect_timeout_s
        self.retry_s = retry_s
        self._idle: dict[str, list[LocalConnection]] = {}
        self._unreachable: dict[str, float] = {}  # address -> when it failed
        self._lock = threading.Lock()
        self._closed = False

    def reachable(self, address: str) -> bool:
        """False while a failure to connect to `address` is recent (older ones are forgotten
        here: a receiver that is gone for good leaves no entry behind)."""
        now = time.monotonic()
        with self._lock:
            for old in [a for a, t in self._unreachable.items() if now - t >= self.retry_s]:
                del self._unreachable[old]
            return address not in self._unreachable

    def call(self, address: str, requests: Iterator[bytes], timeout: float) -> LocalCall:
        """A Push call to the receiver at `address`; OSError when it cannot be reached."""
        conn = self._take(address)
        if conn is None:
            try:
                conn = LocalConnection(address, min(self.connect_timeout_s, max(timeout, 1e-3)))
            except OSError:
                with self._lock:
                    self._unreachable[address] = time.monotonic()
                raise
        return LocalCall(self, conn, requests, timeout)

    def _take(self, address: str) -> LocalConnection | None:
        """An idle connection to `address`, after dropping every expired or closed one."""
        now = time.monotonic()
        drop: list[LocalConnection] = []
        with self._lock:
            for key, idle in list(self._idle.items()):
                keep = [c for c in idle if now - c.idle_since <= self.idle_s and not c.stale()]
                drop += [c for c in idle if c not in keep]
                if keep:
                    self._idle[key] = keep
                else:
                    del self._idle[key]
            mine = self._idle.get(address)
            found = mine.pop() if mine else None
        for conn in drop:
            conn.close()
        return found

    def release(self, conn: LocalConnection, reusable: bool) -> None:
        if reusable:
            conn.idle_since = time.monotonic()
            with self._lock:
                idle = self._idle.setdefault(conn.address, [])
                if not self._closed and len(idle) < self.max_idle:
                    idle.append(conn)
                    return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for conn in conns:
            conn.close()
