"""A paged KV cache in GPU memory that a prefill worker on the same host opens by CUDA IPC, so it
writes a request's KV straight into a decode worker's blocks, device to device (no host copy, no
socket): the CUDA counterpart of `shm.SharedKVCache`.

The decode worker allocates every layer in one CUDA allocation (`CudaSharedKVCache.create`) and
exports it once; its `locator` ("cuda-ipc:" + a `CudaIpcCache` message in URL-safe base64) rides
in each ticket. A sender opens the locator (`attach`): torch's `UntypedStorage._new_shared_cuda`
maps the allocation into its own context (cudaIpcOpenMemHandle, cached per process) on the local
index of the GPU that holds it, found by the GPU's UUID, so it works whatever CUDA_VISIBLE_DEVICES
numbering the two processes see; a GPU the sender cannot see is a ValueError (the sender then
uses another plane). Writes from the sender's stream are visible to the decode worker once the
sender has synchronized that stream, which it does before announcing the layers (`ShmPlane`).

The decode worker exports its cache once and keeps it for its whole life, which is what keeps the
allocation valid for the openers (torch's reference counter of an export expects one opener, so
it is not relied on). A sender never writes into a decode worker that has gone: the transfer's
stream breaks first (PEER_LOST).
"""

from __future__ import annotations

import base64

import torch
from google.protobuf.message import DecodeError

from kv_transfer.ticket import KVLayout
from tandem.v1 import kv_transfer_pb2 as pb

LOCATOR_PREFIX = "cuda-ipc:"


def is_cuda_locator(locator: str) -> bool:
    return locator.startswith(LOCATOR_PREFIX)


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def local_device(uuid: str) -> torch.device:
    """This process's index of the GPU with that UUID; ValueError when it cannot see it."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", index)) == uuid:
            return torch.device("cuda", index)
    raise ValueError(f"GPU {uuid} is not visible to this process")


class CudaSharedKVCache:
    """Per-layer KV tensors [2, num_blocks, block_size, heads, slot_dim] over one exported CUDA
    allocation."""

    def __init__(self, whole: torch.Tensor, layout: KVLayout, locator: str) -> None:
        self.layout = layout
        self.locator = locator
        self.num_blocks = whole.shape[2]
        self.kv_caches = list(whole.unbind(0))

    @classmethod
    def create(cls, layout: KVLayout, num_blocks: int, device: torch.device) -> CudaSharedKVCache:
        shape = (layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads)
        whole = torch.zeros(*shape, layout.slot_dim, dtype=layout.torch_dtype, device=device)
        (_, handle, size, offset, counter, counter_offset, event, event_sync) = (
            whole.untyped_storage()._share_cuda_()
        )
        msg = pb.CudaIpcCache(
            device_uuid=device_uuid(whole.device),
            handle=handle,
            size_bytes=size,
            offset_bytes=offset,
            ref_counter_handle=counter,
            ref_counter_offset=counter_offset,
            event_handle=event,
            event_sync_required=event_sync,
        )
        locator = LOCATOR_PREFIX + base64.urlsafe_b64encode(msg.SerializeToString()).decode()
        return cls(whole, layout, locator)

    @classmethod
    def attach(cls, locator: str, layout: KVLayout) -> CudaSharedKVCache:
        """Open another process's cache; ValueError if the locator or its size does not fit."""
        try:
            if not is_cuda_locator(locator):
                raise ValueError("no cuda-ipc: prefix")
            data = base64.urlsafe_b64decode(locator[len(LOCATOR_PREFIX) :])
            msg = pb.CudaIpcCache.FromString(data)
        except (ValueError, DecodeError) as e:  # binascii.Error is a ValueError
            raise ValueError(f"not a CUDA IPC locator ({e}): {locator[:40]!r}") from e
        device = local_device(msg.device_uuid)
        per_block = layout.layer_nbytes(layout.block_size) * layout.num_layers
        if msg.size_bytes % per_block:
            raise ValueError(
                f"the cache is {msg.size_bytes} bytes, not a whole number of {per_block}-byte "
                "blocks"
            )
        storage = torch.UntypedStorage._new_shared_cuda(
            device.index,
            msg.handle,
            msg.size_bytes,
            msg.offset_bytes,
            msg.ref_counter_handle,
            msg.ref_counter_offset,
            msg.event_handle,
            msg.event_sync_required,
        )
        block = (layout.block_size, layout.num_kv_heads, layout.slot_dim)
        whole = torch.empty(0, dtype=layout.torch_dtype, device=device).set_(storage)
        return cls(whole.view(layout.num_layers, 2, -1, *block), layout, locator)

    def close(self) -> None:
        self.kv_caches = []
