"""The in-tree fake for fault injection: a data plane that runs a hook before each layer.

Tests hand it to a sender as `KVSender(wrap_plane=FaultyPlane.around(hook))`; the hook runs on
the sender's stream thread with the source blocks held, so it can stall the transfer (sleep, wait
on an event) or kill the whole process (`os._exit`) at an exact layer, and the tests check that
both ends fail typed, in time, and without leaking blocks. `at_layer` makes such a hook. The
fake hands the inner plane one layer at a time, so a hook at layer l runs with layers < l sent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from kv_transfer.planes import DataPlane
from tandem.engine.tp.kv_view import KVLayer
from tandem.v1 import kv_transfer_pb2 as pb


class FaultyPlane(DataPlane):
    """Wraps a real plane; `before_layer(layer)` runs before the inner plane sends the layer."""

    def __init__(self, inner: DataPlane, before_layer: Callable[[int], None]) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.before_layer = before_layer

    @classmethod
    def around(cls, before_layer: Callable[[int], None]) -> Callable[[DataPlane], DataPlane]:
        """A `wrap_plane` for `KVSender` that wraps every chosen plane with this hook."""
        return lambda inner: cls(inner, before_layer)

    def fill_header(self, header: pb.TransferHeader) -> None:
        self.inner.fill_header(header)

    def send_layers(
        self, layers: range, kv_caches: Sequence[KVLayer], slots: torch.Tensor, deadline: float
    ) -> Iterator[bytes]:
        for layer in layers:
            self.before_layer(layer)
            yield from self.inner.send_layers(range(layer, layer + 1), kv_caches, slots, deadline)

    def flush(self, timeout_s: float) -> None:
        self.inner.flush(timeout_s)


def at_layer(layer: int, action: Callable[[], None]) -> Callable[[int], None]:
    """A `before_layer` hook that runs `action` before layer `layer` only, e.g.
    `at_layer(1, lambda: os._exit(1))` dies with layer 0 sent and the rest not."""

    def hook(current: int) -> None:
        if current == layer:
            action()

    return hook
