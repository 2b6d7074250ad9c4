"""A decode worker's per-rank KV transfer: each tensor-parallel rank receives its own KV heads.

A decode worker of several ranks runs a `KVReceiver` in every rank over the rank's own cache:
rank 0's in the worker, rank d's in the service `serve_rank` starts in the rank's process (its
own gRPC endpoint, pair store and host-local socket, and on the CPU its cache moved into a
/dev/shm file that same-host senders map, which rank 0 unlinks when it closes). Its tickets
list every rank (`KVTicket.ranks`), and a prefill worker's ranks send each decode rank its
heads, one stream per rank pair that share heads (kv_transfer/fanout.py).

`RankReceivers` stands where the worker's receiver stood (`reserve` / `reserved`, `cancel`,
`poll`), and never waits on the ranks (the decode loop calls it between steps):
- reserve: every rank reserves the request's blocks (the same block ids: the block table is rank
  0's) before rank 0 hands the ticket out (`reserved`, a later step), so no stream finds its rank
  unprepared; a rank that refuses, dies or does not answer within `EXPECT_TIMEOUT_S` fails that
  request alone;
- poll: a request arrives once rank 0's reservation is done (its stream from prefill rank 0
  carries the trailer) and every rank has acknowledged its own, done or failed with a cause.
  The first failure on any rank cancels the reservation on every rank, and the request is
  reported failed, its blocks freed, only once every rank has reported that nothing writes into
  them any more (the receiver's rule, per rank).
Orders and acknowledgements travel through the ranks' store (tandem/engine/tp/mailbox.py).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from kv_transfer import Arrival, KVReceiver, KVTicket, TransferError, TransferState
from kv_transfer.state import FailureCause
from tandem.engine.shared_kv import move_into_shared_file, shm_available
from tandem.engine.tp.ranks import RankContext, RankLink

log = logging.getLogger(__name__)

# How often a rank with reservations looks for orders and arrivals; one without waits for its
# next order (`Mailbox.wait`).
ORDER_POLL_S = 0.002
EXPECT_TIMEOUT_S = 30.0  # how long rank 0 waits for the ranks to reserve a request's blocks


def serve_rank(
    fingerprint: str,
    host: str,
    enable_pairs: bool,
    shared_memory: bool,
    heads: list[range],
    num_kv_heads: int,
    ctx: RankContext,
) -> tuple[object, str]:
    """A decode rank 1..: a KV receiver over the rank's own cache (`heads[rank]` of the model's
    `num_kv_heads`), driven by rank 0's orders; returns its ticket entry and its cache's
    /dev/shm file ("" when it shares none)."""
    mine = heads[ctx.rank]
    path = ""
    if shared_memory and ctx.kv_caches[0].device.type == "cpu" and shm_available():
        path = move_into_shared_file(ctx.kv_caches).path
    receiver = KVReceiver(
        ctx.kv_caches,
        fingerprint,
        host,
        0,
        path,
        enable_pairs,
        first_head=mine.start,
        num_kv_heads=num_kv_heads,
    )
    ctx.closers.append(receiver.close)
    threading.Thread(
        target=_rank_loop, args=(receiver, ctx), name=f"kv-rank-{ctx.rank}-recv", daemon=True
    ).start()
    return receiver.target(), path


def _rank_loop(receiver: KVReceiver, ctx: RankContext) -> None:
    generations: dict[str, int] = {}  # each reservation's, from its order: its reports carry it
    while not ctx.stopping.is_set():
        try:
            order = ctx.next_order(ORDER_POLL_S if len(receiver) else None)
            if ctx.stopping.is_set():
                return
            if order is not None:
                kind, key, *args = order
                if kind == "expect":
                    generation, *reservation = args
                    try:
                        receiver.expect(key, *reservation)
                        generations[key] = generation
                        ctx.reports.put(("expected", key, generation, None))
                    except ValueError as e:
                        ctx.reports.put(("expected", key, generation, str(e)))
                elif kind == "cancel":
                    receiver.cancel(key)
            for a in receiver.poll():
                generation = generations.pop(a.request_key, -1)
                ctx.reports.put(("arrived", a.request_key, generation, a.error, a.nbytes))
        except dist.DistNetworkError:  # rank 0's store is gone, rank 0 with it
            log.warning("KV rank %d: rank 0 is gone; no more orders", ctx.rank)
            return
        except Exception:  # a bad order fails its request (its deadline), not the others
            log.exception("KV rank %d", ctx.rank)


@dataclass
class _Reserving:
    """A request whose ranks were told to reserve its blocks, until every rank has answered."""

    generation: int  # the reservation's number: the ranks' reports of an earlier one are stale
    block_ids: list[int]
    num_tokens: int
    timeout_s: float
    deadline: float  # monotonic: the ranks' answers are late after it
    answers: dict[int, str | None] = field(default_factory=dict)  # rank: problem, None if done


@dataclass
class _Pending:
    """A request's reservations on every rank, until each has ended."""

    generation: int
    own: Arrival | None = None  # rank 0's
    ranks: dict[int, tuple[TransferError | None, int]] = field(default_factory=dict)
    cancelled: bool = False


class RankReceivers:
    """Rank 0's KV receiving: its `KVReceiver`, and the ranks' over `links` (the services
    `serve_rank` runs in ranks 1..; none at TP 1)."""

    def __init__(self, receiver: KVReceiver, links: list[RankLink]) -> None:
        self.receiver = receiver
        self.links = links
        self.targets = (receiver.target(), *(link.started[0] for link in links))
        self.files = [link.started[1] for link in links if link.started[1]]
        self.rank_bytes = [0] * (1 + len(links))  # bytes each rank received, over its life
        self._reserving: dict[str, _Reserving] = {}  # orders out, answers coming in
        self._ready: list[tuple[str, KVTicket | Exception]] = []  # for `reserved`
        self._pending: dict[str, _Pending] = {}  # tickets out, until every rank has reported
        self._generations = 0  # reservations ordered so far

    @property
    def endpoint(self) -> str:
        return self.receiver.endpoint

    def __len__(self) -> int:
        return len(self.receiver) if not self.links else len(self._pending)

    def reserve(
        self, request_key: str, block_ids: list[int], num_tokens: int, timeout_s: float = 30.0
    ) -> None:
        """Start reserving the request's blocks on every rank: `reserved` gives its ticket once
        they all have (at once at one rank)."""
        if not self.links:
            try:
                ticket = self.receiver.expect(request_key, block_ids, num_tokens, timeout_s)
                self._ready.append((request_key, ticket))
            except ValueError as e:
                self._ready.append((request_key, e))
            return
        self._generations += 1
        generation = self._generations
        for link in self.links:
            order = ("expect", request_key, generation, block_ids, num_tokens, timeout_s)
            link.orders.put(order)
        deadline = time.monotonic() + EXPECT_TIMEOUT_S
        self._reserving[request_key] = _Reserving(
            generation, block_ids, num_tokens, timeout_s, deadline
        )

    def reserved(self) -> list[tuple[str, KVTicket | Exception]]:
        """Requests every rank has answered for since `reserve`, each once: the ticket that
        lists them all, or why there is none (ValueError for the request, TransferError for a
        rank that failed; the ranks' reservations are then cancelled)."""
        ready, self._ready = self._ready, []
        if not self._reserving:  # no store round trip per step for nothing
            return ready
        self._drain()
        now = time.monotonic()
        dead = {link.rank for link in self.links if not link.alive()}
        for key, r in list(self._reserving.items()):
            problem = next((p for p in r.answers.values() if p is not None), None)
            waiting = [link.rank for link in self.links if link.rank not in r.answers]
            lost = [rank for rank in waiting if rank in dead]
            error: Exception | None = ValueError(problem) if problem is not None else None
            if error is None and lost:
                error = TransferError(FailureCause.PEER_LOST, f"decode rank {lost[0]} died")
            elif error is None and waiting:
                if now < r.deadline:
                    continue
                error = TransferError(
                    FailureCause.TIMEOUT,
                    f"decode rank {waiting[0]} did not reserve {key!r} in time",
                )
            del self._reserving[key]
            if error is None:
                try:
                    ticket = self.receiver.expect(
                        key, r.block_ids, r.num_tokens, r.timeout_s, self.targets
                    )
                    self._pending[key] = _Pending(r.generation)
                    ready.append((key, ticket))
                    continue
                except ValueError as e:
                    error = e
            self._order("cancel", key)
            ready.append((key, error))
        return ready

    def _take(self, rank: int, report: tuple[Any, ...]) -> None:
        """A rank's report; one of a reservation since cancelled, or of an earlier reservation
        of the same key (read late: reports are read only while requests are in flight), is
        dropped."""
        kind, key, generation, *args = report
        if kind == "expected":
            reserving = self._reserving.get(key)
            if reserving is not None and reserving.generation == generation:
                reserving.answers[rank] = args[0]
            return
        error, nbytes = args
        pending = self._pending.get(key)
        if pending is not None and pending.generation == generation:
            pending.ranks[rank] = (error, nbytes)
        if error is None:
            self.rank_bytes[rank] += nbytes

    def _drain(self) -> None:
        for link in self.links:
            while (report := link.reports.get()) is not None:
                self._take(link.rank, report)

    def _order(self, kind: str, key: str) -> None:
        for link in self.links:
            link.orders.put((kind, key))

    def cancel(self, request_key: str) -> None:
        if self._reserving.pop(request_key, None) is not None:  # no ticket out: nothing writes
            self._order("cancel", request_key)
            return
        self.receiver.cancel(request_key)
        pending = self._pending.get(request_key)
        if pending is not None and not pending.cancelled:
            pending.cancelled = True
            self._order("cancel", request_key)

    def poll(self) -> list[Arrival]:
        """Requests whose reservations ended on every rank, each reported once."""
        arrivals = self.receiver.poll()
        self.rank_bytes[0] += sum(a.nbytes for a in arrivals if a.error is None)
        if not self.links:
            return arrivals
        if not self._pending:  # reports come for pending requests: no store round trip else
            return []
        for a in arrivals:
            if a.request_key in self._pending:
                self._pending[a.request_key].own = a
        self._drain()
        for link in self.links:
            if not link.alive():  # nothing writes there any more, and no report comes
                lost = TransferError(FailureCause.PEER_LOST, f"decode rank {link.rank} died")
                for p in self._pending.values():
                    p.ranks.setdefault(link.rank, (lost, 0))
        done = []
        for key, p in list(self._pending.items()):
            errors = [e for e, _ in p.ranks.values() if e is not None]
            if p.own is not None and p.own.error is not None:
                errors.insert(0, p.own.error)
            if errors:
                self.cancel(key)
            if p.own is None or len(p.ranks) < len(self.links):
                continue
            del self._pending[key]
            a = p.own
            if errors:
                real = [e for e in errors if e.cause != FailureCause.CANCELLED] or errors
                a.state, a.error = TransferState.FAILED, real[0]
            a.nbytes += sum(n for _, n in p.ranks.values())
            done.append(a)
        return done

    def close(self) -> None:
        self.receiver.close()
        for path in self.files:  # the ranks' caches (their mappings stay valid)
            Path(path).unlink(missing_ok=True)
