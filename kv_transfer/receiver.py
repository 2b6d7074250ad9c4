"""Decode side of KV transfer: reservations, the KVTransfer gRPC service (and the same Push
protocol on a host-local socket for same-host senders: `local_control`), and polling.

One reservation per request (states in `kv_transfer.state`):

    expect()             Bootstrapping -> WaitingForInput; the ticket goes to the router
    header, matches      -> Transferring; the receiver answers ACCEPTED
    keep-alives          the prefill has not started: the deadline moves back by the timeout
    all layers, trailer  -> Success; the receiver answers DONE
    anything else        -> Failed(cause): timeout, lost peer, bad metadata, cancel()

The decode worker calls `poll()` between engine steps. It returns each reservation once, when it
is final *and* nothing can write into its blocks any more (the stream's reader has stopped; on
the shared-memory plane, after a short grace for a sender still copying). Only then may the
worker start decoding from the blocks (Success) or free them (Failed).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Generator, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass, field, replace

import grpc
import torch

from kv_transfer.layout import slot_mapping
from kv_transfer.local_control import LocalControlServer, Reply
from kv_transfer.pairs import PairHost
from kv_transfer.sinks import GrpcSink, LayerSink, PairSink, ShmSink
from kv_transfer.state import (
    FailureCause,
    TransferError,
    TransferState,
    TransferStatus,
    push_status,
)
from kv_transfer.ticket import DecodeRank, KVLayout, KVTicket, host_id
from kv_transfer.wire import (
    SERVICE,
    parse_chunk,
    tensor_from_proto,
)
from tandem.config import GRPC_OPTIONS
from tandem.engine.tp.kv_view import KVLayer, head_window
from tandem.messages import logprobs_from_proto
from tandem.outputs import TokenLogprobs
from tandem.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

SHM_GRACE_S = 0.5  # a failed shared-memory transfer keeps its blocks this long (sender mid-copy)


@dataclass
class Arrival:
    """A finished reservation, as `poll()` reports it."""

    request_key: str
    state: TransferState  # SUCCESS or FAILED
    error: TransferError | None
    first_token: int | None = None
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    nbytes: int = 0
    data_plane: str = ""
    header_time: float | None = None  # monotonic time the sender's header arrived
    done_time: float = 0.0
    first_token_unix: float = 0.0  # the sender's wall clock when it sampled the first token
    # n > 1: the first tokens of the request's other choices, with their logprobs if asked for
    fork_first_tokens: list[tuple[int, TokenLogprobs | None]] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return self.done_time - self.header_time if self.header_time is not None else 0.0


class _Reservation:
    def __init__(
        self,
        ticket: KVTicket,
        slots: torch.Tensor,
        kv_caches: Sequence[KVLayer],
        heads: range,
        parent: _Reservation | None = None,
    ) -> None:
        self.ticket = ticket
        self.kv_caches = kv_caches  # where its stream writes
        self.heads = heads  # the model's KV heads its stream carries
        self.parent = parent  # the request's reservation, of which this is one stream's part
        self.parts: list[_Reservation] = []  # the streams of a per-rank transfer, by heads
        self.status = TransferStatus(time.monotonic() + ticket.timeout_s)
        self.status.advance(TransferState.WAITING_FOR_INPUT)
        self.slots = slots  # [num_tokens] cache slots of the reserved blocks
        self.lock = threading.Lock()  # held while writing into the blocks
        self.writable = True  # False once cancelled or failed: nothing more is written
        self.cancelled = False
        self.stream_open = False
        self.reader_done = threading.Event()
        self.replies: queue.Queue[Reply] = queue.Queue()
        self.release_at = 0.0
        self.arrival = Arrival(ticket.request_key, TransferState.FAILED, None)

    def fail(self, cause: FailureCause, message: str) -> None:
        self.fail_with(TransferError(cause, message))

    def fail_with(self, error: TransferError) -> None:
        if self.status.fail(error):
            self.stop_writes()

    def stop_writes(self) -> None:
        with self.lock:
            self.writable = False

    def renew(self, seconds: float) -> None:
        self.status.renew(seconds)
        if self.parent is not None:
            self.parent.status.renew(seconds)

    def quiet(self, now: float) -> bool:
        """Nothing writes into its blocks any more (as far as its own stream goes)."""
        stream_done = not self.stream_open or self.reader_done.is_set()
        return stream_done and now >= self.release_at


class KVReceiver:
    """Receives requests' prompt KV into this process's paged KV cache.

    `kv_caches` are the engine's per-layer tensors (those of a `SharedKVCache` when the engine
    computes in one, so same-host senders can write directly: then `shared_cache` is its
    locator, `SharedKVCache.locator`).

    One rank of a tensor-parallel decode worker that receives its own heads (a per-rank
    transfer) has `kv_caches` of its heads, `first_head` on, of the model's `num_kv_heads`: a
    reservation then takes one stream per prefill rank that sends it heads, each writing its
    heads (`TransferHeader.first_head`, `num_heads`), and is done once they cover the rank's."""

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        model_fingerprint: str,
        host: str = "127.0.0.1",
        port: int = 0,
        shared_cache: str = "",
        enable_pairs: bool = True,
        max_pairs: int = 64,
        max_streams: int = 128,
        local_control: bool = True,
        first_head: int = 0,
        num_kv_heads: int = 0,
    ) -> None:
        self.kv_caches = kv_caches
        own = KVLayout.of(kv_caches)
        self.heads = range(first_head, first_head + own.num_kv_heads)  # the model's it holds
        self.layout = replace(own, num_kv_heads=num_kv_heads or own.num_kv_heads)  # the model's
        self.model_fingerprint = model_fingerprint
        self.host = host
        self.shared_cache = shared_cache
        self.pairs = PairHost(host, max_pairs) if enable_pairs else None
        self._reservations: dict[str, _Reservation] = {}
        self._lock = threading.Lock()
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_streams + 8, thread_name_prefix="kv-recv"),
            options=GRPC_OPTIONS,
        )
        self._server.add_generic_rpc_handlers((_service(self),))
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        self._server.start()
        # Same-host senders (the shm plane) run the Push protocol over a Unix socket instead;
        # a connection is a transfer in flight or one a sender keeps idle (16 at most each).
        self._local: LocalControlServer | None = None
        if local_control and self.shared_cache:
            try:
                self._local = LocalControlServer(self.serve, max_connections=8 * max_streams)
            except OSError as e:  # no Unix sockets here: same-host senders use gRPC
                log.warning("no local control socket (%s); same-host senders use gRPC", e)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def target(self) -> DecodeRank:
        """This receiver as a ticket lists a decode rank (per-rank transfer)."""
        return DecodeRank(
            self.heads.start,
            len(self.heads),
            self.endpoint,
            self.pairs.address if self.pairs is not None else "",
            self._local.address if self._local is not None else "",
            self.shared_cache,
        )

    def expect(
        self,
        request_key: str,
        block_ids: list[int],
        num_tokens: int,
        timeout_s: float = 30.0,
        ranks: Sequence[DecodeRank] = (),
    ) -> KVTicket:
        """Reserve: KV for `num_tokens` tokens will arrive into `block_ids`; returns the ticket
        (listing `ranks`, the decode ranks of a per-rank transfer, when given)."""
        if num_tokens < 1:
            raise ValueError(f"a transfer moves at least one token, got num_tokens={num_tokens}")
        if num_tokens > len(block_ids) * self.layout.block_size:
            raise ValueError(f"{num_tokens} tokens do not fit in {len(block_ids)} blocks")
        ticket = KVTicket(
            request_key=request_key,
            endpoint=self.endpoint,
            block_ids=tuple(block_ids),
            layout=self.layout,
            model_fingerprint=self.model_fingerprint,
            num_tokens=num_tokens,
            host_id=host_id(),
            shared_cache=self.shared_cache,
            pair_store=self.pairs.address if self.pairs is not None else "",
            timeout_s=timeout_s,
            local_control=self._local.address if self._local is not None else "",
            ranks=tuple(ranks),
        )
        device = self.kv_caches[0].device
        slots = slot_mapping(block_ids, self.layout.block_size, num_tokens, device)
        with self._lock:
            if request_key in self._reservations:
                raise ValueError(f"a reservation for {request_key!r} already exists")
            self._reservations[request_key] = _Reservation(
                ticket, slots, self.kv_caches, self.heads
            )
        return ticket

    def cancel(self, request_key: str) -> None:
        """The request was aborted: stop writing into its blocks; poll() reports it (Failed,
        cancelled) once the sender has stopped. Unknown keys are ignored."""
        with self._lock:
            res = self._reservations.get(request_key)
        if res is None:
            return
        with res.lock:
            parts = list(res.parts)
        for r in (res, *parts):
            _stop(r, "the request was aborted before its KV arrived")

    def poll(self) -> list[Arrival]:
        """Reservations that became final and whose blocks are quiet, each reported once."""
        now = time.monotonic()
        done: list[Arrival] = []
        with self._lock:
            items = list(self._reservations.items())
        for key, res in items:
            if not res.stream_open and res.status.expired():
                why = "no sender arrived before the ticket's deadline"
                if res.parts:
                    why = "the streams of every head did not arrive before the deadline"
                res.fail(FailureCause.TIMEOUT, why)
            with res.lock:  # no part is added once it is final (_claim)
                parts = list(res.parts)
            if parts:
                self._settle(res, parts)
            quiet = all(r.quiet(now) for r in (res, *parts))
            if res.status.state.final and quiet:
                with self._lock:
                    del self._reservations[key]
                res.arrival.state = res.status.state
                res.arrival.error = res.status.error
                done.append(res.arrival)
        return done

    def _settle(self, res: _Reservation, parts: list[_Reservation]) -> None:
        """A reservation taken by several streams (by heads): failed as soon as one of them
        fails (the others are stopped: they write no more), done when they all are and cover
        this rank's heads."""
        failed = [p.status.error for p in parts if p.status.error is not None]
        if failed:
            real = [e for e in failed if e.cause != FailureCause.CANCELLED] or failed
            res.fail_with(real[0])
        elif all(p.status.state == TransferState.SUCCESS for p in parts) and sorted(
            h for p in parts for h in p.heads
        ) == list(self.heads):
            a = res.arrival
            trailer = next((p for p in parts if p.heads.start == 0), parts[0]).arrival
            for name in (
                "first_token",
                "logprobs",
                "prompt_logprobs",
                "extras",
                "first_token_unix",
                "fork_first_tokens",
                "data_plane",
            ):
                setattr(a, name, getattr(trailer, name))
            a.nbytes = sum(p.arrival.nbytes for p in parts)
            a.header_time = min(p.arrival.header_time or 0.0 for p in parts)
            a.done_time = max(p.arrival.done_time for p in parts)
            res.status.advance(TransferState.SUCCESS)
        if res.status.state == TransferState.FAILED:
            for part in parts:
                _stop(part, "another stream of the transfer failed")

    def __len__(self) -> int:
        return len(self._reservations)

    def close(self, grace_s: float = 1.0) -> None:
        if self._local is not None:
            self._local.close()
        self._server.stop(grace_s).wait()

    # -- the Push stream ---------------------------------------------------------------------

    def _claim(self, header: pb.TransferHeader) -> tuple[_Reservation, KVLayout]:
        """The reservation this header is for; raises _Reject if it is unknown or does not fit."""
        with self._lock:
            res = self._reservations.get(header.request_key)
        if res is None or res.status.state.final:
            raise _Reject(grpc.StatusCode.NOT_FOUND, f"no reservation for {header.request_key!r}")
        try:
            problem, layout = None, KVLayout.from_proto(header.layout)
        except ValueError as e:
            problem, layout = str(e), self.layout
        ticket = res.ticket
        problem = problem or self.layout.mismatch(layout)
        if header.model_fingerprint != ticket.model_fingerprint:
            problem = f"model fingerprint {header.model_fingerprint!r}, expected "
            problem += repr(ticket.model_fingerprint)
        elif header.num_tokens != ticket.num_tokens:
            problem = f"num_tokens {header.num_tokens}, reserved {ticket.num_tokens}"
        elif header.data_plane == pb.DATA_PLANE_SHM and not self.shared_cache:
            problem = "this worker has no shared-memory cache"
        elif header.data_plane == pb.DATA_PLANE_PAIR and (
            self.pairs is None or self.pairs.get(header.pair_id) is None
        ):
            problem = f"unknown pair {header.pair_id!r}"
        elif header.data_plane not in (pb.DATA_PLANE_GRPC, pb.DATA_PLANE_PAIR, pb.DATA_PLANE_SHM):
            problem = f"unknown data plane {header.data_plane}"
        heads = range(self.layout.num_kv_heads)
        if header.num_heads:  # one stream of a per-rank transfer: these heads
            heads = range(header.first_head, header.first_head + header.num_heads)
        problem = problem or self._heads_problem(res, heads)
        if problem is not None:
            res.fail(FailureCause.BAD_METADATA, problem)
            raise _Reject(grpc.StatusCode.INVALID_ARGUMENT, problem)
        with res.lock:
            if res.cancelled or res.stream_open or res.status.state.final:
                raise _Reject(grpc.StatusCode.ABORTED, "the request was cancelled or is taken")
            stream = res
            if header.num_heads:
                first = heads.start - self.heads.start
                caches = head_window(self.kv_caches, first, len(heads))
                stream = _Reservation(res.ticket, res.slots, caches, heads, res)
                stream.status.deadline = res.status.deadline
                res.parts.append(stream)
                layout = replace(layout, num_kv_heads=len(heads))
            stream.stream_open = True
            stream.arrival.data_plane = (
                pb.DataPlane.Name(header.data_plane).removeprefix("DATA_PLANE_").lower()
            )
            stream.arrival.header_time = time.monotonic()
        res.status.advance(TransferState.TRANSFERRING)
        if stream is not res:
            stream.status.advance(TransferState.TRANSFERRING)
        return stream, layout

    def _heads_problem(self, res: _Reservation, heads: range) -> str | None:
        """Why a stream of `heads` cannot write into this receiver's reservation `res`."""
        if heads.start < self.heads.start or heads.stop > self.heads.stop or not heads:
            return (
                f"KV heads {heads.start}..{heads.stop - 1}: this rank holds "
                f"{self.heads.start}..{self.heads.stop - 1}"
            )
        if len(heads) == self.layout.num_kv_heads:
            return None
        with res.lock:
            taken = {h for p in res.parts for h in p.heads}
        if taken & set(heads):
            return f"KV heads {heads.start}..{heads.stop - 1} are already being sent"
        return None

    def push(
        self, requests: Iterator[bytes], context: grpc.ServicerContext
    ) -> Iterator[pb.PushReply]:
        """The Push RPC: `serve` on a gRPC stream."""
        for item in self.serve(requests):
            if isinstance(item, tuple):
                context.abort(*item)  # raises
            else:
                yield item

    def serve(self, requests: Iterator[bytes]) -> Generator[Reply, None, None]:
        """One Push stream, on gRPC or the host-local socket: its requests are serialized
        KVChunks (`wire.parse_chunk`); yields the replies, ending with DONE or a status tuple."""
        message = next(requests, None)
        if message is None:
            return
        try:
            first, _ = parse_chunk(message)
        except ValueError as e:
            yield grpc.StatusCode.INVALID_ARGUMENT, str(e)
            return
        if first.WhichOneof("part") != "header":
            yield grpc.StatusCode.INVALID_ARGUMENT, "the first message must be a header"
            return
        header = first.header
        try:
            res, layout = self._claim(header)
        except _Reject as e:
            yield e.code, e.message
            return
        # ACCEPTED first: the sender gets on while the reader's thread starts (its messages
        # wait). A stream that ends before the reader is running (ACCEPTED could not be sent,
        # the call was cancelled) still gets its reader's ending: an empty one, so the
        # reservation fails and its blocks go back once quiet.
        reading = False
        try:
            yield pb.PushReply(kind=pb.PushReply.ACCEPTED, remaining_s=res.status.remaining())
            threading.Thread(
                target=self._read,
                args=(res, header, layout, requests),
                name=f"kv-read-{header.request_key}",
                daemon=True,
            ).start()
            reading = True
        finally:
            if not reading:
                self._read(res, header, layout, iter(()))
        while True:
            try:
                item = res.replies.get(timeout=max(res.status.remaining(), 0.0))
            except queue.Empty:
                if not res.status.expired():
                    continue  # a keep-alive renewed the deadline meanwhile
                res.fail(FailureCause.TIMEOUT, "the transfer passed its deadline")
                yield grpc.StatusCode.DEADLINE_EXCEEDED, "the transfer passed its deadline"
                return
            yield item
            if isinstance(item, tuple) or item.kind == pb.PushReply.DONE:
                return

    def _read(
        self,
        res: _Reservation,
        header: pb.TransferHeader,
        layout: KVLayout,
        requests: Iterator[bytes],
    ) -> None:
        """Consume the layers and the trailer; reply DONE, or an error status."""
        reply: Reply
        try:
            reply = self._consume(res, header, layout, requests)
        except TransferError as e:
            res.fail_with(e)
            reply = (push_status(e.cause), str(e))
            if e.cause == FailureCause.PEER_LOST:
                self._close_pair(header)
        except grpc.RpcError:
            res.fail(FailureCause.PEER_LOST, "the sender's stream broke")
            reply = (grpc.StatusCode.CANCELLED, "the sender's stream broke")
            self._close_pair(
                header
            )  # posted sends may never be matched: the sender makes a new one
        except Exception as e:  # a dead or stalled pair peer, a malformed tensor: fail, not crash
            log.warning("KV transfer %s failed: %s", header.request_key, e)
            self._close_pair(header)
            res.fail(FailureCause.PEER_LOST, f"{type(e).__name__}: {e}")
            reply = (grpc.StatusCode.DATA_LOSS, str(e))
        finally:
            res.stop_writes()
            if header.data_plane == pb.DATA_PLANE_SHM and res.status.state != TransferState.SUCCESS:
                res.release_at = time.monotonic() + SHM_GRACE_S
            res.arrival.done_time = time.monotonic()
            res.reader_done.set()
        res.replies.put(reply)

    def _close_pair(self, header: pb.TransferHeader) -> None:
        """Forget a pair that may hold unmatched sends; transfers still on it keep their handle."""
        if header.data_plane == pb.DATA_PLANE_PAIR and self.pairs is not None:
            self.pairs.close(header.pair_id)

    def _consume(
        self,
        res: _Reservation,
        header: pb.TransferHeader,
        layout: KVLayout,
        requests: Iterator[bytes],
    ) -> pb.PushReply:
        sink = self._sink(res, header, layout)
        for message in requests:
            try:
                chunk, data = parse_chunk(message)
            except ValueError as e:
                raise TransferError(FailureCause.BAD_METADATA, str(e)) from e
            part = chunk.WhichOneof("part")
            if part == "keepalive":  # the prefill worker still holds the request, unstarted
                res.renew(res.ticket.timeout_s)
                continue
            if part == "layer":
                sink.add(chunk.layer, data, res.status.deadline)
                res.arrival.nbytes = sink.layers_done * layout.layer_nbytes(header.num_tokens)
                continue
            if part != "trailer":
                raise TransferError(FailureCause.BAD_METADATA, f"unexpected {part} message")
            sink.drain(res.status.deadline)
            res.arrival.nbytes = sink.layers_done * layout.layer_nbytes(header.num_tokens)
            if sink.layers_done != self.layout.num_layers:
                raise TransferError(
                    FailureCause.PEER_LOST,
                    f"trailer after {sink.layers_done}/{self.layout.num_layers} layers",
                )
            if res.cancelled:
                raise TransferError(FailureCause.CANCELLED, "the request was aborted")
            a = res.arrival
            first = chunk.trailer.first_token
            a.first_token, a.logprobs = _sampled(first)
            a.prompt_logprobs = [logprobs_from_proto(lp) for lp in first.prompt_logprobs]
            a.fork_first_tokens = [_sampled(f) for f in chunk.trailer.fork_first_tokens]
            a.extras = {t.name: tensor_from_proto(t) for t in chunk.trailer.extras}
            a.first_token_unix = chunk.trailer.first_token_unix
            res.status.advance(TransferState.SUCCESS)
            return pb.PushReply(kind=pb.PushReply.DONE, bytes_received=a.nbytes)
        if res.cancelled:  # the sender stopped after the layers it announced: let them land
            sink.drain(res.status.deadline)
            raise TransferError(FailureCause.CANCELLED, "the request was aborted")
        raise TransferError(FailureCause.PEER_LOST, f"stream ended after {sink.layers_done} layers")

    def _sink(self, res: _Reservation, header: pb.TransferHeader, layout: KVLayout) -> LayerSink:
        args = (res.kv_caches, res, layout, header.num_tokens)
        if header.data_plane == pb.DATA_PLANE_GRPC:
            return GrpcSink(*args)
        if header.data_plane == pb.DATA_PLANE_SHM:
            return ShmSink(*args)
        pair = self.pairs.get(header.pair_id) if self.pairs is not None else None
        if pair is None:
            raise TransferError(FailureCause.PEER_LOST, "the pair was closed")
        return PairSink(*args, pair, header.tag_base)


def _stop(res: _Reservation, why: str) -> None:
    """Stop the reservation's stream (CANCELLED to its sender, which stops; the reader then
    fails it), or fail it at once when no stream is open. Once."""
    with res.lock:
        if res.cancelled:
            return
        res.cancelled = True
        open_stream = res.stream_open
        if res.arrival.data_plane != "shm":
            res.writable = False
    if open_stream:
        res.replies.put(pb.PushReply(kind=pb.PushReply.CANCELLED))
    else:
        res.fail(FailureCause.CANCELLED, why)


class _Reject(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def _open_pair(
    receiver: KVReceiver, request: pb.OpenPairRequest, context: grpc.ServicerContext
) -> pb.OpenPairReply:
    pairs = receiver.pairs
    if pairs is None:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker has no pair store")
        return pb.OpenPairReply()
    try:
        pairs.open(request.pair_id, request.backend, request.timeout_s or 10.0)
    except Exception as e:
        context.abort(grpc.StatusCode.UNAVAILABLE, f"could not join pair: {e}")
    return pb.OpenPairReply()


def _close_pair(
    receiver: KVReceiver, request: pb.ClosePairRequest, context: grpc.ServicerContext
) -> pb.ClosePairReply:
    if receiver.pairs is not None:
        receiver.pairs.close(request.pair_id)
    return pb.ClosePairReply()


def _service(receiver: KVReceiver) -> grpc.GenericRpcHandler:
    """The KVTransfer service; Push takes its requests as bytes (the stub's would parse them)."""
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Push": grpc.stream_stream_rpc_method_handler(
                receiver.push, response_serializer=pb.PushReply.SerializeToString
            ),
            "OpenPair": grpc.unary_unary_rpc_method_handler(
                functools.partial(_open_pair, receiver),
                request_deserializer=pb.OpenPairRequest.FromString,
                response_serializer=pb.OpenPairReply.SerializeToString,
            ),
            "ClosePair": grpc.unary_unary_rpc_method_handler(
                functools.partial(_close_pair, receiver),
                request_deserializer=pb.ClosePairRequest.FromString,
                response_serializer=pb.ClosePairReply.SerializeToString,
            ),
        },
    )


def _sampled(first: pb.FirstToken) -> tuple[int, TokenLogprobs | None]:
    """A first token of the trailer: its id and its logprobs (None when none were asked for)."""
    return first.token_id, logprobs_from_proto(first.logprobs) if first.HasField(
        "logprobs"
    ) else None
