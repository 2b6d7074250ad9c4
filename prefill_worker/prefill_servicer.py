"""`tandem worker prefill`: the PrefillWorker behind the internal gRPC API (thin servicer)."""

from __future__ import annotations

import grpc

from kv_transfer import KVTicket, TransferError
from kv_transfer.state import request_status
from prefill_worker.prefill_core import PrefillWorker
from tandem.config import WorkerConfig
from tandem.engine.tp.ranks import RankLauncher
from tandem.messages import worker_sampling
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wpb_grpc
from tandem.worker_server import WorkerServer, start_worker_server, worker_stats

RESULT_GRACE_S = 5.0  # past the request's deadline, for the transfer to report its own end


class PrefillServicer(wpb_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillWorker, model: str) -> None:
        self.worker = worker
        self.model = model

    def Prefill(
        self, request: wpb.PrefillRequest, context: grpc.ServicerContext
    ) -> wpb.PrefillResponse:
        if self.worker.draining:
            context.abort(grpc.StatusCode.UNAVAILABLE, "this prefill worker is draining")
        r = request.request
        ticket = KVTicket.from_proto(request.ticket)
        # The router's deadline for the request (no deadline: the ticket's timeout) bounds the
        # wait; the transfer's own, renewed while the request waits here unstarted, fails the
        # future sooner when this worker stalls.
        time_left = context.time_remaining() or ticket.timeout_s
        future = self.worker.submit(
            r.request_id, list(r.prompt_token_ids), worker_sampling(r), ticket, time_left
        )

        def on_rpc_done() -> None:  # the router cancelled, or the deadline passed
            if not future.done():
                self.worker.abort(r.request_id)

        if not context.add_callback(on_rpc_done):  # the call ended before this handler ran
            on_rpc_done()
        try:
            result = future.result(timeout=time_left + RESULT_GRACE_S)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except TransferError as e:
            context.abort(request_status(e.cause), str(e))
        except TimeoutError:
            self.worker.abort(r.request_id)
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "prefill did not finish in time")
        return wpb.PrefillResponse(
            first_token=result.first_token,
            data_plane=result.data_plane,
            kv_bytes=result.nbytes,
            prefill_s=result.prefill_done - result.submitted,
            transfer_s=result.transfer_done - result.prefill_done,
        )

    def Abort(
        self, request: wpb.WorkerAbortRequest, context: grpc.ServicerContext
    ) -> wpb.WorkerAbortResponse:
        self.worker.abort(request.request_id)
        return wpb.WorkerAbortResponse()

    def Stats(self, request: wpb.StatsRequest, context: grpc.ServicerContext) -> wpb.WorkerStats:
        return worker_stats("prefill", self.model, self.worker)


def build_prefill_server(
    config: WorkerConfig, launcher: RankLauncher | None = None
) -> WorkerServer:
    """A started prefill worker: engine loop, gRPC server, metrics, registration; its
    tensor-parallel ranks 1.. where `launcher` runs them (default: local processes)."""
    worker = PrefillWorker(config.engine, config.host, config.transfer, launcher=launcher)
    model = config.engine.model.model

    def add(server: grpc.Server) -> None:
        wpb_grpc.add_PrefillWorkerServicer_to_server(PrefillServicer(worker, model), server)

    name = wpb.DESCRIPTOR.services_by_name["PrefillWorker"].full_name
    return start_worker_server("prefill", worker, add, name, config)
