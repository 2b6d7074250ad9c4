"""The Push stream's encoding and the gRPC plane end to end without a network: messages built
by `wire.layer_message` are valid KVChunks, `parse_chunk` reads any KVChunk, and what the
sender's planes yield lands in the receiver's blocks through its sinks, however it is cut."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest
import torch

from kv_transfer import FailureCause, KVLayout, TransferError, layout
from kv_transfer.layout import as_bytes, gather_tokens, slot_mapping, wire_pieces
from kv_transfer.planes import GrpcPlane
from kv_transfer.sinks import GrpcSink, ShmSink
from kv_transfer.wire import layer_message, parse_chunk
from tandem.v1 import kv_transfer_pb2 as pb

CPU = torch.device("cpu")
HEADS, DIM = 2, 8


def caches(num_layers: int, num_blocks: int, block_size: int, dtype=torch.float32, seed=None):
    """Per-layer caches [2, num_blocks, block_size, heads, dim]: random, or zeros."""
    shape = (2, num_blocks, block_size, HEADS, DIM)
    if seed is None:
        return [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(num_layers)]


@dataclass
class Blocks:
    slots: torch.Tensor
    lock: threading.Lock = field(default_factory=threading.Lock)
    writable: bool = True


# -- messages ----------------------------------------------------------------------------------


def test_layer_message_is_the_kvchunk_protobuf_would_write() -> None:
    message = layer_message(3, 16, [memoryview(b"ab"), memoryview(b"cd")], num_layers=2)
    expected = pb.KVChunk(layer=pb.LayerChunk(layer=3, offset=16, data=b"abcd", num_layers=2))
    assert pb.KVChunk.FromString(message) == expected
    assert message.endswith(b"\x1a\x04abcd")  # data last: the receiver reads it in place
    marker = layer_message(5, num_layers=4)
    assert pb.KVChunk.FromString(marker) == pb.KVChunk(layer=pb.LayerChunk(layer=5, num_layers=4))


def test_parse_chunk_reads_data_in_place_and_any_other_encoding() -> None:
    message = layer_message(1, 8, [memoryview(b"xyz")])
    chunk, data = parse_chunk(message)
    assert (chunk.layer.layer, chunk.layer.offset, chunk.layer.data) == (1, 8, b"")
    assert data.obj is message and bytes(data) == b"xyz"

    # data first, then the other fields: still read in place
    inner = b"\x1a\x02hi" + pb.LayerChunk(layer=2, offset=4).SerializeToString()
    chunk, data = parse_chunk(b"\x12" + bytes([len(inner)]) + inner)
    assert (chunk.layer.layer, chunk.layer.offset, bytes(data)) == (2, 4, b"hi")

    # a repeated data field (the last one wins in protobuf) goes through the runtime
    inner = b"\x1a\x01a\x1a\x01b"
    chunk, data = parse_chunk(b"\x12" + bytes([len(inner)]) + inner)
    assert bytes(data) == b"b"

    header = pb.KVChunk(header=pb.TransferHeader(request_key="r", num_tokens=3))
    chunk, data = parse_chunk(header.SerializeToString())
    assert chunk == header and len(data) == 0


@pytest.mark.parametrize("message", [b"\x12\x05abc", b"\xff", b"\x12\x03\x1a\x09ab"])
def test_parse_chunk_refuses_malformed_bytes(message: bytes) -> None:
    with pytest.raises(ValueError, match="malformed KVChunk"):
        parse_chunk(message)


# -- pieces ------------------------------------------------------------------------------------


@pytest.mark.parametrize("min_run", [1, 1000])  # 1: a view per run; 1000: one gathered copy
@pytest.mark.parametrize("blocks", [[0, 1, 2], [5, 1, 3]])
def test_wire_pieces_are_the_wire_tensor_in_order(
    monkeypatch: pytest.MonkeyPatch, min_run: int, blocks: list[int]
) -> None:
    monkeypatch.setattr(layout, "MIN_VIEW_RUN", min_run)
    (cache,) = caches(1, 6, 4, seed=0)
    slots = slot_mapping(blocks, 4, 10, CPU)
    joined = b"".join(bytes(p) for p in wire_pieces(cache, slots))
    assert joined == bytes(as_bytes(gather_tokens(cache, slots)))


# -- the gRPC plane into its sink ---------------------------------------------------------------


def stream(src: list[torch.Tensor], slots: torch.Tensor, chunk_bytes: int) -> list[bytes]:
    return list(GrpcPlane(chunk_bytes).send_layers(range(len(src)), src, slots, 1e18))


def recut(messages: list[bytes], layer_nbytes: int, piece: int) -> list[bytes]:
    """The same stream cut into `piece`-byte messages (rows split across messages)."""
    data = b"".join(bytes(parse_chunk(m)[1]) for m in messages)
    return [
        layer_message(*divmod(at, layer_nbytes), [memoryview(data)[at : at + piece]])
        for at in range(0, len(data), piece)
    ]


@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16])  # in place; converted
@pytest.mark.parametrize("cut", ["rows", "bytes"])
def test_grpc_plane_into_its_sink_across_layers(dst_dtype: torch.dtype, cut: str) -> None:
    n, row = 10, HEADS * DIM * 4
    src = caches(3, 6, 4, seed=1)
    src_slots = slot_mapping([4, 0, 2], 4, n, CPU)
    messages = stream(src, src_slots, chunk_bytes=3 * row)  # 20 rows a layer: chunks span layers
    assert len(messages) == 20
    if cut == "bytes":
        messages = recut(messages, 2 * n * row, piece=7 * row // 3)
    dst = caches(3, 4, 8, dtype=dst_dtype)
    dst_slots = slot_mapping([3, 1], 8, n, CPU)
    kv_layout = KVLayout(3, HEADS, DIM, 4, "float32")
    sink = GrpcSink(dst, Blocks(dst_slots), kv_layout, n)
    for m in messages:
        chunk, data = parse_chunk(m)
        sink.add(chunk.layer, data, 1e18)
    assert sink.layers_done == 3
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(gather_tokens(d, dst_slots), gather_tokens(s, src_slots).to(dst_dtype))
        assert int(d[:, [0, 2]].count_nonzero()) == 0  # nothing outside the reservation


def test_grpc_sink_refuses_gaps_repeats_and_overruns() -> None:
    n, row = 2, HEADS * DIM * 4
    kv_layout = KVLayout(2, HEADS, DIM, 4, "float32")
    sink = GrpcSink(caches(2, 1, 4), Blocks(torch.arange(n)), kv_layout, n)
    rows = memoryview(bytes(2 * n * row))
    sink.add(pb.LayerChunk(layer=0), rows, 1e18)
    for msg, data in [
        (pb.LayerChunk(layer=0), rows),  # a repeat
        (pb.LayerChunk(layer=1, offset=row), rows[:row]),  # a gap
        (pb.LayerChunk(layer=1), memoryview(bytes(2 * n * row + 1))),  # past the last layer
    ]:
        with pytest.raises(TransferError) as e:
            sink.add(msg, data, 1e18)
        assert e.value.cause == FailureCause.BAD_METADATA
    assert sink.layers_done == 1


def test_markers_must_follow_the_layers_done() -> None:
    kv_layout = KVLayout(4, HEADS, DIM, 4, "float32")
    sink = ShmSink(caches(4, 1, 4), Blocks(torch.arange(2)), kv_layout, 2)
    sink.add(pb.LayerChunk(layer=0, num_layers=2), memoryview(b""), 1e18)
    assert sink.layers_done == 2
    for msg, data in [
        (pb.LayerChunk(layer=1), b""),  # a repeat
        (pb.LayerChunk(layer=3), b""),  # a gap
        (pb.LayerChunk(layer=2, num_layers=3), b""),  # past the last layer
        (pb.LayerChunk(layer=2), b"x"),  # data on a marker
    ]:
        with pytest.raises(TransferError) as e:
            sink.add(msg, memoryview(data), 1e18)
        assert e.value.cause == FailureCause.BAD_METADATA
    sink.add(pb.LayerChunk(layer=2, num_layers=2), memoryview(b""), 1e18)
    assert sink.layers_done == 4
