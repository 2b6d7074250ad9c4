"""Translations between the KVTransfer messages and Python/torch values (no pickle anywhere)."""

from __future__ import annotations

import torch

from kv_transfer.layout import as_bytes, from_bytes
from tandem.config import DTYPES
from tandem.engine.sampler import TokenLogprobs
from tandem.v1 import kv_transfer_pb2 as pb

MAX_MESSAGE_BYTES = 64 << 20
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def first_token_to_proto(token_id: int, logprobs: TokenLogprobs | None) -> pb.FirstToken:
    msg = pb.FirstToken(token_id=token_id)
    if logprobs is not None:
        msg.has_logprobs = True
        msg.logprob = logprobs.logprob
        msg.rank = logprobs.rank
        msg.top.extend(
            pb.TopLogprob(token_id=t, logprob=lp)
            for t, lp in zip(logprobs.top_token_ids, logprobs.top_logprobs, strict=True)
        )
    return msg


def first_token_from_proto(msg: pb.FirstToken) -> tuple[int, TokenLogprobs | None]:
    if not msg.has_logprobs:
        return msg.token_id, None
    return msg.token_id, TokenLogprobs(
        msg.token_id,
        msg.logprob,
        msg.rank,
        tuple(t.token_id for t in msg.top),
        tuple(t.logprob for t in msg.top),
    )


def tensor_to_proto(name: str, tensor: torch.Tensor) -> pb.NamedTensor:
    names = {v: k for k, v in DTYPES.items()}
    cpu = tensor.detach().to("cpu").contiguous()
    return pb.NamedTensor(
        name=name, dtype=names[cpu.dtype], shape=list(cpu.shape), data=bytes(as_bytes(cpu))
    )


def tensor_from_proto(msg: pb.NamedTensor) -> torch.Tensor:
    if msg.dtype not in DTYPES:
        raise ValueError(f"tensor {msg.name!r}: unknown dtype {msg.dtype!r}")
    return from_bytes(bytearray(msg.data), DTYPES[msg.dtype], tuple(msg.shape))
