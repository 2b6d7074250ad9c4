"""`tandem worker decode`: the DecodeWorker behind the internal gRPC API (thin servicer)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import TimeoutError as FutureTimeout

import grpc

from decode_worker.decode_core import DecodeWorker
from kv_transfer import TransferError
from kv_transfer.state import request_status
from tandem.config import WorkerConfig
from tandem.engine.tp.ranks import RankLauncher
from tandem.messages import logprobs_to_proto, worker_sampling
from tandem.v1 import kv_transfer_pb2 as kvpb
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wpb_grpc
from tandem.worker_server import WorkerServer, start_worker_server, worker_stats

TICKET_WAIT_S = 60.0  # a request waits this long at most for free blocks on this worker


class DecodeServicer(wpb_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker, model: str) -> None:
        self.worker = worker
        self.model = model

    def Decode(
        self, request: wpb.DecodeRequest, context: grpc.ServicerContext
    ) -> Iterator[wpb.DecodeResponse]:
        if self.worker.draining:
            context.abort(grpc.StatusCode.UNAVAILABLE, "this decode worker is draining")
        r = request.request
        ticket_future, stream = self.worker.reserve(
            r.request_id,
            list(r.prompt_token_ids),
            worker_sampling(r),
            local=request.local_prefill,
            speculative=not r.HasField("speculative") or r.speculative,
        )
        if not context.add_callback(lambda: self.worker.cancel(r.request_id)):  # no-op once done
            # The call ended before this handler ran (cancelled while the process was stopped,
            # say): gRPC registers no callback then, and the request would wait for its KV.
            self.worker.cancel(r.request_id)
            return
        try:
            ticket = ticket_future.result(timeout=TICKET_WAIT_S)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except TransferError as e:  # cancelled, or a rank could not reserve
            context.abort(request_status(e.cause), str(e))
        except FutureTimeout:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no KV blocks freed up in time")
        yield wpb.DecodeResponse(ticket=ticket.to_proto() if ticket else kvpb.KVTicket())
        try:
            for chunk in stream:
                yield wpb.DecodeResponse(
                    tokens=wpb.TokenChunk(
                        token_ids=chunk.token_ids,
                        logprobs=[logprobs_to_proto(lp) for lp in chunk.logprobs],
                        finish_reason=chunk.finish_reason or "",
                        draft_tokens=chunk.draft_tokens,
                        accepted_tokens=chunk.accepted_tokens,
                        transfer_s=chunk.transfer_s,
                        index=chunk.index,
                        prompt_logprobs=[logprobs_to_proto(lp) for lp in chunk.prompt_logprobs],
                    )
                )
        except TransferError as e:
            context.abort(request_status(e.cause), str(e))

    def Abort(
        self, request: wpb.WorkerAbortRequest, context: grpc.ServicerContext
    ) -> wpb.WorkerAbortResponse:
        self.worker.cancel(request.request_id)
        return wpb.WorkerAbortResponse()

    def Stats(self, request: wpb.StatsRequest, context: grpc.ServicerContext) -> wpb.WorkerStats:
        return worker_stats("decode", self.model, self.worker)


def build_decode_server(config: WorkerConfig, launcher: RankLauncher | None = None) -> WorkerServer:
    """A started decode worker: engine loop, KV receiver, gRPC server, metrics, registration;
    its tensor-parallel ranks 1.. where `launcher` runs them (default: local processes)."""
    worker = DecodeWorker(config.engine, config.host, transfer=config.transfer, launcher=launcher)
    model = config.engine.model.model

    def add(server: grpc.Server) -> None:
        wpb_grpc.add_DecodeWorkerServicer_to_server(DecodeServicer(worker, model), server)

    name = wpb.DESCRIPTOR.services_by_name["DecodeWorker"].full_name
    return start_worker_server("decode", worker, add, name, config, worker.receiver.endpoint)
