"""Prefill side of KV transfer: one `KVSender` per process, one `OutboundTransfer` per request.

A transfer's life (states in `kv_transfer.state`):

    begin(ticket)          Bootstrapping: pick a data plane (the receiver's shared cache on the
                           same host, else a torch.distributed pair, else the gRPC stream) and
                           open the Push stream (on the receiver's host-local socket for the
                           shared cache, else, or when that socket fails, on gRPC)
    header sent            WaitingForInput until the receiver accepts and layers are ready
    set_source(blocks)     the sender's blocks holding the prompt (known once it is scheduled)
    layer_ready(l)         Transferring: layer l goes out while the prefill computes layer l+1
    finish(first_token)    the trailer; Success when the receiver answers DONE
    abort() / any error    Failed(cause); the receiver frees its blocks too

The prefill worker calls `poll()` and releases a transfer's source blocks once it is reported:
by then nothing reads them any more.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import replace

import grpc
import torch

from kv_transfer.layout import slot_mapping
from kv_transfer.local_control import ControlCall, LocalCall, LocalControlPool
from kv_transfer.pairs import PairPool, backend_for
from kv_transfer.planes import DataPlane, GrpcPlane, PairPlane, ShmPlane
from kv_transfer.shm import SharedCacheAttachments
from kv_transfer.state import (
    FailureCause,
    TransferError,
    TransferState,
    TransferStatus,
    cause_of_push_status,
)
from kv_transfer.ticket import KVLayout, KVTicket, host_id
from kv_transfer.wire import PUSH_METHOD, tensor_to_proto
from tandem.config import GRPC_OPTIONS
from tandem.engine.tp.kv_view import KVLayer, head_window
from tandem.messages import logprobs_to_proto
from tandem.outputs import TokenLogprobs
from tandem.v1 import kv_transfer_pb2 as pb
from tandem.v1 import kv_transfer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

CHANNELS = ("auto", "grpc", "pair", "shm")
WRITE_MARGIN_S = 0.25  # stop writing into a receiver's memory this long before its deadline
RECEIVER_LAG_S = 1.0  # a stalled transfer waits this long for its receiver to time out too

SampledToken = tuple[int, TokenLogprobs | None]  # a token id and its logprobs, if asked for
# the first token, its logprobs, the prompt's logprobs, the proposer's tensors, the other choices'
# first tokens
_Trailer = tuple[
    int, TokenLogprobs | None, list[TokenLogprobs], dict[str, torch.Tensor], Sequence[SampledToken]
]
_KEEPALIVE = "keepalive"  # queued by renew(): the next message is a KeepAlive
_Item = int | _Trailer | str | None  # a layer, the trailer, _KEEPALIVE, or the end


class OutboundTransfer:
    """One request's KV on its way to the ticket's receiver."""

    def __init__(
        self,
        sender: KVSender,
        ticket: KVTicket,
        kv_caches: Sequence[KVLayer],
        call_timeout_s: float | None = None,
        heads: range | None = None,
        num_kv_heads: int = 0,
    ) -> None:
        self.sender = sender
        self.ticket = ticket
        self.kv_caches = kv_caches
        self.layout = KVLayout.of(kv_caches)  # of the heads it sends
        # A stream of a per-rank transfer: which of the model's `num_kv_heads` it carries.
        self.heads = heads
        self.model_layout = replace(
            self.layout, num_kv_heads=num_kv_heads or self.layout.num_kv_heads
        )
        self.started = time.monotonic()
        self.status = TransferStatus(self.started + ticket.timeout_s)
        # The stream's own deadline: the request's, when renewals may outlast the ticket's.
        self.call_timeout_s = ticket.timeout_s if call_timeout_s is None else call_timeout_s
        self._renewed = self.started
        self.slots: torch.Tensor | None = None  # [num_tokens] source cache slots
        self.plane_name = ""
        self.control = ""  # where the Push protocol ran: "local" (Unix socket) or "grpc"
        self.nbytes = 0
        self.first_token: int = -1
        self.first_token_unix = 0.0
        self.done_time = 0.0
        self._items: queue.Queue[_Item] = queue.Queue()
        self._held: list[_Item] = []  # taken from _items, not yet handled
        self._accepted = threading.Event()
        self._cancelled = threading.Event()
        self._blocks_lock = threading.Lock()  # held while reading the source blocks
        self._blocks_released = False
        self._call: ControlCall | None = None
        self._write_deadline = 0.0  # set from the receiver's ACCEPTED
        self._cancelled_by_receiver = False
        self._local_error: TransferError | None = None  # why this side ended the stream
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"kv-send-{ticket.request_key}", daemon=True
        )
        self._thread.start()

    # -- called by the prefill worker ---------------------------------------------------------

    def set_source(self, block_ids: list[int]) -> None:
        """The blocks (of `kv_caches`) that hold the prompt, in order."""
        device = self.kv_caches[0].device
        self.slots = slot_mapping(block_ids, self.layout.block_size, self.ticket.num_tokens, device)

    def layer_ready(self, layer: int) -> None:
        """Layer `layer` of the whole prompt is in the source blocks."""
        if self.slots is None:
            raise RuntimeError("set_source() must come before the first layer")
        self._items.put(layer)

    def all_layers_ready(self) -> None:
        for layer in range(self.layout.num_layers):
            self.layer_ready(layer)

    def finish(
        self,
        first_token: int,
        logprobs: TokenLogprobs | None = None,
        extras: dict[str, torch.Tensor] | None = None,
        forks: Sequence[SampledToken] = (),
        prompt_logprobs: Sequence[TokenLogprobs] = (),
    ) -> None:
        """The first token (with its logprobs, the prompt's if asked for, anything the
        receiver's proposer needs, and the first tokens of the request's other choices) ends
        the transfer."""
        self.first_token = first_token
        self.first_token_unix = time.time()
        self._items.put((first_token, logprobs, list(prompt_logprobs), extras or {}, forks))

    def renew(self) -> None:
        """The request is still here and not started (queued, or its earlier chunks computing):
        push the deadline back by the ticket's timeout on both sides, with a KeepAlive. Called
        by the engine loop, so a stalled loop renews nothing; sent at most every timeout / 4."""
        now = time.monotonic()
        if now - self._renewed < self.ticket.timeout_s / 4:
            return
        self._renewed = now
        self._items.put(_KEEPALIVE)

    def abort(self) -> None:
        """Stop: the request was aborted here. The receiver learns it from the broken stream,
        on the shm plane once the run of layers being copied into its memory has landed (a
        wait of milliseconds, on the caller's thread): the receiver frees the blocks soon after
        the stream breaks, and a copy still running then (its thread descheduled on a busy
        host) would land in blocks another request holds."""
        self._cancelled.set()
        self.status.fail(TransferError(FailureCause.CANCELLED, "aborted by the prefill side"))
        self._items.put(None)
        if self.plane_name == "shm":
            with self._blocks_lock:  # held while a run of layers is copied; none starts after
                pass
        if self._call is not None:
            self._call.cancel()

    def wait(self, timeout: float | None = None) -> TransferState:
        """Block until the transfer's thread is done (default: until the deadline + 1 s)."""
        self._done.wait(self.status.remaining() + 1.0 if timeout is None else timeout)
        return self.status.state

    @property
    def finished(self) -> bool:
        """Final, and the source blocks are no longer read: the worker may release them."""
        if not self._done.is_set():
            return False
        with self._blocks_lock:
            self._blocks_released = True
        return True

    # -- the stream ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            plane = self.sender.choose_plane(self.ticket, self.kv_caches[0].device, self.heads)
            self.plane_name = pb.DataPlane.Name(plane.kind).removeprefix("DATA_PLANE_").lower()
            self.status.advance(TransferState.WAITING_FOR_INPUT)
            opened = time.monotonic()  # before the receiver can have answered anything
            self._call = self.sender.open_call(
                self.ticket, plane, self._requests(plane), self.call_timeout_s
            )
            self.control = "local" if isinstance(self._call, LocalCall) else "grpc"
            if self._cancelled.is_set():
                self._call.cancel()
            for reply in self._call:
                if reply.kind == pb.PushReply.ACCEPTED:
                    # Its deadline is `remaining_s` from when it answered, later than `opened`
                    # (the same host's clock, or the fence does not matter: no shared memory):
                    # counted from `opened`, a reply read late does not move the fence past it.
                    margin = min(WRITE_MARGIN_S, reply.remaining_s / 2)
                    self._write_deadline = opened + reply.remaining_s - margin
                    self._accepted.set()
                elif reply.kind == pb.PushReply.CANCELLED:
                    self._cancelled_by_receiver = True
                    self._cancelled.set()
                    self._items.put(None)
                elif reply.kind == pb.PushReply.DONE:  # the stream's end is only its status
                    self.status.advance(TransferState.SUCCESS)
                    self._end()
            if self.status.state != TransferState.SUCCESS:
                self._fail(FailureCause.PEER_LOST, "the receiver ended the stream early")
        except grpc.RpcError as e:
            if self._local_error is not None:  # our side ended the stream, for this reason
                self._fail(self._local_error.cause, self._local_error.message)
            else:
                cause = cause_of_push_status(e.code())
                self._fail(cause, f"{e.code().name}: {e.details()}")
        except TransferError as e:
            self._fail(e.cause, e.message)
        except Exception as e:  # pair setup or a dead pair: fail this transfer, not the worker
            log.warning("KV transfer %s failed: %s", self.ticket.request_key, e)
            self._fail(FailureCause.PEER_LOST, f"{type(e).__name__}: {e}")
        finally:
            self._accepted.set()  # unblock the request generator if it still waits
            self._items.put(None)
            self._end()

    def _end(self) -> None:
        """Nothing reads the source blocks any more (the trailer was the last message)."""
        with self._blocks_lock:
            if self._blocks_released:
                return
            self._blocks_released = True
        self.done_time = time.monotonic()
        self._done.set()

    def _fail(self, cause: FailureCause, message: str) -> None:
        if self._local_error is not None and cause == FailureCause.PEER_LOST:
            cause, message = self._local_error.cause, self._local_error.message
        failed = self.status.fail(TransferError(cause, message))
        # A pair stays usable when the stream ended in order: refused before any send, or
        # cancelled by the receiver (which receives every layer already posted). Otherwise a
        # posted send may never be matched, and Gloo would close the pair at its timeout.
        clean = cause in (FailureCause.NOT_FOUND, FailureCause.BAD_METADATA) or (
            self._cancelled_by_receiver
        )
        if failed and self.plane_name == "pair" and not clean:
            self.sender.pairs.drop(self.ticket.endpoint)

    def _requests(self, plane: DataPlane) -> Iterator[bytes]:
        header = pb.TransferHeader(
            request_key=self.ticket.request_key,
            layout=self.model_layout.to_proto(),
            model_fingerprint=self.sender.model_fingerprint,
            num_tokens=self.ticket.num_tokens,
            data_plane=plane.kind,  # type: ignore[arg-type]
        )
        if self.heads is not None:
            header.first_head, header.num_heads = self.heads.start, len(self.heads)
        plane.fill_header(header)
        yield pb.KVChunk(header=header).SerializeToString()
        if not self._accepted.wait(max(self.status.remaining(), 0)) or self.status.state.final:
            return
        while not self._cancelled.is_set():
            try:
                item = self._next_item()
            except queue.Empty:  # the deadline passed: the receiver's, a moment later (it
                # renews on receipt), ends the call, so that both sides see the timeout
                self._local_error = TransferError(FailureCause.TIMEOUT, "no layer in time")
                self._done.wait(RECEIVER_LAG_S)
                return
            if item is None:
                return
            if isinstance(item, str):  # _KEEPALIVE
                self.status.renew(self.ticket.timeout_s)
                # The receiver renews on receipt, later than this: its deadline is no earlier.
                margin = min(WRITE_MARGIN_S, self.ticket.timeout_s / 2)
                self._write_deadline = time.monotonic() + self.ticket.timeout_s - margin
                yield pb.KVChunk(keepalive=pb.KeepAlive()).SerializeToString()
                continue
            if isinstance(item, int):
                layers = self._ready_run(item)
                self.status.advance(TransferState.TRANSFERRING)
                if not (yield from self._send(plane, layers)):
                    return
                self.nbytes += len(layers) * self.layout.layer_nbytes(self.ticket.num_tokens)
                continue
            first_token, logprobs, prompt_logprobs, extras, forks = item
            try:
                plane.flush(max(self.status.remaining(), 0))
            except Exception as e:  # end the stream; _run reports this cause
                self._local_error = _transfer_error(e)
                return
            trailer = pb.Trailer(
                first_token=_first_token(first_token, logprobs, prompt_logprobs),
                extras=[tensor_to_proto(k, v) for k, v in extras.items()],
                first_token_unix=self.first_token_unix,
                fork_first_tokens=[_first_token(t, lp) for t, lp in forks],
            )
            yield pb.KVChunk(trailer=trailer).SerializeToString()
            return

    def _next_item(self) -> _Item:
        if self._held:
            return self._held.pop()
        return self._items.get(timeout=max(self.status.remaining(), 0))

    def _ready_run(self, first: int) -> range:
        """`first` and the layers queued right behind it: they go out together."""
        end = first + 1
        while not self._held:
            try:
                item = self._items.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, int) and item == end:
                end += 1
            else:
                self._held.append(item)
        return range(first, end)

    def _send(self, plane: DataPlane, layers: range) -> Generator[bytes, None, bool]:
        """The plane's messages for `layers`, each made with the source blocks held; returns
        False when the stream must end (released blocks, a cancel, or an error)."""
        if self.slots is None:  # layer_ready() refuses this
            return False
        messages = plane.send_layers(layers, self.kv_caches, self.slots, self._write_deadline)
        while True:
            with self._blocks_lock:
                if self._blocks_released or self._cancelled.is_set():
                    return False
                try:
                    message = next(messages, None)
                except Exception as e:  # end the stream; _run reports this cause
                    self._local_error = _transfer_error(e)
                    return False
            if message is None:
                return True
            yield message


def _log_unclosed(endpoint: str, pair_id: str, call: grpc.Future) -> None:
    code = call.code()
    if code != grpc.StatusCode.OK:
        log.info("closing pair %s with %s: %s", pair_id, endpoint, code.name)


def _transfer_error(e: Exception) -> TransferError:
    """A plane's failure as the transfer's: its own TransferError, else a lost peer."""
    if isinstance(e, TransferError):
        return e
    return TransferError(FailureCause.PEER_LOST, f"{type(e).__name__}: {e}")


class KVSender:
    """Prefill side, one per process: gRPC channels, torch.distributed pairs and openings of
    receivers' shared caches (shared memory or CUDA IPC), and the transfers in flight.

    `channel`: "auto" (the receiver's shared cache on the same host, else a pair, else gRPC), or
    force "grpc", "pair" or "shm" (a forced plane that cannot be set up fails the transfer, except
    that a pair falls back to gRPC as documented)."""

    def __init__(
        self,
        model_fingerprint: str,
        host: str = "127.0.0.1",
        channel: str = "auto",
        chunk_bytes: int = 4 << 20,
        max_pairs: int = 8,
        pair_idle_s: float = 300.0,
        pair_setup_timeout_s: float = 10.0,
        wrap_plane: Callable[[DataPlane], DataPlane] | None = None,
        local_control: bool = True,
    ) -> None:
        if channel not in CHANNELS:
            raise ValueError(f"channel must be one of {CHANNELS}, got {channel!r}")
        self.model_fingerprint = model_fingerprint
        self.host = host
        self.channel = channel
        self.chunk_bytes = chunk_bytes
        self.pair_setup_timeout_s = pair_setup_timeout_s
        self.wrap_plane = wrap_plane  # tests inject faults here (kv_transfer.fake)
        self.pairs = PairPool(host, self._open_remote, self._close_remote, max_pairs, pair_idle_s)
        self.shm = SharedCacheAttachments()
        self.local = LocalControlPool() if local_control else None
        self.fallbacks = 0  # shared caches, pairs or local sockets not opened (another one went)
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        # by id(): a request has several streams in a per-rank transfer
        self._transfers: dict[int, OutboundTransfer] = {}
        self._closing: list[grpc.Future] = []  # ClosePair calls not known to be done

    def begin(
        self,
        ticket: KVTicket,
        kv_caches: Sequence[KVLayer],
        call_timeout_s: float | None = None,
        heads: range | None = None,
        num_kv_heads: int = 0,
    ) -> OutboundTransfer:
        """Start a transfer from this worker's `kv_caches` as the ticket asks; the layers follow
        (`set_source`, `layer_ready`, `finish`), after `renew()`s while the request waits here.
        `call_timeout_s` bounds the stream whatever the renewals (default: the ticket's timeout).
        `heads`: one stream of a per-rank transfer, carrying these of the model's `num_kv_heads`
        (`kv_caches` holds them) into the decode rank the ticket names (`KVTicket.for_rank`)."""
        transfer = OutboundTransfer(self, ticket, kv_caches, call_timeout_s, heads, num_kv_heads)
        with self._lock:
            self._transfers[id(transfer)] = transfer
        return transfer

    def poll(self) -> list[OutboundTransfer]:
        """Transfers that ended (Success or Failed) and no longer read their source blocks.
        Also closes the pairs idle for `pair_idle_s`: the prefill loop polls every iteration."""
        self.pairs.close_idle()
        with self._lock:
            done = [t for t in self._transfers.values() if t.finished]
            for t in done:
                del self._transfers[id(t)]
        return done

    def __len__(self) -> int:
        """Transfers begun and not yet reported by poll()."""
        return len(self._transfers)

    def choose_plane(
        self, ticket: KVTicket, device: torch.device, heads: range | None = None
    ) -> DataPlane:
        plane = self._choose_plane(ticket, device, heads)
        return self.wrap_plane(plane) if self.wrap_plane is not None else plane

    def _choose_plane(
        self, ticket: KVTicket, device: torch.device, heads: range | None
    ) -> DataPlane:
        want = self.channel
        same_host = bool(ticket.shared_cache) and ticket.host_id == host_id()
        if want == "shm" or (want == "auto" and same_host):
            if not same_host:
                why = "the receiver is on another host"
                if not ticket.shared_cache:  # e.g. tensor-parallel on GPUs: decode_core.py
                    why = "the receiver names no shared cache"
                raise TransferError(FailureCause.SETUP, f"no shm plane: {why}")
            try:
                return ShmPlane(self._shared_targets(ticket, heads), ticket)
            except (OSError, ValueError, RuntimeError) as e:  # RuntimeError: a CUDA IPC open
                if want == "shm":
                    why = f"cannot open the receiver's shared cache: {e}"
                    raise TransferError(FailureCause.SETUP, why) from e
                self._fell_back(f"cannot open {ticket.endpoint}'s shared cache ({e})")
        if want in ("auto", "pair") and ticket.pair_store:
            backend = backend_for(device)
            try:
                pair = self.pairs.get(
                    ticket.endpoint, ticket.pair_store, backend, self.pair_setup_timeout_s
                )
                return PairPlane(pair, ticket.layout.num_layers)
            except Exception as e:
                self._fell_back(f"no {backend} pair with {ticket.endpoint} ({e}); using gRPC")
        return GrpcPlane(self.chunk_bytes)

    def _shared_targets(self, ticket: KVTicket, heads: range | None) -> list[KVLayer]:
        """The receiver's shared cache as this transfer writes it: `heads` (default: every one
        of the model's) of the decode rank the ticket's endpoints name (`KVTicket.for_rank`)."""
        rank = ticket.decode_ranks()[0]
        heads = range(ticket.layout.num_kv_heads) if heads is None else heads
        if heads.start < rank.first_head or heads.stop > rank.heads.stop:
            raise ValueError(f"the decode rank holds KV heads {rank.heads}, not {heads}")
        layout = replace(ticket.layout, num_kv_heads=rank.num_heads)
        # head_window lists the tensors anew: a cache may be closed (LRU) while a plane writes
        caches = self.shm.get(ticket.shared_cache, layout).kv_caches
        return head_window(caches, heads.start - rank.first_head, len(heads))

    def _fell_back(self, why: str) -> None:
        with self._lock:
            self.fallbacks += 1
        log.warning("%s", why)

    def open_call(
        self, ticket: KVTicket, plane: DataPlane, requests: Iterator[bytes], timeout: float
    ) -> ControlCall:
        """The transfer's Push call: on the receiver's host-local socket for the shm plane
        (local_control.py), else (or when that socket cannot be reached) on its gRPC service."""
        address, local = ticket.local_control, self.local
        # An address that failed lately goes straight to gRPC (its failure was logged then).
        if local is not None and address and plane.kind == pb.DATA_PLANE_SHM:
            try:
                if local.reachable(address):
                    return local.call(address, requests, timeout)
            except OSError as e:
                self._fell_back(f"cannot reach {ticket.endpoint}'s local control socket ({e})")
        return self.push_method(ticket.endpoint)(requests, timeout=timeout)

    def _channel(self, endpoint: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(endpoint)
            if channel is None:
                channel = self._channels[endpoint] = grpc.insecure_channel(
                    endpoint, options=GRPC_OPTIONS
                )
        return channel

    def stub(self, endpoint: str) -> pb_grpc.KVTransferStub:
        return pb_grpc.KVTransferStub(self._channel(endpoint))

    def push_method(self, endpoint: str) -> grpc.StreamStreamMultiCallable:
        """Push with the requests already serialized (`wire.layer_message`): the stub's would
        serialize them again."""
        return self._channel(endpoint).stream_stream(
            PUSH_METHOD, request_serializer=None, response_deserializer=pb.PushReply.FromString
        )

    def _open_remote(
        self, endpoint: str, pair_id: str, backend: str, timeout_s: float
    ) -> Callable[[], None]:
        future = self.stub(endpoint).OpenPair.future(
            pb.OpenPairRequest(pair_id=pair_id, backend=backend, timeout_s=timeout_s),
            timeout=timeout_s + 1.0,
        )
        return lambda: future.result()  # raises the RPC's error

    def _close_remote(self, endpoint: str, pair_id: str) -> None:
        """Tell the receiver, without waiting: poll() closes idle pairs on the prefill loop's
        thread, which a receiver that is slow to answer must not stall (close() waits)."""
        call = self.stub(endpoint).ClosePair.future(
            pb.ClosePairRequest(pair_id=pair_id), timeout=2.0
        )
        call.add_done_callback(functools.partial(_log_unclosed, endpoint, pair_id))
        with self._lock:
            self._closing = [c for c in self._closing if not c.done()] + [call]

    def close(self) -> None:
        for t in list(self._transfers.values()):
            t.abort()
        self.pairs.close()
        for call in self._closing:  # closing the channels below would cancel them
            call.code()  # waits for the receiver's answer (2 s at most)
        self.shm.close()
        if self.local is not None:
            self.local.close()
        for channel in self._channels.values():
            channel.close()


def _first_token(
    token_id: int, logprobs: TokenLogprobs | None, prompt: Sequence[TokenLogprobs] = ()
) -> pb.FirstToken:
    """A sampled first token, its logprobs if asked for, and the prompt's (choice 0's only)."""
    return pb.FirstToken(
        token_id=token_id,
        logprobs=logprobs_to_proto(logprobs) if logprobs is not None else None,
        prompt_logprobs=[logprobs_to_proto(lp) for lp in prompt],
    )
