"""Prefill worker core: the engine in the prefill role, plus a KV sender.

A request's life here:

    submit(request, ticket)   queued; its transfer starts bootstrapping (plane, stream, header)
    each loop iteration       until its first layer is computed, the transfer is renewed (a
                              keep-alive): its deadline counts from the work, not the queue
    prefill, last chunk       layer l of the prompt goes out as soon as layer l is computed
                              (layer-wise streaming; off: all layers after the step)
    first token sampled       FINISHED_PREFILLED, blocks held; the trailer carries the token
                              (n > 1: and the other choices' first tokens, sampled from the
                              same logits: one prefill, one transfer)
    transfer final            blocks released; the submit future resolves (or fails with a
                              TransferError the router can retry elsewhere)
    abort                     the transfer stops; blocks are freed once no thread reads them
"""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from kv_transfer import KVSender, KVTicket, OutboundTransfer, TransferError
from kv_transfer.ticket import model_fingerprint
from kv_transfer.transfer_metrics import TransferMetrics
from prefill_worker.rank_senders import RankSenders, RankTransfer, serve_rank
from tandem.config import (
    EngineConfig,
    TransferConfig,
    fault_kv_trailer_delay_s,
    fault_prefill_step_delay_s,
)
from tandem.engine.engine_core import EngineCore, RequestDelta
from tandem.engine.loop import EngineLoop
from tandem.engine.request import Request, RequestStatus
from tandem.engine.scheduler import Role
from tandem.engine.tp.kv_view import rank_heads
from tandem.engine.tp.ranks import RankLauncher, RankLink
from tandem.sampling_params import SamplingParams


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    first_token: int
    data_plane: str
    nbytes: int
    submitted: float  # monotonic time the request reached this worker
    prefill_done: float  # monotonic time the first token was sampled
    transfer_done: float  # monotonic time the receiver acknowledged


class PrefillRole(Role):
    """Hands every request over after its first token; streams prompt layers to its transfer."""

    def __init__(self, worker: PrefillWorker, stream_layers: bool) -> None:
        self.worker = worker
        self.streams_layers = stream_layers

    def hands_over_after_first_token(self, request: Request) -> bool:
        return True

    def prompt_layer_computed(self, layer: int, requests: list[Request]) -> None:
        for req in requests:
            self.worker.layer_computed(req.request_id, layer)


class PrefillWorker(EngineLoop):
    def __init__(
        self,
        config: EngineConfig,
        host: str = "127.0.0.1",
        transfer: TransferConfig = TransferConfig(),
        sender: KVSender | None = None,
        launcher: RankLauncher | None = None,  # where tensor-parallel ranks 1.. run
    ) -> None:
        stream_layers = transfer.stream_layers
        engine = EngineCore(config, PrefillRole(self, stream_layers), launcher)
        super().__init__(engine, "prefill-loop")
        executor = engine.executor
        self.fingerprint = model_fingerprint(executor.model_config, engine.model_path)
        sender = sender or KVSender(
            self.fingerprint, host, transfer.channel, pair_idle_s=transfer.pair_idle_s
        )
        tp = engine.config.model.tensor_parallel_size
        self.kv_caches = list(engine.runner.kv_caches)  # rank 0's own heads
        links: list[RankLink] = []
        if tp > 1:  # each rank sends its own heads
            service = functools.partial(
                serve_rank, self.fingerprint, host, transfer.channel, transfer.pair_idle_s
            )
            links = executor.start_rank_service(service)
        heads = rank_heads(executor.model_config, tp)
        self.outbound = RankSenders(sender, links, heads, len(self.kv_caches))
        self.stream_layers = stream_layers
        self.transfer_metrics = TransferMetrics()
        self._transfers: dict[str, OutboundTransfer | RankTransfer] = {}
        self._futures: dict[str, Future[PrefillResult]] = {}
        self._prefill_done: dict[str, float] = {}
        self._submitted: dict[str, float] = {}
        self._sourced: set[str] = set()
        self.step_delay_s = fault_prefill_step_delay_s()  # 0 unless a test injects the fault
        self.trailer_delay_s = fault_kv_trailer_delay_s()  # likewise

    @property
    def sender(self) -> KVSender:
        """Rank 0's KV sender (its streams; the other ranks' are in their own processes)."""
        return self.outbound.sender

    @sender.setter
    def sender(self, sender: KVSender) -> None:
        self.outbound.sender = sender

    # -- any thread ---------------------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        ticket: KVTicket,
        time_left_s: float | None = None,
    ) -> Future[PrefillResult]:
        """Prefill and push to the ticket's receiver; ValueError (bad request) or TransferError
        surface through the future. `time_left_s`: the request's own deadline, which bounds the
        transfer however long its renewals keep it waiting here (default: the ticket's)."""
        result: Future[PrefillResult] = Future()
        submitted = time.monotonic()

        def add() -> None:
            # A ticket for another prompt: a longer one would map slots past the prompt's blocks
            # and kill the loop thread in the middle of a step, a shorter one send a truncated KV.
            if ticket.num_tokens != len(prompt_token_ids):
                n, m = ticket.num_tokens, len(prompt_token_ids)
                result.set_exception(ValueError(f"ticket is for {n} prompt tokens, prompt has {m}"))
                return
            try:
                self.engine.add_request(request_id, prompt_token_ids, params)
            except ValueError as e:
                result.set_exception(e)
                return
            self._futures[request_id] = result
            self._submitted[request_id] = submitted
            self._transfers[request_id] = self.outbound.begin(ticket, self.kv_caches, time_left_s)

        self.call(add)
        return result

    def abort(self, request_id: str) -> None:
        self.call(lambda: self._abort(request_id))

    # -- loop thread --------------------------------------------------------------------------

    def layer_computed(self, request_id: str, layer: int) -> None:
        transfer = self._transfers.get(request_id)
        if transfer is None:
            return
        if request_id not in self._sourced:
            transfer.set_source(self.engine.kv_cache.block_table(request_id))
            self._sourced.add(request_id)
        transfer.layer_ready(layer)

    def after_step(self, deltas: list[RequestDelta]) -> None:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)  # injected: the step took this much longer
        now = time.monotonic()
        first_logprobs = {d.request.request_id: d.logprobs[0] for d in deltas if d.logprobs}
        for d in deltas:
            req = d.request
            transfer = self._transfers.get(req.request_id)
            if transfer is None or req.status != RequestStatus.FINISHED_PREFILLED:
                continue
            if not self.stream_layers:
                transfer.set_source(self.engine.kv_cache.block_table(req.request_id))
                transfer.all_layers_ready()
            self._prefill_done[req.request_id] = now
            forks = [(f.output_token_ids[0], first_logprobs.get(f.request_id)) for f in req.forks]
            trailer = (
                d.new_token_ids[0],
                first_logprobs.get(req.request_id),
                d.handover,
                forks,
                d.prompt_logprobs,
            )
            if self.trailer_delay_s:  # injected: the transfer stalls before its trailer
                timer = threading.Timer(self.trailer_delay_s, transfer.finish, trailer)
                timer.daemon = True
                timer.start()
            else:
                transfer.finish(*trailer)

    def in_flight(self) -> bool:
        return super().in_flight() or len(self.outbound) > 0

    def before_step(self) -> None:
        for key, transfer in self._transfers.items():
            if key not in self._sourced and key not in self._prefill_done:
                transfer.renew()  # still queued, or its earlier chunks computing
        for transfer in self.outbound.poll():
            key = transfer.ticket.request_key
            self.engine.abort(key, RequestStatus.FINISHED_PREFILLED)  # frees the blocks
            self._transfers.pop(key, None)
            self._sourced.discard(key)
            done = self._prefill_done.pop(key, time.monotonic())
            submitted = self._submitted.pop(key, done)
            future = self._futures.pop(key, None)
            if future is None:
                continue
            if transfer.status.error is not None:
                self.transfer_metrics.failure(transfer.status.error.cause)
                future.set_exception(transfer.status.error)
            else:
                seconds = transfer.done_time - transfer.started
                self.transfer_metrics.success(transfer.nbytes, seconds, None)
                future.set_result(
                    PrefillResult(
                        key,
                        transfer.first_token,
                        transfer.plane_name,
                        transfer.nbytes,
                        submitted,
                        done,
                        transfer.done_time,
                    )
                )

    def _abort(self, request_id: str) -> None:
        transfer = self._transfers.get(request_id)
        if transfer is None:
            self.engine.abort(request_id)
            return
        transfer.abort()  # before_step frees the blocks once the transfer stops reading them

    def fail_all(self, error: Exception) -> None:
        for transfer in self._transfers.values():
            transfer.abort()  # before_step frees the blocks once they are no longer read
        for future in self._futures.values():
            future.set_exception(error)
        self._futures.clear()
        for request_id in list(self.engine.scheduler.requests):
            if request_id not in self._transfers:
                self.engine.abort(request_id)

    def close(self) -> None:
        self.stop()
        self.sender.close()


__all__ = ["PrefillResult", "PrefillWorker", "TransferError"]
