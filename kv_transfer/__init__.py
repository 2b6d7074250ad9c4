"""KV transfer: moves a request's prompt KV cache from a prefill worker into the blocks a decode
worker reserved for it.

The decode side (`KVReceiver`) reserves and issues a `KVTicket`; the prefill side (`KVSender`)
pushes the KV layer by layer over one of three data planes (the receiver's shared cache on the
same host, in shared memory or opened by CUDA IPC; a torch.distributed pair; or the control
stream's own messages), then the first token. Control is one Push stream whatever the plane: on
the receiver's gRPC service, or, for the shared cache, the same messages on its host-local Unix
socket (`local_control`, which falls back to gRPC). So every plane shares one state machine, one
set of deadlines and one set of typed failures (`kv_transfer.state`). Between tensor-parallel
workers each rank pair that shares KV heads has a stream of its own, carrying those heads
(`kv_transfer.fanout`; the workers' rank services drive them: docs/kv_transfer.md).
"""

from kv_transfer.receiver import Arrival, KVReceiver
from kv_transfer.sender import KVSender, OutboundTransfer
from kv_transfer.state import FailureCause, TransferError, TransferState
from kv_transfer.ticket import KVLayout, KVTicket, model_fingerprint

__all__ = [
    "Arrival",
    "FailureCause",
    "KVLayout",
    "KVReceiver",
    "KVSender",
    "KVTicket",
    "OutboundTransfer",
    "TransferError",
    "TransferState",
    "model_fingerprint",
]
