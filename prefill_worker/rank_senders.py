"""A prefill worker's per-rank KV transfer: each tensor-parallel rank sends its own KV heads.

`RankSenders` stands where the worker's `KVSender` stood (`begin`, `poll`). A ticket that lists
decode ranks (`KVTicket.ranks`), or any ticket when this worker runs per-rank over several
ranks, becomes a `RankTransfer`: one stream per (prefill rank, decode rank) pair that share
heads (kv_transfer/fanout.py), each a transfer of its own on any data plane, into the decode
rank's own endpoint. Any other ticket is one transfer, as ever (TP 1 into TP 1).

Rank 0's streams run on its own `KVSender`; rank p's in the rank's own process, in the service
this module starts there (`serve_rank`), which rank 0 drives through the ranks' store
(tandem/engine/tp/mailbox.py): begin, source blocks, layers ready, finish, renew, abort. Layer l
is in every rank's cache once rank 0's forward has passed layer l (each rank wrote its KV of
layer l before the all-reduce that ends it), so rank 0 passes layer readiness on, at most every
READY_EVERY_S and after the last layer (an order is a store round trip, on the forward's path).
The trailer (first token, extras) rides rank 0's streams; the other ranks' streams end with a
bare one (the decode side takes the trailer of the stream that carries head 0, always rank 0's).
A transfer is done when every stream is (rank p reports once all of its streams are); it fails
as soon as one stream fails (the others are aborted), and the worker frees the source blocks
only once every rank has reported its streams stopped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kv_transfer import KVSender, KVTicket, OutboundTransfer
from kv_transfer.fanout import RankStream, rank_streams
from kv_transfer.state import FailureCause, TransferError, TransferState, TransferStatus
from tandem.engine.tp.kv_view import head_window
from tandem.engine.tp.ranks import RankContext, RankLink

log = logging.getLogger(__name__)

# How often a rank with no stream in flight but pairs open (or a transfer not yet reported) looks
# for orders (`report` closes the pairs idle for the sender's `pair_idle_s`); one with none of
# these waits for its next order (`Mailbox.wait`).
IDLE_POLL_S = 0.005
# Layer readiness goes to the ranks at most this often (and after the last layer): every layer of
# a long prompt (each takes longer), a few of a short one's (an order costs its step ~0.1 ms).
READY_EVERY_S = 0.005
ORDER_POLL_S = 0.002  # how often a rank with streams in flight looks for orders and ends


@dataclass(frozen=True)
class _Stream:
    """One stream of a rank: its decode rank's ticket, the heads, where they sit in its cache."""

    ticket: KVTicket
    heads: range
    first: int  # of the heads in the rank's cache


def serve_rank(
    fingerprint: str, host: str, channel: str, pair_idle_s: float, ctx: RankContext
) -> None:
    """A prefill rank 1..: a KV sender over the rank's own cache, driven by rank 0's orders."""
    sender = KVSender(fingerprint, host, channel, pair_idle_s=pair_idle_s)
    ctx.closers.append(sender.close)
    threading.Thread(
        target=_RankStreams(sender, ctx).run, name=f"kv-rank-{ctx.rank}-send", daemon=True
    ).start()


class _RankStreams:
    """A prefill rank's streams, by request, as rank 0's orders begin and drive them; a
    request's report goes back once all of its streams ended."""

    def __init__(self, sender: KVSender, ctx: RankContext) -> None:
        self.sender = sender
        self.ctx = ctx
        self.streams: dict[str, list[OutboundTransfer]] = {}
        self.ended: dict[str, list[OutboundTransfer]] = {}
        self.ready: dict[str, int] = {}  # layers passed to a request's streams: [0, ready)

    def run(self) -> None:
        while not self.ctx.stopping.is_set():
            try:
                busy = bool(self.streams) or len(self.sender) > 0 or len(self.sender.pairs) > 0
                poll_s = (ORDER_POLL_S if self.streams else IDLE_POLL_S) if busy else None
                order = self.ctx.next_order(poll_s)
                if self.ctx.stopping.is_set():
                    return
                if order is not None:
                    self.take(*order)
                self.report()
            except dist.DistNetworkError:  # rank 0's store is gone, rank 0 with it
                log.warning("KV rank %d: rank 0 is gone; no more orders", self.ctx.rank)
                return
            except Exception:  # a bad order fails its transfer (its deadline), not the others
                log.exception("KV rank %d", self.ctx.rank)

    def take(self, kind: str, key: str, *args: Any) -> None:
        if kind == "begin":
            streams, timeout_s, num_kv_heads, channel = args
            self.sender.channel = channel  # rank 0's: a test may change it between transfers
            caches = self.ctx.kv_caches
            self.streams[key] = [
                self.sender.begin(
                    s.ticket,
                    head_window(caches, s.first, len(s.heads)),
                    timeout_s,
                    s.heads,
                    num_kv_heads,
                )
                for s in streams
            ]
            self.ended[key], self.ready[key] = [], 0
            return
        for t in self.streams.get(key, []):
            if kind == "source":
                t.set_source(args[0])
            elif kind == "ready":
                for layer in range(self.ready[key], args[0] + 1):
                    t.layer_ready(layer)
            elif kind == "finish":
                t.finish(0)  # a bare trailer: the request's rides rank 0's streams
            elif kind == "renew":
                t.renew()
            elif kind == "abort":
                t.abort()
        if kind == "ready" and key in self.ready:
            self.ready[key] = max(self.ready[key], args[0] + 1)

    def report(self) -> None:
        for t in self.sender.poll():
            self.ended[t.ticket.request_key].append(t)
        for key in [k for k, ts in self.streams.items() if len(self.ended[k]) == len(ts)]:
            done = self.ended.pop(key)
            del self.streams[key], self.ready[key]
            self.ctx.reports.put((key, _first_error(done), sum(t.nbytes for t in done)))


def _first_error(transfers: Sequence[Any]) -> TransferError | None:
    """The error that ended a set of streams (see `_cause`)."""
    return _cause([t.status.error for t in transfers])


def _cause(errors: Sequence[TransferError | None]) -> TransferError | None:
    """The first error that is not a CANCELLED (which the other streams get when one fails),
    else the first."""
    real = [e for e in errors if e is not None]
    return next((e for e in real if e.cause != FailureCause.CANCELLED), real[0] if real else None)


class RankTransfer:
    """One request's per-rank transfer as rank 0 drives it: what the prefill worker uses of an
    `OutboundTransfer`."""

    def __init__(
        self,
        ticket: KVTicket,
        local: list[OutboundTransfer],
        links: list[RankLink],
        num_layers: int,
    ) -> None:
        self.ticket = ticket
        self.local = local  # rank 0's streams
        self.links = links  # the ranks with streams
        self.num_layers = num_layers
        self.started = time.monotonic()
        self.status = TransferStatus(self.started + ticket.timeout_s)
        self.nbytes = 0
        self.done_time = 0.0
        self.rank_bytes: dict[int, int] = {}  # bytes each rank sent, once it reported
        self._ended: list[OutboundTransfer] = []
        self._reports: dict[int, TransferError | None] = {}
        self._renewed = self.started
        self._posted = 0.0  # when layer readiness last went to the ranks
        self._aborted = False

    @property
    def first_token(self) -> int:
        return self.local[0].first_token if self.local else -1

    @property
    def plane_name(self) -> str:
        return self.local[0].plane_name if self.local else ""

    def _order(self, kind: str, *args: Any) -> None:
        for link in self.links:
            link.orders.put((kind, self.ticket.request_key, *args))

    def set_source(self, block_ids: list[int]) -> None:
        for t in self.local:
            t.set_source(block_ids)
        self._order("source", block_ids)

    def layer_ready(self, layer: int) -> None:
        for t in self.local:
            t.layer_ready(layer)
        now = time.monotonic()
        if now - self._posted >= READY_EVERY_S or layer == self.num_layers - 1:
            self._posted = now
            self._order("ready", layer)

    def all_layers_ready(self) -> None:
        for t in self.local:
            t.all_layers_ready()
        self._order("ready", self.num_layers - 1)

    def finish(self, *trailer: Any) -> None:
        for t in self.local:
            t.finish(*trailer)
        self._order("finish")

    def renew(self) -> None:
        for t in self.local:
            t.renew()
        now = time.monotonic()
        if now - self._renewed >= self.ticket.timeout_s / 4:  # as a rank's streams send them
            self._renewed = now
            self._order("renew")

    def abort(self) -> None:
        if self._aborted:
            return
        self._aborted = True
        for t in self.local:
            t.abort()
        self._order("abort")

    def stream_ended(self, stream: OutboundTransfer) -> None:
        """One of rank 0's streams ended."""
        self._ended.append(stream)

    def rank_reported(self, rank: int, error: TransferError | None, nbytes: int) -> None:
        """Rank `rank`'s streams all ended (or it died: `error` says so)."""
        self._reports.setdefault(rank, error)
        self.rank_bytes[rank] = nbytes

    def settle(self) -> bool:
        """Abort the rest once a stream failed; True once every stream has ended (the final
        status set)."""
        errors = [t.status.error for t in self._ended] + list(self._reports.values())
        if any(e is not None for e in errors):
            self.abort()
        if len(self._ended) < len(self.local) or len(self._reports) < len(self.links):
            return False
        error = _cause([t.status.error for t in self._ended] + list(self._reports.values()))
        self.done_time = max([t.done_time for t in self._ended] + [time.monotonic()])
        self.nbytes = sum(t.nbytes for t in self._ended) + sum(self.rank_bytes.values())
        if error is not None:
            self.status.fail(error)
        else:
            self.status.advance(TransferState.TRANSFERRING)
            self.status.advance(TransferState.SUCCESS)
        return True


class RankSenders:
    """Rank 0's KV sending: its `KVSender`, and per-rank transfers over `links` (the services
    `serve_rank` runs in ranks 1..; none at TP 1)."""

    def __init__(
        self, sender: KVSender, links: list[RankLink], prefill_heads: list[range], num_layers: int
    ) -> None:
        self.sender = sender
        self.links = links
        self.prefill_heads = prefill_heads  # each rank's KV heads (one range: rank 0 holds all)
        self.num_kv_heads = max(h.stop for h in prefill_heads)
        self.num_layers = num_layers
        self.rank_bytes = [0] * len(prefill_heads)  # bytes each rank sent, over its life
        self._transfers: dict[str, RankTransfer] = {}
        self._owner: dict[int, RankTransfer] = {}  # by id() of rank 0's streams

    def begin(
        self,
        ticket: KVTicket,
        kv_caches: Sequence[torch.Tensor],
        call_timeout_s: float | None = None,
    ) -> OutboundTransfer | RankTransfer:
        """The ticket's transfer from this worker's `kv_caches` (rank 0's own heads): one
        stream into one receiver, or a `RankTransfer`."""
        if not ticket.ranks and not self.links:
            return self.sender.begin(ticket, kv_caches, call_timeout_s)
        decode = ticket.decode_ranks()
        try:
            streams = rank_streams(self.prefill_heads, [d.heads for d in decode])
        except ValueError:  # another model: decode rank 0 refuses the header, nothing moves
            heads = range(0, min(self.prefill_heads[0].stop, decode[0].heads.stop))
            streams = [RankStream(0, 0, heads)]
        timeout = ticket.timeout_s if call_timeout_s is None else call_timeout_s
        local = []
        for s in streams:
            if s.prefill_rank == 0:
                window = head_window(kv_caches, s.heads.start, len(s.heads))
                local.append(
                    self.sender.begin(
                        ticket.for_rank(s.decode_rank), window, timeout, s.heads, self.num_kv_heads
                    )
                )
        links = []
        for link in self.links:
            first = self.prefill_heads[link.rank].start
            mine = [
                _Stream(ticket.for_rank(s.decode_rank), s.heads, s.heads.start - first)
                for s in streams
                if s.prefill_rank == link.rank
            ]
            if mine:
                order = ("begin", ticket.request_key, mine, timeout, self.num_kv_heads)
                link.orders.put((*order, self.sender.channel))
                links.append(link)
        transfer = RankTransfer(ticket, local, links, self.num_layers)
        self._transfers[ticket.request_key] = transfer
        self._owner.update((id(t), transfer) for t in local)
        return transfer

    def poll(self) -> list[OutboundTransfer | RankTransfer]:
        """Transfers that ended and whose source blocks no stream reads any more."""
        done: list[OutboundTransfer | RankTransfer] = []
        for t in self.sender.poll():
            self.rank_bytes[0] += t.nbytes if t.status.error is None else 0
            owner = self._owner.pop(id(t), None)
            if owner is None:
                done.append(t)
            else:
                owner.stream_ended(t)
        if not self._transfers:  # reports come for transfers in flight: no store round trip else
            return done
        for link in self.links:
            while (report := link.reports.get()) is not None:
                key, error, nbytes = report
                self.rank_bytes[link.rank] += nbytes
                transfer = self._transfers.get(key)
                if transfer is not None:
                    transfer.rank_reported(link.rank, error, nbytes)
            if not link.alive():  # nothing reads there any more, and no report comes
                lost = TransferError(FailureCause.PEER_LOST, f"prefill rank {link.rank} died")
                for transfer in self._transfers.values():
                    if link in transfer.links:
                        transfer.rank_reported(link.rank, lost, 0)
        for key, transfer in list(self._transfers.items()):
            if transfer.settle():
                del self._transfers[key]
                done.append(transfer)
        return done

    def __len__(self) -> int:
        return len(self.sender) + len(self._transfers)
