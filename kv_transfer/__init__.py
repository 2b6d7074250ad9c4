"""KV transfer: moves a request's prompt KV cache from a prefill worker into the blocks a decode
worker reserved for it.

The decode side (`KVReceiver`) reserves and issues a `KVTicket`; the prefill side (`KVSender`)
pushes the KV layer by layer over one of three data planes (a torch.distributed pair, the gRPC
stream itself, or the receiver's shared-memory cache), then the first token. Control always goes
over the gRPC stream, so every plane shares one state machine, one set of deadlines and one set
of typed failures (`kv_transfer.state`).
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
