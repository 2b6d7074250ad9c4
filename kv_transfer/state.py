"""The transfer state machine and its typed failures, shared by both ends.

    Bootstrapping -> WaitingForInput -> Transferring -> Success
          \\________________\\_______________\\______-> Failed(cause)

Receiver (decode side): Bootstrapping while it reserves blocks and issues the ticket;
WaitingForInput until the sender's header arrives; Transferring while layers land; Success when
the trailer (first token) arrives with every layer. Sender (prefill side): Bootstrapping while it
picks a data plane and connects; WaitingForInput until the receiver accepts the header and the
prefill has computed the first layer; Transferring while it sends; Success when the receiver
acknowledges. Any state may fail; Success and Failed are final.

The deadline is the ticket's timeout from the reservation, renewed on both sides by each
keep-alive the prefill worker's engine loop sends while the request waits there unstarted: a long
prefill queue does not fail the transfer, a stalled or dead prefill worker still does.
"""

from __future__ import annotations

import enum
import threading
import time

import grpc


class TransferState(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"
    WAITING_FOR_INPUT = "waiting_for_input"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"

    @property
    def final(self) -> bool:
        return self in (TransferState.SUCCESS, TransferState.FAILED)


class FailureCause(enum.Enum):
    TIMEOUT = "timeout"  # a wait passed its deadline (stalled peer, no sender ever came)
    PEER_LOST = "peer_lost"  # the other side died or closed the connection
    BAD_METADATA = "bad_metadata"  # layout, fingerprint or token count do not match the ticket
    CANCELLED = "cancelled"  # the request was aborted on either side
    NOT_FOUND = "not_found"  # the receiver has no reservation for the key
    SETUP = "setup"  # no data plane could be set up


# The one table from failure causes to gRPC status codes, for the two calls a failure ends:
# - the KV stream (Push): the receiver replies the cause's code and the sender reads the cause
#   back from it, so this column is one-to-one;
# - the worker call that carries the request (Prefill, Decode): the router retries UNAVAILABLE
#   on another prefill worker, so every cause another worker may not have is UNAVAILABLE.
STATUS_CODES = {  # cause: (Push reply, worker call)
    FailureCause.TIMEOUT: (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.DEADLINE_EXCEEDED),
    FailureCause.PEER_LOST: (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.UNAVAILABLE),
    FailureCause.BAD_METADATA: (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
    ),
    FailureCause.CANCELLED: (grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED),
    FailureCause.NOT_FOUND: (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.NOT_FOUND),
    FailureCause.SETUP: (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE),
}
_CAUSE_OF_PUSH_STATUS = {push: cause for cause, (push, _) in STATUS_CODES.items()}


def push_status(cause: FailureCause) -> grpc.StatusCode:
    """The status a receiver ends a failed KV stream with."""
    return STATUS_CODES[cause][0]


def cause_of_push_status(code: grpc.StatusCode) -> FailureCause:
    """The cause behind a KV stream's error status (a broken stream: the peer is lost)."""
    return _CAUSE_OF_PUSH_STATUS.get(code, FailureCause.PEER_LOST)


def request_status(cause: FailureCause) -> grpc.StatusCode:
    """The status a worker ends the request's call with when its transfer failed."""
    return STATUS_CODES[cause][1]


class TransferError(Exception):
    """A failed transfer. `retryable`: another prefill worker (or local prefill) may succeed."""

    def __init__(self, cause: FailureCause, message: str) -> None:
        super().__init__(f"KV transfer failed ({cause.value}): {message}")
        self.cause = cause
        self.message = message

    def __reduce__(self) -> tuple[type[TransferError], tuple[FailureCause, str]]:
        return TransferError, (self.cause, self.message)

    @property
    def retryable(self) -> bool:
        return self.cause not in (FailureCause.CANCELLED, FailureCause.BAD_METADATA)


_NEXT = {
    TransferState.BOOTSTRAPPING: {TransferState.WAITING_FOR_INPUT, TransferState.TRANSFERRING},
    TransferState.WAITING_FOR_INPUT: {TransferState.TRANSFERRING},
    TransferState.TRANSFERRING: {TransferState.SUCCESS},
}


class TransferStatus:
    """One transfer's state, thread-safe; moves only forward, and fails at most once."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline  # time.monotonic() by which it must be final
        self.state = TransferState.BOOTSTRAPPING
        self.error: TransferError | None = None
        self._lock = threading.Lock()
        self._final = threading.Event()

    def advance(self, state: TransferState) -> bool:
        """Move to `state`; False (and no change) when already final."""
        with self._lock:
            if self.state.final:
                return False
            if state not in _NEXT[self.state] and state != self.state:
                raise RuntimeError(f"transfer cannot go from {self.state.value} to {state.value}")
            self.state = state
            if state.final:
                self._final.set()
            return True

    def fail(self, error: TransferError) -> bool:
        """Fail with `error`; False when already final (the first outcome stands)."""
        with self._lock:
            if self.state.final:
                return False
            self.state, self.error = TransferState.FAILED, error
            self._final.set()
            return True

    def renew(self, seconds: float) -> None:
        """Push the deadline back to `seconds` from now (never earlier); no-op once final."""
        with self._lock:
            if not self.state.final:
                self.deadline = max(self.deadline, time.monotonic() + seconds)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def expired(self) -> bool:
        return self.remaining() <= 0

    def wait(self, timeout: float | None = None) -> TransferState:
        """Block until final or `timeout` seconds (default: until the deadline)."""
        self._final.wait(max(0.0, self.remaining() if timeout is None else timeout))
        return self.state
