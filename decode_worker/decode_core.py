"""Decode worker core: the engine in the decode role, plus a KV receiver.

A request's life here:

    reserve(request)          queued; once admitted its prompt blocks are reserved and the
                              ticket resolves (parked: WAITING_FOR_REMOTE_KV)
    KV lands                  poll() reports it; the request joins the running batch with the
                              first token the prefill worker sampled
    decode                    tokens stream out through its OutputStream until it stops
    transfer fails            `local`: compute the prompt here in the same blocks; `fail`: end
                              the stream with the TransferError
    cancel                    the receiver stops writing; the blocks are freed once nothing can
                              write into them; the stream ends (aborted)

`local=True` at reserve skips the transfer (conditional disaggregation: D prefills itself).

n > 1 choices: the prompt's blocks are reserved and received once; the arrival carries every
choice's first token and the choices fork over the blocks (tandem/engine/scheduler.py). Their
chunks share one stream, each tagged with its choice's index; the stream ends once every choice
has ended. Cancelling the request's id ends every choice; a choice's own id ends that one.
"""

from __future__ import annotations

import functools
import logging
import queue
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from decode_worker.rank_receivers import RankReceivers, serve_rank
from kv_transfer import Arrival, KVReceiver, KVTicket, TransferError, TransferState
from kv_transfer.shm import SharedCache, can_share, create_shared_cache
from kv_transfer.state import FailureCause
from kv_transfer.ticket import KVLayout, model_fingerprint
from kv_transfer.transfer_metrics import TransferMetrics
from tandem.config import EngineConfig, TransferConfig
from tandem.engine.engine_core import EngineCore, RequestDelta
from tandem.engine.loop import EngineLoop
from tandem.engine.request import Request, RequestStatus
from tandem.engine.scheduler import Role
from tandem.engine.tp.kv_view import rank_heads
from tandem.engine.tp.ranks import RankLauncher, RankLink
from tandem.outputs import TokenLogprobs
from tandem.sampling_params import SamplingParams, choice_request_id

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenChunk:
    """Tokens one step produced for one request; `finish_reason` is set on the last chunk."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    draft_tokens: int = 0  # on the last chunk: speculative tokens verified, and accepted
    accepted_tokens: int = 0
    transfer_s: float = 0.0  # on the first chunk after a transfer: prefill end to admission
    index: int = 0  # the choice these tokens are of
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # with the first token


class OutputStream:
    """The chunks of one request (of each of its n choices), for another thread to iterate;
    ends with a finished chunk of every choice, or raises the error that ended it (e.g. a
    TransferError under `fail`)."""

    def __init__(self, request_id: str = "", n: int = 1) -> None:
        self.choice_ids = [choice_request_id(request_id, i) for i in range(n)]
        self._queue: queue.Queue[TokenChunk | BaseException] = queue.Queue()

    def put(self, item: TokenChunk | BaseException) -> None:
        self._queue.put(item)

    def __iter__(self) -> Iterator[TokenChunk]:
        open_choices = len(self.choice_ids)
        while True:
            item = self._queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                open_choices -= 1
                if not open_choices:
                    return

    def tokens(self) -> list[int]:
        return [t for chunk in self for t in chunk.token_ids]


class DecodeRole(Role):
    def __init__(self) -> None:
        self.local: set[str] = set()  # requests this worker prefills itself

    def computes_prompt(self, request: Request) -> bool:
        return request.request_id in self.local


class DecodeWorker(EngineLoop):
    def __init__(
        self,
        config: EngineConfig,
        host: str = "127.0.0.1",
        port: int = 0,
        shared_memory: bool = True,
        enable_pairs: bool = True,
        transfer: TransferConfig = TransferConfig(),
        launcher: RankLauncher | None = None,  # where tensor-parallel ranks 1.. run
    ) -> None:
        self.role = DecodeRole()
        super().__init__(EngineCore(config, self.role, launcher), "decode-loop")
        engine = self.engine
        self.shm: SharedCache | None = None
        device = engine.runner.device
        # Same-host senders write into the shared cache, rank 0's made here (ranks 1..'s: their
        # own files, rank_receivers.py). A TP worker on GPUs shares none: its ranks 1.. share CPU
        # caches only, and rank 0 alike.
        tensor_parallel = config.model.tensor_parallel_size > 1
        if shared_memory and can_share(device) and not (tensor_parallel and device.type != "cpu"):
            layout = KVLayout.of(engine.runner.kv_caches)  # rank 0's heads

            def share() -> list[torch.Tensor]:
                self.shm = create_shared_cache(layout, engine.kv_cache.num_blocks, device)
                return self.shm.kv_caches

            engine.runner.use_kv_caches(share)
        executor = engine.executor
        fingerprint = model_fingerprint(executor.model_config, engine.model_path)
        num_kv_heads = executor.model_config.num_kv_heads
        kv_caches = list(engine.runner.kv_caches)  # rank 0's own heads
        links: list[RankLink] = []
        if tensor_parallel:  # each rank receives its own heads
            tp = config.model.tensor_parallel_size
            heads = rank_heads(executor.model_config, tp)
            service = functools.partial(
                serve_rank, fingerprint, host, enable_pairs, shared_memory, heads, num_kv_heads
            )
            links = executor.start_rank_service(service)
        shared = "" if self.shm is None else self.shm.locator
        receiver = KVReceiver(
            kv_caches, fingerprint, host, port, shared, enable_pairs, num_kv_heads=num_kv_heads
        )
        self.receiver = RankReceivers(receiver, links)
        self.arrivals = engine.executor.arrivals(self.receiver, engine.scheduler)
        self.transfer = transfer
        self.transfer_metrics = TransferMetrics()
        self._streams: dict[str, OutputStream] = {}  # by choice id, until the choice ends
        self._requests: dict[str, OutputStream] = {}  # by request id, until every choice ends
        self._tickets: dict[str, Future[KVTicket | None]] = {}  # waiting for their blocks
        self._reserving: set[str] = set()  # of those, given blocks: their ranks reserving
        self._cancelling: set[str] = set()

    # -- any thread ---------------------------------------------------------------------------

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        local: bool = False,
        speculative: bool = True,
    ) -> tuple[Future[KVTicket | None], OutputStream]:
        """Queue a request; the future gives its ticket once blocks are reserved (None when
        `local`), or raises ValueError for a bad request."""
        ticket: Future[KVTicket | None] = Future()
        stream = OutputStream(request_id, params.n)

        def add() -> None:
            try:
                self.engine.add_request(request_id, prompt_token_ids, params, 0, speculative)
            except ValueError as e:
                ticket.set_exception(e)
                return
            self._requests[request_id] = stream
            self._streams.update(dict.fromkeys(stream.choice_ids, stream))
            if local:
                self.role.local.add(request_id)
                ticket.set_result(None)
            else:
                self._tickets[request_id] = ticket

        self.call(add)
        return ticket, stream

    def cancel(self, request_id: str) -> None:
        """End the request (every choice), or one choice by its id."""
        self.call(lambda: self._cancel(request_id))

    # -- loop thread --------------------------------------------------------------------------

    def in_flight(self) -> bool:
        return super().in_flight() or bool(self._tickets) or len(self.receiver) > 0

    def before_step(self) -> None:
        for arrival in self.arrivals.poll():
            self._arrived(arrival)
        self._issue_tickets()  # the ranks answer between steps, and while the loop idles

    def after_step(self, deltas: list[RequestDelta]) -> None:
        self._issue_tickets()
        for d in deltas:
            self._emit(d.request, d.new_token_ids, d.logprobs, d.prompt_logprobs)

    def _issue_tickets(self) -> None:
        """Reserve the KV of requests given blocks since (on every rank), hand out the tickets
        of those reserved."""
        for rid in self._tickets.keys() - self._reserving:
            req = self.engine.scheduler.requests.get(rid)
            if req is None or req.status != RequestStatus.WAITING_FOR_REMOTE_KV:
                continue
            blocks = self.engine.kv_cache.block_table(rid)
            self.receiver.reserve(rid, blocks, req.num_prompt_tokens, self.transfer.timeout_s)
            self._reserving.add(rid)
        for rid, ticket in self.receiver.reserved():
            self._reserving.discard(rid)
            future = self._tickets.pop(rid, None)
            if future is None:  # cancelled meanwhile
                continue
            if isinstance(ticket, Exception):  # this request's alone: no sender has its ticket
                future.set_exception(ticket)
                self._finish_aborted(rid)
            else:
                future.set_result(ticket)

    def _arrived(self, a: Arrival) -> None:
        rid = a.request_key
        scheduler = self.engine.scheduler
        if rid in self._cancelling or rid not in scheduler.parked:
            self._cancelling.discard(rid)
            self._finish_aborted(rid)
            return
        if a.state == TransferState.SUCCESS:
            assert a.first_token is not None
            if len(a.fork_first_tokens) != len(scheduler.parked[rid].forks):
                # A prefill worker that did not sample every choice's first token (one older
                # than n on the wire): the prompt is computed here, in its blocks.
                scheduler.compute_prompt_locally(rid)
                return
            exposed = time.time() - a.first_token_unix if a.first_token_unix else None
            self.transfer_metrics.success(a.nbytes, a.seconds, exposed)
            firsts = [(a.first_token, a.logprobs), *a.fork_first_tokens]
            fork_tokens = [t for t, _ in a.fork_first_tokens]
            req = self.engine.remote_kv_arrived(rid, a.first_token, a.extras, fork_tokens)
            for choice, (token, logprobs) in zip((req, *req.forks), firsts, strict=True):
                first_logprobs = [logprobs] if logprobs else []
                self._emit(choice, [token], first_logprobs, a.prompt_logprobs, exposed or 0.0)
            return
        assert a.error is not None
        self.transfer_metrics.failure(a.error.cause)
        local = self.transfer.on_failure == "local" and a.error.cause != FailureCause.CANCELLED
        if a.error.cause != FailureCause.CANCELLED:
            log.warning("%s: %s; %s", rid, a.error, "computing it here" if local else "ending it")
        if local:
            scheduler.compute_prompt_locally(rid)
        else:
            self.engine.abort(rid)
            stream = self._requests.pop(rid, None)
            if stream is not None:
                for choice_id in stream.choice_ids:
                    self._streams.pop(choice_id, None)
                stream.put(a.error)

    def _emit(
        self,
        req: Request,
        tokens: list[int],
        logprobs: list[TokenLogprobs],
        prompt_logprobs: list[TokenLogprobs],
        transfer_s: float = 0.0,
    ) -> None:
        stream = self._streams.get(req.request_id)
        if stream is None:
            return
        reason = req.status.value if req.status.finished else None
        m = req.metrics
        stream.put(
            TokenChunk(
                tokens,
                logprobs,
                reason,
                m.num_draft_tokens,
                m.num_accepted_tokens,
                transfer_s,
                req.index,
                prompt_logprobs,
            )
        )
        if reason is not None:
            self._ended(req.request_id, stream)

    def _ended(self, choice_id: str, stream: OutputStream) -> None:
        del self._streams[choice_id]
        self.role.local.discard(choice_id)
        if not any(c in self._streams for c in stream.choice_ids):
            del self._requests[stream.choice_ids[0]]

    def _cancel(self, request_id: str) -> None:
        stream = self._requests.get(request_id)
        for choice_id in stream.choice_ids if stream is not None else [request_id]:
            self._cancel_choice(choice_id)

    def _cancel_choice(self, request_id: str) -> None:
        req = self.engine.scheduler.requests.get(request_id)
        if req is None:
            return
        ticket = self._tickets.pop(request_id, None)
        if ticket is None and request_id in self.engine.scheduler.parked:
            self._cancelling.add(request_id)  # freed once nothing can write into its blocks
            self.receiver.cancel(request_id)
            return
        if request_id in self._reserving:  # its ticket is not out: nothing writes there
            self._reserving.discard(request_id)
            self.receiver.cancel(request_id)
        if ticket is not None:
            ticket.set_exception(TransferError(FailureCause.CANCELLED, "cancelled"))
        self._finish_aborted(request_id)

    def _finish_aborted(self, request_id: str) -> None:
        req = self.engine.scheduler.requests.get(request_id)
        self.engine.abort(request_id)
        self.role.local.discard(request_id)
        ended = [request_id]
        if req is not None and req.forking:  # they end with the request that would fork them
            ended += [f.request_id for f in req.forks]
        for choice_id in ended:
            stream = self._streams.get(choice_id)
            if stream is not None:
                index = stream.choice_ids.index(choice_id)
                stream.put(TokenChunk([], [], RequestStatus.FINISHED_ABORTED.value, index=index))
                self._ended(choice_id, stream)

    def fail_all(self, error: Exception) -> None:
        for request_id in list(self.engine.scheduler.requests):
            self.receiver.cancel(request_id)
            self.engine.abort(request_id)
        for future in self._tickets.values():
            future.set_exception(error)
        for stream in self._requests.values():
            stream.put(error)
        self._tickets.clear()
        self._reserving.clear()
        self._streams.clear()
        self._requests.clear()
        self._cancelling.clear()
        self.role.local.clear()

    def close(self) -> None:
        self.stop()
        self.receiver.close()
        if self.shm is not None:
            self.shm.close()
